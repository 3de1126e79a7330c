"""The compatibility-matrix runner and report (harness/matrix/matrix.py and
harness/report/report.py)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from harness import cli
from harness.matrix import entries, envs, matrix, run_cells
from harness.report import files, html, markdown, report
from posttrain.training import tunix_compat
from tests.processes import gone_within

pytestmark = pytest.mark.host

RELEASES = ("0.0.2", "0.1.0", "0.1.1", "0.1.2", "0.1.3", "0.1.4", "0.1.5", "0.1.6", "0.1.7")


def test_compat_entries_cover_every_release_in_both_flavours():
    loaded = entries.load_entries()
    for release in RELEASES:
        flavours = {e.flavour for e in loaded if e.tunix == release}
        assert flavours == {"current", "era"}, release
    main = [e for e in loaded if e.emulated]
    assert [e.convention for e in main] == ["bound3_update"]
    assert {e.convention for e in loaded} <= set(tunix_compat.KNOWN.values())
    # The expected conventions agree with the contract that pins them per release.
    from contracts.test_tunix_convention import EXPECTED

    for e in loaded:
        if e.flavour in ("current", "era"):
            assert EXPECTED[e.tunix] == e.convention, e.name
    # Tunix main from its git repository: not a default row (CI cannot reach GitHub).
    (source,) = [e for e in loaded if e.flavour == "source"]
    assert source.source == "https://github.com/google/tunix@main" and not source.default
    assert source.convention == "bound3_update"
    # The default run (README command 1): the newest release and emulated main, the two
    # rows that fit its 3 minutes; the report names the others (report.not_run_lines).
    assert {e.name for e in entries.select(loaded)} == {"tunix-0.1.7", "tunix-main-emulated"}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '[[entry]]\nname="a"\ntunix="1"\nflavour="current"\nconvention="bound9"\n',
            "entry 0 (a): convention 'bound9'",
        ),
        (
            '[[entry]]\nname="a"\ntunix="1"\nflavour="current"\nconvention="bound2"\npinz=[]\n',
            "unknown field(s) ['pinz']",
        ),
        (
            '[[entry]]\nname="m"\ntunix="main"\nflavour="emulated"\nconvention="bound2"\n'
            'emulated=true\nbase="nope"\n',
            "base 'nope' is not an entry",
        ),
        (
            '[[entry]]\nname="a"\ntunix="1"\nflavour="current"\nconvention="bound2"\n'
            'pins="jax==0.4"\n',
            "entry 0 (a): pins = 'jax==0.4'; expected a list of requirement strings",
        ),
        ('entry = ["tunix-0.1.7"]\n', "entry 0 is a str; expected a table"),
        ("entry = 3\n", "'entry' is a int; expected [[entry]] tables"),
        ("[[entry]\nname=", "not valid TOML"),
        ('[[entry]]\nname=1\ntunix="1"\nflavour="current"\nconvention="bound2"\n', "name = 1"),
        # every key's type, as its Entry annotation says: a string is not a bool
        (
            '[[entry]]\nname="a"\ntunix="1"\nflavour="current"\nconvention="bound2"\n'
            'default="no"\n',
            "entry 0 (a): default = 'no'; expected true or false",
        ),
        (
            '[[entry]]\nname="m"\ntunix="main"\nflavour="emulated"\nconvention="bound2"\n'
            'emulated="maybe"\nbase="a"\n',
            "entry 0 (m): emulated = 'maybe'; expected true or false",
        ),
        (
            '[[entry]]\nname="a"\ntunix="1"\nflavour="current"\nconvention="bound2"\ndefault=1\n',
            "entry 0 (a): default = 1; expected true or false",
        ),
        (
            '[[entry]]\nname="a"\ntunix="1"\nflavour="current"\nconvention="bound2"\nbroken=true\n',
            "entry 0 (a): broken = True; expected a string",
        ),
        (
            '[[entry]]\nname="a"\ntunix="1"\nflavour="current"\nconvention="bound2"\n'
            'requirements=["x", 2]\n',
            "entry 0 (a): requirements = ['x', 2]; expected a list of requirement strings",
        ),
    ],
)
def test_bad_entries_are_named(tmp_path, text, message):
    path = tmp_path / "entries.toml"
    path.write_text(text)
    with pytest.raises(
        ValueError,
        match=message.replace("(", r"\(")
        .replace(")", r"\)")
        .replace("[", r"\[")
        .replace("]", r"\]"),
    ):
        entries.load_entries(path)


def test_only_selects_by_name_or_prefix_and_rejects_unknown():
    loaded = entries.load_entries()
    assert [e.name for e in entries.select(loaded, ["tunix-0.1.6"])] == ["tunix-0.1.6"]
    assert [e.name for e in entries.select(loaded, ["tunix-0.0", "tunix-0.1.7-era"])] == [
        "tunix-0.0.2",
        "tunix-0.0.2-era",
        "tunix-0.1.7-era",
    ]
    assert len(entries.select(loaded, all_entries=True)) == len(loaded)
    with pytest.raises(ValueError, match="--only 'x' matches no entry"):
        entries.select(loaded, ["x"])


@pytest.mark.skipif(shutil.which("uv") is None, reason="the env build uses uv here")
def test_an_environment_that_cannot_be_built_is_an_error_row(tmp_path):
    entry = entries.Entry(
        name="broken", tunix="0.0.0", flavour="current", convention="bound2"
    )  # google-tunix==0.0.0 does not exist
    env = envs.EnvCache(tmp_path / "envs").ensure(entry)
    assert env.path is None and "google-tunix" in env.error, env.error
    assert not list((tmp_path / "envs").iterdir())  # nothing half-built is kept
    row = matrix.run_entry(entry, env, tmp_path / "reports", "1")
    assert row["error"].startswith("environment build failed") and row["contracts"] == {}
    text = markdown.markdown(report.build([row], "test"))
    assert "| broken 💥 |" in text and "environment build failed" in text


def test_a_warm_cache_rebuilds_nothing(tmp_path):
    calls = []

    def fake_uv(command, env=None):  # stands in for uv: records the call, makes the env
        calls.append(command)
        if "venv" in command:
            (tmp_path / "envs" / command[-1].rsplit("/", 1)[-1] / "bin").mkdir(parents=True)
        return subprocess.CompletedProcess(command, 0, "", "")

    cache = envs.EnvCache(tmp_path / "envs", run=fake_uv)
    entry = entries.Entry(name="e", tunix="0.1.7", flavour="current", convention="bound2")
    first = cache.ensure(entry)
    assert first.built and len(calls) == 2
    again = cache.ensure(entry)
    assert not again.built and again.path == first.path and len(calls) == 2
    other = entries.Entry(
        name="e", tunix="0.1.7", flavour="current", convention="bound2", pins=("qwix==0.1.5",)
    )
    assert cache.path(other) != cache.path(entry)  # pins are part of the key
    cache.ensure(entry, rebuild=True)
    assert len(calls) == 4


def test_junit_cells_group_by_contract_and_keep_the_worst(tmp_path):
    xml = """<testsuites><testsuite>
      <testcase classname="c" name="test_a[x]"><properties>
        <property name="contract" value="tunix.X"/></properties></testcase>
      <testcase classname="c" name="test_b"><properties>
        <property name="contract" value="tunix.X"/></properties>
        <failure message="AssertionError: 2 != 3">long traceback</failure></testcase>
      <testcase classname="c" name="test_c[p]"><skipped message="no tunix"/></testcase>
      <testcase classname="" name="contracts.test_d"><error message="collection failure">x.py:16
E   DeprecationWarning: old
E   ImportError: cannot import name 'List'</error></testcase>
    </testsuite></testsuites>"""
    path = tmp_path / "junit.xml"
    path.write_text(xml)
    cells = matrix.junit_cells(path)
    assert cells == {
        "tunix.X": {"status": "failed", "message": "AssertionError: 2 != 3", "test": "c::test_b"},
        "test_c": {"status": "skipped", "message": "no tunix", "test": "c::test_c[p]"},
        "contracts.test_d": {
            "status": "error",
            "message": "collection failure: ImportError: cannot import name 'List'",
            "test": "contracts.test_d",
        },
    }


def row(name, flavour, cells, sft="passed"):
    return {
        "name": name,
        "tunix": name,
        "flavour": flavour,
        "convention": "bound2",
        "emulated": False,
        "env": {"built": False, "seconds": 1.0, "error": None},
        "versions": {"jax": "0.10.2"},
        "seconds": 1.0,
        "contracts": {
            k: {"status": v, "message": "" if v == "passed" else f"boom in {name}"}
            for k, v in cells.items()
        },
        "sft": {"status": sft, "message": "ok" if sft == "passed" else "sft broke"},
    }


def test_report_names_the_first_failing_entry_after_a_passing_one(tmp_path):
    rows = [
        row("v1", "current", {"A": "failed", "B": "passed"}),
        row("v2", "current", {"A": "passed", "B": "passed"}),
        row("v3", "current", {"A": "failed", "B": "error"}, sft="failed"),
        row("v1-era", "era", {"A": "passed", "B": "passed"}),
    ]
    built = report.build(rows, "test machine")
    firsts = {(f["flavour"], f["contract"]): f for f in built["first_failures"]}
    assert firsts[("current", "A")]["first_failing"] == "v1"  # fails from the start
    assert firsts[("current", "A")]["after_passing"] == ""
    assert firsts[("current", "B")]["first_failing"] == "v3"
    assert firsts[("current", "B")]["after_passing"] == "v2"
    assert firsts[("current", "sft")]["error"] == "sft broke"
    assert ("era", "A") not in firsts
    paths = files.write(built, tmp_path)
    md, js, page = (p.read_text() for p in paths)
    assert "first fails in **v3** after passing in v2: boom in v3" in md
    assert "| v3 | - · 0.10.2 · - · - · - | ❌ | 💥 | ❌ |  |  |" in md
    assert json.loads(js)["columns"] == ["A", "B", "sft", "rl", "dpo", "distill", "vision"]
    assert "<b>v3</b>" in page and "boom in v3" in page


def test_the_report_files_are_its_three_renderings_without_credentials(tmp_path):
    """``files.write`` makes a nested directory and writes ``compat-matrix.md``,
    ``.json`` (indented by 2) and ``.html``, each exactly its rendering of the report with
    a source URL's credentials hidden."""
    secret = "https://user:token@example.com/tunix.git"
    built = report.build([row("v1", "current", {"A": "passed"})], f"machine {secret}")
    where = tmp_path / "a" / "b"
    paths = files.write(built, where)
    assert [p.name for p in paths] == [
        "compat-matrix.md",
        "compat-matrix.json",
        "compat-matrix.html",
    ]
    md, js, page = (p.read_text() for p in paths)
    shown = "https://***@example.com/tunix.git"
    assert md == markdown.markdown(built).replace(secret, shown)
    assert js == json.dumps(built, indent=2).replace(secret, shown) + "\n"
    assert page == html.page(built).replace(secret, shown)
    assert all(secret not in text and shown in text for text in (md, js, page))


def test_update_merges_rerun_rows_into_the_report_in_entry_order(tmp_path):
    files.write(
        report.build(
            [row("v1", "current", {"A": "passed"}), row("v2", "current", {"A": "failed"})], "m"
        ),
        tmp_path,
    )
    merged = report.combine(
        [
            report.load(tmp_path)["entries"],
            [row("v2", "current", {"A": "passed"}), row("v0", "current", {"A": "passed"})],
        ],
        ["v0", "v1", "v2"],
    )
    assert [r["name"] for r in merged] == ["v0", "v1", "v2"]
    assert merged[2]["contracts"]["A"]["status"] == "passed"


def test_first_error_prefers_the_exception_line_over_progress_noise():
    noisy = (
        "Training: 75%| WARNING:absl:Path x could not be identified. Got error: Expected\n"
        'Traceback (most recent call last):\n  File "x.py", line 1\n'
        "AttributeError: 'int' object has no attribute 'endswith'\n"
    )
    assert envs.first_error(noisy) == "AttributeError: 'int' object has no attribute 'endswith'"
    uv = (
        "error: No solution found when resolving dependencies\n"
        "  cause: Because there is no version of google-tunix==0.0.0\n"
    )
    assert envs.first_error(uv) == (
        "error: No solution found when resolving dependencies "
        "Because there is no version of google-tunix==0.0.0"
    )


def test_a_run_killed_by_a_signal_says_so():
    """The README's matrix on a loaded machine (2026-12-06) reported a GRPO run as failed with
    its first progress line: the run had died without an error. A real process killed by
    SIGKILL names the signal and its last output; one that exits 1 keeps its error line."""
    killed = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os, signal; print('Tunix RL: cluster', flush=True); "
            "os.kill(os.getpid(), signal.SIGKILL)",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert killed.returncode == -signal.SIGKILL
    assert envs.failure(killed) == (
        "killed by SIGKILL, no error printed (out of memory?); its last output: Tunix RL: cluster"
    )
    silent = subprocess.CompletedProcess([], -999, "", "")
    assert envs.failure(silent).startswith("killed by signal 999, no error printed;")
    # XLA aborting: the GRPO run's all-gather rendezvous timed out on a loaded machine (2026-12-06)
    fatal = (
        "Tunix RL: cluster\n"
        "E1206 06:19:55.932614   19554 rendezvous.cc:116] [id=0] This thread has been waiting\n"
        "F1206 06:20:35.932789   19549 rendezvous.cc:161] [id=2] Termination timeout for "
        "`all gather` of 40 seconds exceeded.\n"
        "F1206 06:20:35.932992   19551 rendezvous.cc:161] [id=3] Termination timeout\n"
        "*** Check failure stack trace: ***\n    @     0x7fdeb1fc8c91  std::__invoke_impl<>()\n"
    )
    aborted = subprocess.CompletedProcess([], -signal.SIGABRT, "", fatal)
    assert envs.failure(aborted) == (
        "killed by SIGABRT: rendezvous.cc:161] [id=2] Termination timeout for `all gather` "
        "of 40 seconds exceeded."
    )
    assert envs.failure(silent).endswith("its last output: nothing")
    failed = subprocess.CompletedProcess([], 1, "", "progress\nValueError: bad row\n")
    assert envs.failure(failed) == "ValueError: bad row"


def test_every_entry_runs_with_one_compile_cache_beside_the_environments(tmp_path, monkeypatch):
    """Rows share one JAX compilation cache (most run the same jax/jaxlib, so the second
    row's compiles hit the first's): every command of every entry gets
    JAX_COMPILATION_CACHE_DIR in the environment cache's root, and may cache bytecode
    (pytest keeps its assertion-rewritten modules)."""
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    seen = []

    def fake_run(command, env=None):
        seen.append(env or {})
        return subprocess.CompletedProcess(command, 0, '{"jax": "0.10.2"}\n', "")

    for name, version in (("e", "0.1.7"), ("f", "0.1.5")):
        path = tmp_path / "envs" / f"{name}-0123"
        (path / "bin").mkdir(parents=True)
        entry = entries.Entry(name=name, tunix=version, flavour="current", convention="bound2")
        env = envs.EnvResult(path=path, built=False, seconds=0.0)
        matrix.run_entry(entry, env, tmp_path / "reports", "1", run=fake_run)
    cache_dirs = [e.get("JAX_COMPILATION_CACHE_DIR") for e in seen if "POSTTRAIN_DEVICES" in e]
    # contracts, sft, rl, dpo, the distill probe and run, the vision probe and run
    assert len(cache_dirs) == 16
    assert set(cache_dirs) == {str((tmp_path / "envs" / "jax-compile").resolve())}, cache_dirs
    assert not any("PYTHONDONTWRITEBYTECODE" in e for e in seen)


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_a_rows_run_cells_go_side_by_side_as_many_as_jobs_longest_first(
    tmp_path, monkeypatch, jobs
):
    """After the contracts, the run cells start in START_ORDER and run ``--jobs`` at a
    time; each row cell still gets its own result, and its phase its own wall time."""
    import threading
    import time

    assert sorted(run_cells.START_ORDER) == sorted(run_cells.CELLS)
    lock = threading.Lock()
    started, running, most = [], [0], [0]

    def cell(name):
        def run(entry, env, environ, runner):
            with lock:
                started.append(name)
                running[0] += 1
                most[0] = max(most[0], running[0])
            time.sleep(0.2)
            with lock:
                running[0] -= 1
            return {"status": "passed", "message": name}

        return run

    monkeypatch.setattr(run_cells, "CELLS", {n: cell(n) for n in run_cells.CELLS})
    path = tmp_path / "envs" / "e-0123"
    (path / "bin").mkdir(parents=True)
    entry = entries.Entry(name="e", tunix="0.1.7", flavour="current", convention="bound2")
    env = envs.EnvResult(path=path, built=False, seconds=0.0)
    fake_run = lambda command, env=None: subprocess.CompletedProcess(command, 0, "{}\n", "")  # noqa: E731
    row = matrix.run_entry(entry, env, tmp_path / "reports", jobs, run=fake_run)
    first = int(jobs)  # those start at once, in either order
    assert sorted(started[:first]) == sorted(run_cells.START_ORDER[:first]), started
    assert started[first:] == list(run_cells.START_ORDER[first:]) or jobs != "1"
    assert most[0] == int(jobs)
    assert all(row[n] == {"status": "passed", "message": n} for n in run_cells.CELLS)
    assert all(row["phase_seconds"][f"{n} run"] >= 0.2 for n in run_cells.CELLS)
    assert list(row["phase_seconds"])[-len(run_cells.CELLS) :] == [
        f"{n} run" for n in run_cells.CELLS
    ]
    assert run_cells.workers("0") == 1 and run_cells.workers("3") == 3


def test_auto_jobs_run_as_many_cells_as_cpus_and_one_where_the_count_is_unknown(monkeypatch):
    monkeypatch.setattr(run_cells.os, "cpu_count", lambda: 6)
    assert run_cells.workers("auto") == 6
    monkeypatch.setattr(run_cells.os, "cpu_count", lambda: None)
    assert run_cells.workers("auto") == 1


def test_a_missing_entries_file_is_named(tmp_path):
    with pytest.raises(ValueError, match="does not exist; expected a TOML file"):
        entries.load_entries(tmp_path / "nope.toml")
    with pytest.raises(ValueError, match="is a directory; expected a TOML file"):
        entries.load_entries(tmp_path)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["matrix", "--jobs", "abc"], "argument --jobs/-j: 'abc': expected a non-negative"),
        (["gate", "--jobs", "-1"], "argument --jobs/-j: '-1': expected a non-negative"),
        (["matrix", "--report-dir", "{file}"], "is a file; expected a directory"),
        (["gate", "--report-dir", "{file}"], "is a file; expected a directory"),
        (["matrix", "--entries", "{missing}"], "does not exist; expected a TOML file"),
    ],
)
def test_harness_bad_options_exit_2_before_any_work(tmp_path, capsys, argv, message):
    """Bad options are refused before an environment is built or a test is run."""
    file = tmp_path / "a-file"
    file.write_text("mine\n")
    argv = [a.format(file=file, missing=tmp_path / "missing.toml") for a in argv]
    try:
        status = cli.main(argv)
    except SystemExit as exit:  # argparse's own errors
        status = exit.code
    err = capsys.readouterr().err
    assert status == 2 and message in err, err
    assert file.read_text() == "mine\n"


def test_an_internal_error_is_one_line_and_exit_1(monkeypatch, capsys):
    def broken(args, extra):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(cli, "run_gate", broken)
    monkeypatch.delenv("POSTTRAIN_DEBUG", raising=False)
    assert cli.main(["gate"]) == 1
    err = capsys.readouterr().err
    assert err == (
        "posttrain-harness: internal error: RuntimeError: boom "
        "(rerun with POSTTRAIN_DEBUG=1 for the traceback)\n"
    )
    monkeypatch.setenv("POSTTRAIN_DEBUG", "1")
    with pytest.raises(RuntimeError, match="boom"):
        cli.main(["gate"])


def test_run_returns_a_row_per_entry_and_emulated_rows_borrow_their_release_env(tmp_path):
    """matrix.run builds each environment once through the cache (an emulated row: its
    base release's), runs the entry and returns the rows in order; the CLI only prints."""
    release = entries.Entry(name="r", tunix="0.1.7", flavour="current", convention="bound2")
    emulated = entries.Entry(
        name="m",
        tunix="main",
        flavour="emulated",
        convention="bound3_update",
        emulated=True,
        base="r",
    )
    broken = entries.Entry(
        name="b", tunix="0.0.1", flavour="current", convention="bound2", broken="no wheel"
    )
    ensured, commands, lines = [], [], []

    class Cache:
        def path(self, entry):
            return tmp_path / "envs" / entry.name

        def ensure(self, entry, rebuild=False):
            ensured.append(entry.name)
            (self.path(entry) / "bin").mkdir(parents=True, exist_ok=True)
            return envs.EnvResult(self.path(entry), False, 0.0)

    def fake_run(command, env=None):
        commands.append((command, env or {}))
        return subprocess.CompletedProcess(command, 0, "{}\n", "")

    rows = matrix.run(
        [release, emulated, broken],
        [release, emulated, broken],
        Cache(),
        tmp_path,
        "1",
        log=lines.append,
        runner=fake_run,
    )
    assert [r["name"] for r in rows] == ["r", "m", "b"]
    assert ensured == ["r", "r"]  # the emulated row in its base's env; the broken one: none
    assert rows[2]["error"] == "not run: no wheel"
    pytest_runs = [c for c, _ in commands if "pytest" in c]
    assert [c[c.index("--conventions") + 1] for c in pytest_runs] == ["installed", "bound3_update"]
    assert any(line.startswith("[2/3] m: environment r") for line in lines), lines


def test_the_sft_run_is_one_description_for_both_paths(tmp_path):
    """The release path's ``posttrain sft`` options parse to the emulated path's SFTConfig."""
    from posttrain import cli
    from posttrain.sft.run import SFTConfig

    output = str(tmp_path / "out")
    assert cli.parse_options(run_cells.sft_argv(output)) == SFTConfig(
        **run_cells.SFT_RUN, output=output
    )


def test_the_rl_run_parses_as_a_grpo_run_config(tmp_path):
    """The rl cell's ``posttrain grpo`` options are all real options with the intended
    values, and the run they describe passes its checks."""
    from posttrain import cli

    output = str(tmp_path / "out")
    cfg = cli.parse_options(run_cells.rl_argv(output))
    assert {k: getattr(cfg, k) for k in run_cells.RL_RUN} == run_cells.RL_RUN
    assert cfg.output == output
    cfg.check()


def test_the_dpo_run_parses_as_a_dpo_run_config(tmp_path):
    """The dpo cell's ``posttrain dpo`` options are all real options with the intended
    values, and the run they describe passes its checks."""
    from posttrain import cli

    output = str(tmp_path / "out")
    cfg = cli.parse_options(run_cells.dpo_argv(output))
    assert {k: getattr(cfg, k) for k in run_cells.DPO_RUN} == run_cells.DPO_RUN
    assert cfg.output == output
    cfg.check()


def test_the_matrix_command_runs_its_entries_and_writes_the_report(tmp_path, capsys):
    """End to end through the CLI (entries file -> matrix.run -> report), on an entry
    that needs no environment: it exits 1 (an error row) and writes all three files."""
    path = tmp_path / "entries.toml"

    def matrix_cli(*extra):
        args = ["--entries", str(path), "--report-dir", str(tmp_path / "r")]
        args += ["--index-url", "off"]  # no network in the test
        return cli.main(["matrix", *args, "--cache", str(tmp_path / "envs"), *extra])

    path.write_text(
        '[[entry]]\nname="gone"\ntunix="0.0.1"\nflavour="current"\nconvention="bound2"\n'
        'default=true\nbroken="yanked from PyPI"\n'
    )
    status = matrix_cli()
    out, err = capsys.readouterr()
    assert status == 1, err
    assert "| gone 💥 |" in out and "**gone**: not run: yanked from PyPI" in out
    assert {p.name for p in (tmp_path / "r").iterdir()} >= {
        "compat-matrix.md",
        "compat-matrix.json",
        "compat-matrix.html",
    }
    assert "[1/1] gone: environment" in err
    # rerun with --update into a report holding another row: the header says so
    report_json = tmp_path / "r" / "compat-matrix.json"
    kept = json.loads(report_json.read_text())
    kept["entries"].append({**kept["entries"][0], "name": "older"})
    report_json.write_text(json.dumps(kept))
    path.write_text(
        path.read_text()
        + '[[entry]]\nname="older"\ntunix="0.0.0"\nflavour="current"\nconvention="bound2"\n'
        'broken="never ran here"\n'
    )
    matrix_cli("--only", "gone", "--update")
    out, _ = capsys.readouterr()
    assert "1 entries in" in out and "(1 rerun with --update; the other 1 rows kept)" in out


def test_two_checkouts_do_not_share_an_environment(monkeypatch, tmp_path):
    """The checkout is installed editable: another clone must get its own environment,
    or its matrix would test the first clone's code."""
    entry = entries.Entry(name="e", tunix="0.1.7", flavour="current", convention="bound2")
    here = envs.env_key(entry)
    other = tmp_path / "other-clone"
    other.mkdir()
    (other / "pyproject.toml").write_bytes((envs.REPO / "pyproject.toml").read_bytes())
    monkeypatch.setattr(envs, "REPO", other)
    assert envs.env_key(entry) != here


def test_the_distill_run_parses_as_a_distill_run_config(tmp_path):
    """The distill cell's ``posttrain distill`` options are all real options with the
    intended values, and the run they describe passes its checks."""
    from harness.matrix import distill_cell
    from posttrain import cli

    output = str(tmp_path / "out")
    cfg = cli.parse_options(distill_cell.distill_argv(output))
    assert {k: getattr(cfg, k) for k in distill_cell.DISTILL_RUN} == distill_cell.DISTILL_RUN
    assert cfg.output == output
    cfg.check()


def test_the_distill_cell_reads_the_run_and_says_na_without_the_module(tmp_path):
    """``passed`` with the first and last step's loss and KL; n/a where the entry's Tunix has
    no ``tunix.distillation`` or the row is emulated; ``failed`` with the error line."""
    from harness.matrix import distill_cell

    release = entries.Entry(name="r", tunix="0.1.7", flavour="current", convention="bound2")
    emulated = dataclasses.replace(release, emulated=True)
    env = envs.EnvResult(path=tmp_path, built=False, seconds=0.0)

    def runner(probe_rc, run_rc, steps):
        def run(command, env=None):
            if "-c" in command:
                return subprocess.CompletedProcess(command, probe_rc, "", "ModuleNotFoundError")
            out = Path(command[command.index("--output") + 1])
            records = [{"step": i + 1, "loss": 2.0 - i, "kl": 0.5 - 0.1 * i} for i in range(steps)]
            (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
            return subprocess.CompletedProcess(command, run_rc, "", "ValueError: boom")

        return run

    cell = distill_cell.run_cell(release, env, {}, runner(0, 0, 2))
    assert cell == {
        "status": "passed",
        "message": "2 distill steps, loss 2.0000 -> 1.0000, kl 0.5000 -> 0.4000",
    }
    cell = distill_cell.run_cell(release, env, {}, runner(1, 0, 2))
    assert cell == {"status": "skipped", "message": "this Tunix has no tunix.distillation"}
    assert distill_cell.run_cell(emulated, env, {}, runner(0, 0, 2))["status"] == "skipped"
    assert distill_cell.run_cell(release, env, {}, runner(0, 1, 2))["status"] == "failed"
    assert distill_cell.run_cell(release, env, {}, runner(0, 0, 1))["status"] == "failed"


def test_the_vision_run_parses_as_an_sft_vision_config(tmp_path):
    """The vision cell's ``posttrain sft --vision`` options are all real options with the
    intended values, and the run they describe passes its checks."""
    from harness.matrix import vision_cell
    from posttrain import cli

    output = str(tmp_path / "out")
    cfg = cli.parse_options(vision_cell.vision_argv("d.jsonl", output))
    assert {k: getattr(cfg, k) for k in vision_cell.VISION_RUN} == vision_cell.VISION_RUN
    assert cfg.vision and cfg.data == "d.jsonl" and cfg.output == output
    cfg.check()


def test_the_vision_cell_reads_the_run_and_says_na_without_the_images_field(tmp_path):
    """``passed`` with the first and last step's loss; n/a where the entry's
    ``TrainingInput`` has no images field or the row is emulated; ``failed`` with the
    error line of the probe or the run, or with the records of a short run."""
    from harness.matrix import vision_cell

    release = entries.Entry(name="r", tunix="0.1.7", flavour="current", convention="bound2")
    emulated = dataclasses.replace(release, emulated=True)
    env = envs.EnvResult(path=tmp_path, built=False, seconds=0.0)

    def runner(probe_rc, run_rc, steps):
        def run(command, env=None):
            if "-c" in command:
                return subprocess.CompletedProcess(command, probe_rc, "", "ImportError: x")
            out = Path(command[command.index("--output") + 1])
            out.mkdir(parents=True)
            records = [{"step": i + 1, "loss": 2.0 - i} for i in range(steps)]
            (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
            return subprocess.CompletedProcess(command, run_rc, "", "ValueError: boom")

        return run

    steps = vision_cell.VISION_RUN["steps"]
    cell = vision_cell.run_cell(release, env, {}, runner(0, 0, steps))
    last = 2.0 - (steps - 1)
    assert cell == {"status": "passed", "message": f"3 vision steps, loss 2.0000 -> {last:.4f}"}
    cell = vision_cell.run_cell(release, env, {}, runner(vision_cell.NO_FIELD, 0, steps))
    assert cell == {
        "status": "skipped",
        "message": "this Tunix's TrainingInput has no images field (google-tunix >= 0.1.6 has it)",
    }
    assert vision_cell.run_cell(emulated, env, {}, runner(0, 0, steps)) == {
        "status": "skipped",
        "message": "the vision run drives the installed trainer; the run is the base release's",
    }
    assert vision_cell.run_cell(release, env, {}, runner(1, 0, steps)) == {
        "status": "failed",
        "message": "ImportError: x",
    }
    assert vision_cell.run_cell(release, env, {}, runner(0, 1, steps)) == {
        "status": "failed",
        "message": "ValueError: boom",
    }
    short = vision_cell.run_cell(release, env, {}, runner(0, 0, steps - 1))
    assert short["status"] == "failed" and short["message"].startswith("metrics: [{'step': 1")


def test_every_run_cell_is_a_report_column_in_order():
    """A cell added to :data:`harness.matrix.run_cells.CELLS` is a report column (and a bisect
    target) in the same order, and no column lacks its runner."""
    assert tuple(run_cells.CELLS) == report.RUN_CELLS


# a command that starts a grandchild (its pid written to argv[1]) and waits on it
_TREE = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
    "open(sys.argv[1], 'w').write(str(child.pid))\n"
    "print('started', flush=True)\n"
    "time.sleep(120)\n"
)


def _wait_for(path: Path) -> int:
    import time

    for _ in range(200):
        if path.is_file() and path.read_text():
            return int(path.read_text())
        time.sleep(0.05)
    raise AssertionError(f"{path} never written")


def test_a_command_past_its_limit_is_killed_with_what_it_started(tmp_path, monkeypatch):
    """A hung cell ends its row, not the matrix: past ``COMMAND_TIMEOUT_S`` the command's
    whole process group dies (the grandchild too), the status is 124 and its cell says
    ``TimeoutError: ...`` (no 'out of memory?' guess)."""
    # time for the command to start its grandchild first on a loaded machine (at 1.5 s the
    # gate's, xdist's other worker busy, killed it before the grandchild existed)
    monkeypatch.setattr(envs, "COMMAND_TIMEOUT_S", 4.0)
    pid_file = tmp_path / "grandchild"
    done = envs.run_command([sys.executable, "-c", _TREE, str(pid_file)])
    assert done.returncode == envs.TIMED_OUT == 124
    assert done.stdout == "started\n"
    assert gone_within([_wait_for(pid_file)], 10)
    assert (
        envs.failure(done)
        == f"TimeoutError: {Path(sys.executable).name} ran past the matrix's 4 s limit on one "
        "command; killed with what it started"
    )
    quick = envs.run_command([sys.executable, "-c", "import sys; print('out'); sys.exit(3)"])
    assert (quick.returncode, quick.stdout) == (3, "out\n")  # under the limit: as before


def test_an_interrupted_wait_kills_the_commands_group_and_re_raises(tmp_path, monkeypatch):
    """Its own session hears no Ctrl-C: the matrix kills the group itself before the
    interrupt goes on."""
    pid_file = tmp_path / "grandchild"
    waits = []
    real = subprocess.Popen.communicate

    def interrupted(self, *args, **kwargs):
        if not waits:
            waits.append(_wait_for(pid_file))
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "communicate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        envs.run_command([sys.executable, "-c", _TREE, str(pid_file)])
    assert waits and gone_within(waits, 10)


def test_an_interrupt_of_the_side_by_side_cells_kills_every_cells_group(tmp_path, monkeypatch):
    """Ctrl-C reaches the main thread, waiting on the pool, not the cells' commands (each
    in a session of its own): it kills every running group, so the pool's threads end
    instead of waiting out their commands."""
    import concurrent.futures
    import time

    files = {cell: tmp_path / cell for cell in ("a", "b")}

    def cell(name):
        return lambda entry, env, environ, run: run(
            [sys.executable, "-c", _TREE, str(files[name])], None
        )

    monkeypatch.setattr(run_cells, "CELLS", {name: cell(name) for name in files})
    monkeypatch.setattr(run_cells, "START_ORDER", list(files))
    grandchildren = []

    def interrupted(self, timeout=None):
        grandchildren.extend(_wait_for(path) for path in files.values())
        raise KeyboardInterrupt

    monkeypatch.setattr(concurrent.futures.Future, "result", interrupted)
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        matrix.run_side_by_side(None, None, {}, envs.run_command, 2, lambda name, work: work())
    assert time.monotonic() - start < 30  # not the commands' 120 s
    assert len(grandchildren) == 2 and gone_within(grandchildren, 10)
    assert not envs._RUNNING
