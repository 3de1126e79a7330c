"""The matrix report (harness/report/report.py, markdown.py, html.py, drift.py): flips
since the previous report, the fan-out merge, drift against the package index, the
Markdown's size, and the HTML as a real browser renders it."""

from __future__ import annotations

import http.server
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from harness import cli
from harness.matrix import entries, matrix
from harness.report import drift, files, html, markdown, report

pytestmark = pytest.mark.host

REPO = Path(__file__).resolve().parent.parent
COMMITTED = REPO / "reports" / "compat-matrix.json"


def row(name, contracts, flavour="current", versions=None, **runs):
    return {
        "name": name,
        "tunix": "0.1.7",
        "flavour": flavour,
        "convention": "bound2",
        "emulated": False,
        "env": {"built": False, "seconds": 0.0, "error": None},
        "versions": versions or {},
        "contracts": {k: {"status": v, "message": f"{k} {v}"} for k, v in contracts.items()},
        "sft": runs.get("sft"),
        "rl": None,
        "dpo": None,
        "seconds": 1.0,
    }


def test_flip_detection_marks_exactly_the_changed_cells():
    before = report.build(
        [
            row("a", {"x": "passed", "y": "passed", "z": "failed"}),
            row("b", {"x": "passed", "y": "skipped"}),
        ],
        "m",
    )
    after = report.build(
        [
            row("a", {"x": "failed", "y": "passed", "z": "passed", "new": "failed"}),
            row("b", {"x": "warned"}),  # y no longer ran in b
            row("c", {"x": "failed"}),  # a new entry: new, not flipped
        ],
        "m",
        previous=before,
    )
    assert after["changed"] == [
        {"entry": "a", "column": "x", "from": "passed", "to": "failed"},
        {"entry": "a", "column": "z", "from": "failed", "to": "passed"},
        {"entry": "b", "column": "x", "from": "passed", "to": "warned"},
        {"entry": "b", "column": "y", "from": "skipped", "to": "not run"},
    ]
    assert after["previous"]["generated"] == before["generated"]
    page = html.page(after)
    flipped = [c for c in page.split("<td ")[1:] if " flip" in c.split(">")[0]]
    assert len(flipped) == 4
    assert report.build(after["entries"], "m", previous=after)["changed"] == []
    assert report.build(after["entries"], "m")["changed"] == []  # no previous: nothing flips


def test_deprecations_are_listed_once_with_the_first_entry_showing_them():
    a = row("a", {"x": "passed"})
    b = row("b", {"x": "warned", "y": "warned"})
    c = row("c", {"x": "warned"})
    text = "DeprecationWarning: '.value' access is now deprecated"
    b["contracts"]["x"]["warnings"] = [f"{text} (tunix/sft/peft_trainer.py:212)"]
    b["contracts"]["y"]["warnings"] = [f"{text} (tunix/sft/peft_trainer.py:212)"]
    c["contracts"]["x"]["warnings"] = [
        f"{text} (tunix/sft/peft_trainer.py:230)",
        "FutureWarning: f",
    ]
    found = report.build([a, b, c], "m")["deprecations"]
    assert found == [
        {
            "warning": text,
            "where": "tunix/sft/peft_trainer.py:212",
            "first_entry": "b",
            "entries": ["b", "c"],
            "columns": ["x", "y"],
        },
        {
            "warning": "FutureWarning: f",
            "where": "",
            "first_entry": "c",
            "entries": ["c"],
            "columns": ["x"],
        },
    ]


def _fake_matrix_runner(outcomes, stall_s=0.0):
    """Stands in for the entry's commands: pytest writes a JUnit file whose cases have
    ``outcomes[entry]``; the runs fail (no metrics). The first command stalls ``stall_s``
    seconds, as a busy machine stalls one now and then."""
    stalls = [stall_s]

    def run(command, env=None):
        time.sleep(stalls.pop() if stalls else 0.0)
        junit = next((c.split("=", 1)[1] for c in command if c.startswith("--junitxml=")), None)
        if junit:
            name = Path(junit).stem
            cases = "".join(
                f'<testcase classname="contracts.test_c" name="test_{k}">'
                + {"passed": "", "failed": '<failure message="boom"/>'}[v]
                + "</testcase>"
                for k, v in outcomes[name].items()
            )
            Path(junit).write_text(f"<testsuites><testsuite>{cases}</testsuite></testsuites>")
        return subprocess.CompletedProcess(command, 0 if junit else 1, '{"jax": "0.10.2"}', "")

    return run


def _without_wall_times(built):
    """A report less what differs between two runs of the same entries: when and where it
    was made, and each row's wall times (a stalled command moves them by a tenth of a
    second: this test once failed under xdist on a busy machine for that alone)."""
    volatile = ("generated", "machine", "drift", "previous", "changed")
    out = {k: v for k, v in built.items() if k not in volatile}
    out["entries"] = [
        {**r, "seconds": 0.0, "env": {**r["env"], "seconds": 0.0}, "phase_seconds": {}}
        for r in built["entries"]
    ]
    return out


def test_the_merged_report_equals_one_produced_in_a_single_run(tmp_path, capsys):
    """The fan-out: one report per entry (as one CI job each writes), merged by
    `report merge`, equals the report of one run of the same entries, whatever their
    wall times."""
    path = tmp_path / "entries.toml"
    path.write_text(
        "".join(
            f'[[entry]]\nname="{n}"\ntunix="0.1.7"\nflavour="current"\nconvention="bound2"\n'
            for n in ("e1", "e2", "e3")
        )
    )
    loaded = entries.load_entries(path)
    outcomes = {
        "e1": {"a": "passed", "b": "failed"},
        "e2": {"a": "passed", "c": "passed"},
        "e3": {"b": "passed"},
    }

    class Cache:
        def path(self, entry):
            return tmp_path / "envs" / entry.name

        def ensure(self, entry, rebuild=False):
            from harness.matrix.envs import EnvResult

            return EnvResult(self.path(entry), False, 0.0)

    runner = _fake_matrix_runner(outcomes, stall_s=0.12)

    def rows_of(chosen, where):
        return matrix.run(chosen, loaded, Cache(), where, "1", log=lambda _: None, runner=runner)

    whole = report.build(rows_of(loaded, tmp_path / "whole"), "m")
    parts = []
    for entry in reversed(loaded):  # any order: the entries file decides
        where = tmp_path / "parts" / entry.name
        files.write(report.build(rows_of([entry], where), "m"), where)
        parts.append(str(where))
    argv = ["report", "merge", *parts, "--report-dir", str(tmp_path / "merged")]
    status = cli.main([*argv, "--entries", str(path), "--index-url", "off"])
    assert status == 1  # e1's failing cell
    merged = json.loads((tmp_path / "merged" / "compat-matrix.json").read_text())
    assert _without_wall_times(merged) == _without_wall_times(whole)
    assert [r["name"] for r in merged["entries"]] == ["e1", "e2", "e3"]
    # the same entry in two parts: the later part's row wins
    again = tmp_path / "again"
    rerun = json.loads((Path(parts[0]) / "compat-matrix.json").read_text())
    rerun["entries"][0]["contracts"]["test_b"]["status"] = "failed"
    again.mkdir()
    (again / "compat-matrix.json").write_text(json.dumps(rerun))
    argv = ["report", "merge", *parts, str(again), "--report-dir", str(tmp_path / "m2")]
    cli.main([*argv, "--entries", str(path), "--index-url", "off"])
    merged = json.loads((tmp_path / "m2" / "compat-matrix.json").read_text())
    assert merged["entries"][2]["contracts"]["test_b"]["status"] == "failed"
    # a merged report merged again (the committed reference refreshed with one rerun
    # entry) names its machines and the merge once
    argv = ["report", "merge", str(tmp_path / "m2"), parts[0], "--report-dir", str(tmp_path / "m3")]
    cli.main([*argv, "--entries", str(path), "--index-url", "off"])
    machine = json.loads((tmp_path / "m3" / "compat-matrix.json").read_text())["machine"]
    assert machine == "m; merged from 2 reports (3 entries)", machine
    # a missing or malformed part is a one-line error and exit 2
    capsys.readouterr()
    assert cli.main(["report", "merge", str(tmp_path / "nope"), "--index-url", "off"]) == 2
    assert "holds no compat-matrix.json" in capsys.readouterr().err
    del rerun["machine"]
    (again / "compat-matrix.json").write_text(json.dumps(rerun))
    assert cli.main(["report", "merge", str(again), "--index-url", "off"]) == 2
    assert "is not a matrix report ('machine')" in capsys.readouterr().err


def test_matrix_list_json_prints_the_selected_entries(capsys, tmp_path):
    assert cli.main(["matrix", "--list", "--json", "--all"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [e["name"] for e in listed] == [e.name for e in entries.load_entries()]
    assert {"name", "tunix", "flavour", "convention", "source"} <= set(listed[0])
    tree = tmp_path / "tunix"  # a local source must be a package (checked up front)
    tree.mkdir()
    (tree / "pyproject.toml").write_text("")
    assert cli.main(["matrix", "--list", "--json", "--tunix-source", str(tree)]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed[-1]["name"] == "tunix-main" and listed[-1]["source"] == str(tree)
    with pytest.raises(SystemExit) as stopped:
        cli.main(["matrix", "--json"])
    assert stopped.value.code == 2


class _Index(http.server.BaseHTTPRequestHandler):
    latest = {"flax": "0.12.9", "jax": "0.10.2", "google-tunix": "0.1.7"}

    def do_GET(self):  # noqa: N802 (http.server's name)
        name = self.path.strip("/").split("/")[0]
        body = json.dumps({"info": {"version": self.latest.get(name, "0.0.1")}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_drift_names_each_newer_release_and_survives_an_unreachable_index():
    server = http.server.HTTPServer(("127.0.0.1", 0), _Index)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        rows = [
            row("a", {}, versions={"flax": "0.12.8", "jax": "0.10.2", "google-tunix": "0.1.7"}),
            row("b", {}, versions={"flax": "0.12.7", "jax": "0.9.1"}),
        ]
        found = drift.check(rows, f"http://127.0.0.1:{server.server_port}")
    finally:
        server.shutdown()
        server.server_close()
    assert found["error"] is None
    newer = {p["name"]: (p["tested"], p["latest"]) for p in found["packages"] if p["newer"]}
    # flax: a newer release; jax and tunix: at the newest tested; qwix etc.: never installed
    assert newer.pop("flax") == ("0.12.8", "0.12.9")
    assert set(newer) == {"qwix", "optax", "orbax"}
    assert "not yet tested: flax 0.12.9 (newest tested 0.12.8)" in drift.lines(found)
    gone = drift.check(rows, "http://user:s3cret@127.0.0.1:9", timeout=5)
    assert gone["error"].startswith("index http://127.0.0.1:9 could not be asked")
    assert "s3cret" not in json.dumps(gone)
    assert not any(p["newer"] for p in gone["packages"])
    built = report.build(rows, "m", drift=gone)
    assert "could not be asked" in markdown.markdown(built)


def test_the_committed_markdown_fits_a_pr_comment():
    committed = json.loads(COMMITTED.read_text())
    text = markdown.markdown(committed)
    assert len(text) < markdown.COMMENT_LIMIT, len(text)
    # the matrix: the first table (the fits section's table follows it)
    all_lines = text.splitlines()
    start = next(i for i, line in enumerate(all_lines) if line.startswith("|"))
    end = next((i for i in range(start, len(all_lines)) if not all_lines[i].startswith("|")), None)
    lines = [line for line in all_lines[start:end] if line.startswith("| ")]
    assert len(lines) == 1 + len(committed["entries"])  # header + a row per entry
    assert all(line.count("|") == len(committed["columns"]) + 3 for line in lines)


CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)
PROBE = """<script>
const cells = [...document.querySelectorAll('td.c')].map(td => ({
  status: td.dataset.status, bg: getComputedStyle(td).backgroundColor}));
const head = getComputedStyle(document.querySelector('thead th'));
const first = getComputedStyle(document.querySelector('tbody th'));
const pre = document.createElement('pre'); pre.id = 'probe';
pre.textContent = JSON.stringify({cells, head: head.position, first: first.position,
  rows: document.querySelectorAll('tbody tr').length,
  cols: document.querySelectorAll('thead th.col').length,
  cards: [...document.querySelectorAll('.card h2')].map(h => h.textContent)});
document.body.appendChild(pre);
</script>"""


def _chromium():
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(
    _chromium() is None,
    reason="no chromium: .ci/run installs Debian's chromium (apt-get); this machine could not",
)
def test_the_committed_html_report_renders_its_grid_colours_and_summary(tmp_path):
    """Debian's chromium, headless, renders the committed report: a screenshot whose
    pixels hold the pass colour, and the DOM after layout, read through a probe script
    added to a copy: one row per entry, one column per contract, every cell's computed
    background the colour of its status, the header and first column sticky, the summary's
    cards."""
    committed = json.loads(COMMITTED.read_text())
    page = (REPO / "reports" / "compat-matrix.html").read_text()
    assert page == html.page(committed)  # the committed HTML is the JSON's
    probed = tmp_path / "probed.html"
    probed.write_text(page.replace("</body>", PROBE + "</body>"))
    browser = [_chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}"]
    shot = tmp_path / "shot.png"
    dom = subprocess.run(  # one launch: the screenshot and the DOM after layout
        [*browser, "--window-size=1400,900", f"--screenshot={shot}", "--dump-dom"]
        + [probed.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    probe = json.loads(dom.split('<pre id="probe">', 1)[1].split("</pre>", 1)[0])
    assert probe["rows"] == len(committed["entries"])
    assert probe["cols"] == len(committed["columns"])
    assert len(probe["cells"]) == len(committed["entries"]) * len(committed["columns"])
    expected = {
        (status or "none"): "rgb({}, {}, {})".format(*(int(bg[i : i + 2], 16) for i in (1, 3, 5)))
        for status, (_, bg) in html.COLOURS.items()
    }
    for c in probe["cells"]:
        assert c["bg"] == expected[c["status"]], c
    statuses = {c["status"] for c in probe["cells"]}
    assert "passed" in statuses
    assert probe["head"] == "sticky" and probe["first"] == "sticky"
    assert probe["cards"][:5] == [
        "What broke",
        "First failing entry per contract",
        "Upstream deprecations",
        probe["cards"][3],
        "Upstream releases",
    ] and probe["cards"][3].startswith("Changed since the previous report")
    from PIL import Image

    image = Image.open(shot).convert("RGB")
    assert image.size == (1400, 900)
    colours = {colour for _, colour in image.getcolors(maxcolors=1 << 20)}
    pass_bg = tuple(int(html.COLOURS["passed"][1][i : i + 2], 16) for i in (1, 3, 5))
    assert pass_bg in colours


def test_an_index_that_is_not_http_is_reported_not_raised():
    """Whatever answers (here a server that speaks another protocol) is a line in the
    report, never an exception that would lose the matrix's rows."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)

    def answer():
        conn, _ = listener.accept()
        conn.recv(1024)
        conn.sendall(b"SSH-2.0-OpenSSH_9.2\r\n")
        conn.close()

    threading.Thread(target=answer, daemon=True).start()
    try:
        found = drift.check([], f"http://127.0.0.1:{listener.getsockname()[1]}", timeout=5)
    finally:
        listener.close()
    assert "could not be asked" in found["error"]


# slow tier: 3 interpreters (-n 2) in the gate took 6-7 s of its wall and a core from the other
# worker; the gate runs every one of these tests once, this is the repeat that finds shared state
@pytest.mark.slow
def test_the_report_tests_pass_twice_side_by_side(tmp_path):
    """The report's tests (this file and tests/test_verdicts.py) run twice at once, one
    copy per xdist worker (``--dist each``), on one machine: every test passes in both
    copies. A test that shares a path, a clock reading or any other state between
    workers fails here, where a single gate run shows it only now and then. The browser
    test is left out (a real chromium twice costs seconds and shares nothing of ours)."""
    from harness.gate import junit

    xml = tmp_path / "twice.xml"
    command = [
        sys.executable,
        "-m",
        "pytest",
        str(Path(__file__)),
        str(REPO / "tests" / "test_verdicts.py"),
        "-q",
        "-p",
        "no:cacheprovider",
        "-n",
        "2",
        "--dist",
        "each",
        "-k",
        "not html and not side_by_side",
        f"--basetemp={tmp_path / 'inner'}",
        f"--junitxml={xml}",
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    cases = junit.read(xml).cases if xml.is_file() else []
    bad = [f"{c.name}: {c.outcome} {c.message}" for c in cases if c.outcome != "passed"]
    assert done.returncode == 0 and not bad, bad or done.stdout[-2000:] + done.stderr[-2000:]
    names = [c.classname + "::" + c.name for c in cases]
    assert len(names) > 10 and all(names.count(n) == 2 for n in names)
