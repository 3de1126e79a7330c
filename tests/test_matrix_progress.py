"""The matrix as a person meets it: progress while it runs, where its report goes, and
what the report says it left out."""

from __future__ import annotations

import io
import json
import re
import subprocess
from pathlib import Path

import pytest

from harness import cli, subcommands
from harness.matrix import entries, envs, matrix, progress
from harness.report import files, html, markdown, report
from tests.test_matrix_inputs import _row

pytestmark = pytest.mark.host

ROOT = Path(__file__).resolve().parent.parent


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [(0, "0:00"), (59.9, "0:59"), (61, "1:01"), (3599, "59:59"), (3600, "1:00:00"), (-3, "0:00")],
)
def test_clock_shows_minutes_and_seconds(seconds, shown):
    assert progress.clock(seconds) == shown


def test_the_live_line_names_row_phase_and_both_elapsed_times():
    """[i/n] name · phase · row m:ss, all m:ss: the row's time restarts at each row."""
    now = FakeClock()
    shown = progress.Progress(2, io.StringIO(), live=False, now=now)
    now.t += 30
    assert shown.status_text() == "[0/2] · starting · row 0:30, all 0:30"
    shown.row(1, "tunix-0.1.7")
    shown.phase("contracts")
    now.t += 42
    assert shown.status_text() == "[1/2] tunix-0.1.7 · contracts · row 0:42, all 1:12"
    shown.row(2, "tunix-main-emulated")
    now.t += 5
    assert shown.status_text() == "[2/2] tunix-main-emulated · starting · row 0:05, all 1:17"


def test_off_a_terminal_only_the_log_lines_are_written():
    """CI logs stay clean: no status line, no cursor or colour codes, lines unwrapped."""
    out = io.StringIO()
    shown = progress.Progress(1, out, live=False)
    shown.row(1, "e")
    shown.phase("contracts")
    long = "[1/1] e: [bold]" + "x" * 300 + " :smile:"
    shown.log(long)
    shown.close()
    assert out.getvalue() == long + "\n"


def test_on_a_terminal_the_live_line_is_drawn_and_removed():
    """One live line across rows (rich allows one live display at a time), log lines
    printed verbatim above it, and closing twice is harmless."""
    out = io.StringIO()
    shown = progress.Progress(2, out, live=True)
    shown.row(1, "tunix-0.1.7")
    shown.phase("sft run")
    line = "[1/2] tunix-0.1.7: 43/43 cells pass [bold]x[/bold] :smile: (83 s)"
    shown.log(line)
    shown.row(2, "tunix-main-emulated")
    shown.close()
    shown.close()
    text = out.getvalue()
    assert "tunix-0.1.7 · sft run · row" in text
    assert "\x1b[" in text  # drawn over itself, then cleared
    shown_lines = re.sub(r"\x1b\[\?25[lh]", "", text).splitlines()  # cursor hidden, shown
    assert line in shown_lines  # no markup, emoji or highlighting applied


def test_the_default_stream_is_stderr(capsys):
    shown = progress.Progress(1, live=False)
    shown.log("to stderr")
    assert capsys.readouterr().err == "to stderr\n"


class RecordingProgress(progress.Progress):
    def __init__(self, total: int) -> None:
        super().__init__(total, io.StringIO(), live=False)
        self.events: list[tuple[str, str]] = []

    def row(self, index: int, name: str) -> None:
        super().row(index, name)
        self.events.append(("row", f"{index}:{name}"))

    def phase(self, name: str) -> None:
        super().phase(name)
        self.events.append(("phase", name))


def test_the_matrix_reports_each_row_and_phase_in_order(tmp_path):
    """Each row announces itself, then its phases in the order they run; a finished row
    gets one log line with its verdict."""
    release = entries.Entry(name="r", tunix="0.1.7", flavour="current", convention="bound2")

    class Cache:
        def path(self, entry):
            return tmp_path / "envs" / entry.name

        def ensure(self, entry, rebuild=False):
            (self.path(entry) / "bin").mkdir(parents=True, exist_ok=True)
            return envs.EnvResult(self.path(entry), False, 0.0)

    def fake_run(command, env=None):
        return subprocess.CompletedProcess(command, 0, "{}\n", "")

    shown = RecordingProgress(1)
    matrix.run([release], [release], Cache(), tmp_path, "1", progress=shown, runner=fake_run)
    assert shown.events == [
        ("row", "1:r"),
        ("phase", "environment"),
        ("phase", "versions"),
        ("phase", "contracts"),
        # one at a time (jobs "1"), the run cells start longest first (START_ORDER)
        ("phase", "vision run"),
        ("phase", "rl run"),
        ("phase", "distill run"),
        ("phase", "dpo run"),
        ("phase", "sft run"),
    ]
    lines = shown.console.file.getvalue().splitlines()
    assert lines[0] == "[1/1] r: environment r"
    assert lines[-1].startswith("[1/1] r: 0/5 cells pass"), lines


def test_a_report_of_some_entries_names_the_others_and_how_to_run_them():
    built = report.build([_row("a")], "m", not_run=["a", "b", "c"])
    assert built["not_run"] == ["b", "c"]
    md = markdown.markdown(built)
    head = md.split("### What broke")[0]
    assert "Not run here (2 entries): b, c." in head
    assert "`posttrain-harness matrix --all`" in head
    page = html.page(built)
    assert (
        "Not run in this report" in page and "<code>posttrain-harness matrix --all</code>" in page
    )
    whole = report.build([_row("a"), _row("b")], "m", not_run=["a", "b"])
    assert whole["not_run"] == [] and "Not run" not in markdown.markdown(whole)


def test_a_users_run_writes_outside_the_committed_report(tmp_path):
    """The default report directory is untracked, so a first run leaves `git status` clean;
    the committed reference is written only when asked for (--report-dir reports)."""
    args = cli._parser().parse_args(["matrix"])
    assert args.report_dir == Path("reports/latest")
    assert cli._parser().parse_args(["report", "merge", "x"]).report_dir == Path("reports/latest")
    # git's own matching of the checkout's .gitignore, in a scratch repository (the test
    # also runs from copies that are not git checkouts: the mutation runs)
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text((ROOT / ".gitignore").read_text())

    def ignored(path: str) -> bool:
        done = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=tmp_path)
        assert done.returncode in (0, 1), done
        return done.returncode == 0

    assert ignored("reports/latest/compat-matrix.json")
    assert ignored("reports/latest/matrix/tunix-0.1.7.xml")
    assert not ignored("reports/compat-matrix.json")


def test_a_first_run_is_compared_with_the_committed_reference(tmp_path, monkeypatch):
    reference = tmp_path / "repo" / "reports"
    files.write(report.build([_row("a")], "ref machine"), reference)
    monkeypatch.setattr(entries, "REPO", tmp_path / "repo")
    compared = subcommands._reference_report(tmp_path / "latest")
    assert compared is not None and compared["machine"] == "ref machine"
    assert subcommands._reference_report(reference) is None  # writing the reference itself
    json.loads((reference / "compat-matrix.json").read_text())
