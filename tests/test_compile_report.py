"""``pytest --compile-report PATH`` (:mod:`harness.gate.compile_report`): a line per test
with JAX's tracing, lowering and compile figures, written as each test ends, its
listeners back after Tunix clears them, the persistent cache's hits counted, and the
runs it refuses."""

from __future__ import annotations

import json

import pytest

from harness.gate import compile_report
from tests.cli_help import help_text

pytestmark = pytest.mark.host

# Four inner tests: none of JAX; a jitted program, which counts JAX's compile events
# itself (the second test: the report's listeners are registered at each test's start,
# once); one that sees the first two lines written and clears every JAX listener (as
# Tunix's MetricsLogger.close() does); and a program after that.
HEADER = """
import json, os, pathlib
import jax, jax.numpy as jnp
"""
NO_JAX = """
def test_runs_no_jax():
    assert sum(range(4)) == 6
"""
COMPILES = """
def test_compiles():
    seen = []
    def count(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            seen.append(duration)
    jax.monitoring.register_event_duration_secs_listener(count)
    x = jnp.arange(6.0)  # an eager program
    jax.jit(lambda v: jnp.sin(v) * 3 + 1)(x).block_until_ready()
    jax.monitoring.unregister_event_duration_listener(count)
    pathlib.Path(os.environ["SEEN"]).write_text(json.dumps([len(seen), sum(seen)]))
"""
AFTER_A_CLEAR = """
def test_clears_the_listeners():
    lines = pathlib.Path(os.environ["REPORT"]).read_text().splitlines()
    names = [json.loads(line)["test"].split("::")[1] for line in lines]
    assert names == ["test_runs_no_jax", "test_compiles"]
    jax.monitoring.clear_event_listeners()

def test_compiles_after_the_clear():
    jax.jit(lambda v: jnp.cos(v) - 2)(jnp.ones(7)).block_until_ready()
"""


def _lines(path) -> dict[str, dict]:
    """The report's lines by test name."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return {line["test"].split("::")[1]: line for line in lines}


def test_each_test_gets_its_line_as_it_ends(jax_started, pytester, monkeypatch):
    report = pytester.path / "report.jsonl"
    report.write_text("a line of an earlier run\n")  # truncated when the run starts
    monkeypatch.setenv("REPORT", str(report))
    monkeypatch.setenv("SEEN", str(pytester.path / "seen.json"))
    pytester.makepyfile(HEADER + NO_JAX + COMPILES + AFTER_A_CLEAR)
    result = pytester.runpytest("--compile-report", str(report), "-p", "no:cacheprovider")
    result.assert_outcomes(passed=4)
    lines = _lines(report)
    assert list(lines) == [
        "test_runs_no_jax",
        "test_compiles",
        "test_clears_the_listeners",
        "test_compiles_after_the_clear",
    ]
    for line in lines.values():
        assert set(line) == {"test", *compile_report.FIELDS}
        assert line["wall_s"] > 0
    none, compiled, _, after = lines.values()
    # the jitted lambda: traced, lowered and compiled in this test, with the eager ops
    programs, seconds = json.loads((pytester.path / "seen.json").read_text())
    # (the gate's persistent cache may hold an eager program another test compiled)
    assert compiled["programs"] == programs >= 2 and compiled["cache_hits"] <= programs
    assert compiled["compile_s"] == pytest.approx(seconds, abs=1e-4)
    assert compiled["trace_s"] > 0 and compiled["lower_s"] > 0 and compiled["compile_s"] > 0
    assert compiled["wall_s"] >= compiled["compile_s"] + compiled["lower_s"]
    assert none == {
        "test": none["test"],
        "wall_s": none["wall_s"],
        **dict.fromkeys(("trace_s", "lower_s", "compile_s", "programs", "cache_hits"), 0),
    }
    assert after["programs"] >= 1 and after["compile_s"] > 0  # listened again
    total = sum(line["programs"] for line in lines.values())
    hits = sum(line["cache_hits"] for line in lines.values())
    result.stdout.fnmatch_lines(
        [
            f"posttrain-harness: compile report {report}: 4 tests, * ({total} programs, "
            f"{hits} from the cache), tracing * s, lowering * s"
        ]
    )


def test_the_persistent_caches_hits_are_counted(pytester, tmp_path, monkeypatch):
    """Two processes, one cache: the second run reads the jitted program from the cache."""
    monkeypatch.setenv("SEEN", str(tmp_path / "seen.json"))
    pytester.makepyfile(HEADER + COMPILES)
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    runs = []
    for name in ("cold.jsonl", "warm.jsonl"):
        pytester.runpytest_subprocess(
            "--compile-report", str(tmp_path / name), "-p", "no:cacheprovider"
        ).assert_outcomes(passed=1)
        runs.append(_lines(tmp_path / name)["test_compiles"])
    cold, warm = runs
    assert cold["cache_hits"] == 0 and cold["programs"] >= 2
    assert warm["cache_hits"] == warm["programs"] == cold["programs"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-n", "2"], "needs a run of one process, without -n (xdist)"),
        ([], "cannot be written (No such file or directory)"),
    ],
    ids=["xdist", "unwritable"],
)
def test_a_run_it_cannot_report_is_refused(jax_started, pytester, args, message):
    path = pytester.path / "absent" / "r.jsonl" if not args else pytester.path / "r.jsonl"
    pytester.makepyfile("def test_x():\n    pass\n")
    result = pytester.runpytest("--compile-report", str(path), *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: --compile-report {path}: {message}"])
    assert not path.exists()


STOPPED = """
import os

def test_first():
    pass

def test_stopped():
    if os.environ["STOP"] == "1":
        raise KeyboardInterrupt  # a time limit's SIGINT, inside this test

def test_last():
    pass
"""


def test_a_stopped_run_resumes_where_it_stopped(jax_started, pytester, monkeypatch):
    """A run stopped inside a test keeps the lines of the tests before it and none for
    that test; ``--resume`` deselects the tests the report holds, runs the rest from the
    stopped one on, and appends their lines."""
    report = pytester.path / "report.jsonl"
    pytester.makepyfile(STOPPED)
    monkeypatch.setenv("STOP", "1")  # a process of its own: the interrupt would end this one's
    result = pytester.runpytest_subprocess(
        "--compile-report", str(report), "-p", "no:cacheprovider"
    )
    assert result.ret == pytest.ExitCode.INTERRUPTED
    assert list(_lines(report)) == ["test_first"]
    monkeypatch.setenv("STOP", "0")
    again = ["--compile-report", str(report), "--resume", "-p", "no:cacheprovider", "-v"]
    result = pytester.runpytest(*again)
    result.assert_outcomes(passed=2, deselected=1)
    assert list(_lines(report)) == ["test_first", "test_stopped", "test_last"]
    result.stdout.fnmatch_lines(
        [
            f"posttrain-harness: compile report {report}: 2 tests, *",
            f"posttrain-harness: resumed {report}: 1 tests it held deselected, this run's "
            "lines appended",
        ]
    )
    result = pytester.runpytest(*again)  # all finished: nothing left to run
    assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED
    result.assert_outcomes(deselected=3)


def test_resuming_a_report_not_written_yet_runs_everything(jax_started, pytester, monkeypatch):
    report = pytester.path / "report.jsonl"
    pytester.makepyfile(STOPPED)
    monkeypatch.setenv("STOP", "0")
    result = pytester.runpytest("--compile-report", str(report), "--resume")
    result.assert_outcomes(passed=3)
    assert list(_lines(report)) == ["test_first", "test_stopped", "test_last"]
    result.stdout.fnmatch_lines([f"posttrain-harness: resumed {report}: 0 tests it held *"])


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "--resume: needs --compile-report PATH, the run to continue"),
        ("not a line\n", "--compile-report {path} --resume: {path}:1: expected a JSON object"),
    ],
    ids=["no-report", "not-a-report"],
)
def test_a_resume_it_cannot_do_is_refused(jax_started, pytester, content, message):
    path = pytester.path / "r.jsonl"
    pytester.makepyfile("def test_x():\n    pass\n")
    if content is None:
        result = pytester.runpytest("--resume")
    else:
        path.write_text(content)
        result = pytester.runpytest("--compile-report", str(path), "--resume")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: {message.format(path=path)}*"])
    assert content is None or path.read_text() == content  # left as it was


def test_a_report_starts_empty_unless_it_resumes(tmp_path):
    path = tmp_path / "r.jsonl"
    line = json.dumps({"test": "t.py::test_a", **dict.fromkeys(compile_report.FIELDS, 0)})
    path.write_text(line + "\n")
    resumed = compile_report.CompileReport(path, resume=True)
    assert resumed.finished == {"t.py::test_a"}
    resumed.close()
    assert path.read_text() == line + "\n"
    compile_report.CompileReport(path).close()
    assert path.read_text() == ""


def test_the_summary_totals_every_line_written(tmp_path):
    report = compile_report.CompileReport(tmp_path / "r.jsonl")
    # counts accumulate as floats (from _zero's 0.0), as in a run
    figures = dict(
        wall_s=2.0, trace_s=0.25, lower_s=0.5, compile_s=1.0, programs=3.0, cache_hits=1.0
    )
    report.write("a.py::x", figures)
    report.write("a.py::y", {**figures, "programs": 2.0, "cache_hits": 0.0, "compile_s": 0.123456})
    assert report.summary() == (
        f"posttrain-harness: compile report {tmp_path / 'r.jsonl'}: 2 tests, 4.0 s; XLA "
        "compiles 1.1 s (5 programs, 1 from the cache), tracing 0.5 s, lowering 1.0 s"
    )
    report.close()
    # as written: seconds to 0.1 ms, counts as integers
    lines = (tmp_path / "r.jsonl").read_text().splitlines()
    assert lines[1] == (
        '{"test": "a.py::y", "wall_s": 2.0, "trace_s": 0.25, "lower_s": 0.5, '
        '"compile_s": 0.1235, "programs": 2, "cache_hits": 0}'
    )


def test_the_listeners_count_their_events_only(tmp_path):
    report = compile_report.CompileReport(tmp_path / "r.jsonl")
    for _ in range(2):
        report.on_duration(compile_report.COMPILE_EVENT, 0.5)
        report.on_event(compile_report.CACHE_HIT_EVENT)
    report.on_duration(compile_report.TRACE_EVENT, 0.25)
    report.on_duration(compile_report.LOWER_EVENT, 0.125)
    report.on_duration("/jax/some/other_duration", 9.0)
    report.on_event("/jax/compilation_cache/cache_misses")
    report.close()
    assert report._test == {
        **dict.fromkeys(compile_report.FIELDS, 0.0),
        "trace_s": 0.25,
        "lower_s": 0.125,
        "compile_s": 1.0,
        "programs": 2,
        "cache_hits": 2,
    }


def test_listening_registers_each_listener_once_and_closing_removes_them(tmp_path, jax_started):
    from jax._src import monitoring

    report = compile_report.CompileReport(tmp_path / "r.jsonl")
    try:
        for _ in range(2):
            report.listen()
            assert monitoring.get_event_duration_listeners().count(report.on_duration) == 1
            assert monitoring.get_event_listeners().count(report.on_event) == 1
    finally:
        report.close()
    assert report.on_duration not in monitoring.get_event_duration_listeners()
    assert report.on_event not in monitoring.get_event_listeners()
    assert report._out.closed


def _report(tmp_path, lines) -> tuple[compile_report.CompileReport, object]:
    """A report file holding ``lines`` ``(test, wall, compile, trace, lower, programs,
    hits)``, written by the plugin object itself."""
    path = tmp_path / "report.jsonl"
    report = compile_report.CompileReport(path)
    names = ("wall_s", "compile_s", "trace_s", "lower_s", "programs", "cache_hits")
    for test, *figures in lines:
        report.write(test, dict(zip(names, figures, strict=True)))
    report._out.close()
    return report, path


LINES = [
    ("tests/a.py::t1", 1.0, 0.5, 0.2, 0.1, 2, 1),
    ("tests/b.py::t2", 5.0, 4.0, 0.5, 0.2, 3, 0),
    ("tests/a.py::t3", 3.0, 1.0, 0.0, 0.0, 1, 0),
]
HEAD = "  wall_s compile_s trace+lower_s programs  hits"


def test_a_report_reads_back_as_its_totals_its_files_and_its_tests(tmp_path):
    """The reader's totals are the plugin's; files sum their tests' lines and come by
    wall time, most first (b.py's 5 s before a.py's 1 + 3 s); ``top`` limits both lists."""
    report, path = _report(tmp_path, LINES)
    rows = compile_report.read(path)
    assert [row["test"] for row in rows] == ["tests/a.py::t1", "tests/b.py::t2", "tests/a.py::t3"]
    files = compile_report.by_file(rows)
    assert list(files) == ["tests/b.py", "tests/a.py"]
    assert files["tests/a.py"] == {
        "wall_s": 4.0,
        "trace_s": 0.2,
        "lower_s": 0.1,
        "compile_s": 1.5,
        "programs": 3,
        "cache_hits": 1,
        "tests": 2,
    }
    totals = f"{path}: 3 tests, 9.0 s; XLA compiles 5.5 s (6 programs, 1 from the cache), "
    totals += "tracing 0.7 s, lowering 0.3 s"
    assert report.summary() == f"posttrain-harness: compile report {totals}"
    assert compile_report.summarise(path, rows, top=1).splitlines() == [
        totals,
        "files by wall time (1 of 2):",
        f"{HEAD} tests  file",
        "     5.0       4.0           0.7        3     0     1  tests/b.py",
        "tests by wall time (1 of 3):",
        f"{HEAD}  test",
        "     5.0       4.0           0.7        3     0  tests/b.py::t2",
    ]
    shown = compile_report.summarise(path, rows, top=3).splitlines()
    assert shown[1] == "files by wall time (2 of 2):" and shown[5] == "tests by wall time (3 of 3):"
    assert [line.split()[-1] for line in shown[3:5]] == ["tests/b.py", "tests/a.py"]
    assert [line.split()[-1] for line in shown[7:]] == [
        "tests/b.py::t2",
        "tests/a.py::t3",
        "tests/a.py::t1",
    ]
    assert shown[4] == "     4.0       1.5           0.3        3     1     2  tests/a.py"


def test_the_command_line_prints_the_summary_and_keeps_a_lines_other_keys(tmp_path, capsys):
    """A key the plugin does not write (the chip's report adds ``command``) is kept and
    does not stop the reading; ``--top`` reaches :func:`summarise`."""
    _, path = _report(tmp_path, LINES)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({"command": 2, **row}) + "\n" for row in rows))
    assert [row["command"] for row in compile_report.read(path)] == [2, 2, 2]
    assert compile_report.main([str(path), "--top", "2"]) == 0
    want = compile_report.summarise(path, compile_report.read(path), top=2)
    assert capsys.readouterr().out == want + "\n"
    assert "(2 of 3)" in want


def test_tests_limits_the_summary_to_the_node_ids_a_collection_printed(tmp_path, capsys):
    """``--tests FILE``: the lines of the node ids FILE names (``--collect-only -q``'s
    count line and blank lines ignored), one of them without a line counted as none."""
    _, path = _report(tmp_path, LINES)
    chosen = tmp_path / "chosen.txt"
    chosen.write_text(
        "tests/b.py::t2\ntests/a.py::t3\ntests/c.py::t4\n\n3 tests collected in 0.1s\n"
    )
    assert compile_report.main([str(path), "--tests", str(chosen)]) == 0
    first, *rest = capsys.readouterr().out.splitlines()
    assert first == f"--tests {chosen}: 2 of its 3 tests have a line here (1 none)"
    rows = [row for row in compile_report.read(path) if row["test"] != "tests/a.py::t1"]
    assert "\n".join(rest) == compile_report.summarise(path, rows, top=10)
    assert rest[0].startswith(f"{path}: 2 tests, 8.0 s;")


@pytest.mark.parametrize(
    ("text", "args", "says"),
    [
        (None, [], "nowhere.jsonl: cannot be read (No such file or directory)"),
        (
            '{"test": "t"}\nnot json\n',
            [],
            ":1: expected a JSON object with test and wall_s, trace_s, lower_s, compile_s, "
            'programs, cache_hits (a --compile-report line), got \'{"test": "t"}\'',
        ),
        (None, ["--top", "0"], "--top 0: expected >= 1"),
        ("", ["--tests", "nowhere.txt"], "nowhere.txt: cannot be read (No such file or directory)"),
        ("", ["--tests", "LATIN1"], "LATIN1: not UTF-8 text (expected node ids)"),
        ("", ["--tests", "EMPTY"], "names no test (expected node ids, one a line)"),
    ],
    ids=[
        "missing",
        "a-line-without-fields",
        "top-zero",
        "tests-missing",
        "tests-latin1",
        "tests-none",
    ],
)
def test_a_report_it_cannot_read_is_one_line_and_exit_2(tmp_path, capsys, text, args, says):
    path = tmp_path / "nowhere.jsonl"
    if text is not None:
        path.write_text(text)
    (tmp_path / "EMPTY").write_text("2 tests collected\n")
    (tmp_path / "LATIN1").write_bytes("tests/é.py::t\n".encode("latin-1"))
    args = [str(tmp_path / a) if a in ("nowhere.txt", "EMPTY", "LATIN1") else a for a in args]
    with pytest.raises(SystemExit) as exit_:
        compile_report.main([str(path), *args])
    assert exit_.value.code == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert line.startswith("python -m harness.gate.compile_report: error: ") and says in line


@pytest.mark.parametrize(
    ("bad", "number"),
    [
        ("not json", 2),
        ('["a list"]', 2),
        (
            '{"test": 3, "wall_s": 1, "trace_s": 0, "lower_s": 0, "compile_s": 0, "programs": 0, '
            '"cache_hits": 0}',
            2,
        ),
        (
            '{"test": "t", "wall_s": true, "trace_s": 0, "lower_s": 0, "compile_s": 0, '
            '"programs": 0, "cache_hits": 0}',
            2,
        ),
        (
            '{"test": "t", "wall_s": "1", "trace_s": 0, "lower_s": 0, "compile_s": 0, '
            '"programs": 0, "cache_hits": 0}',
            2,
        ),
    ],
    ids=["not-json", "not-an-object", "test-not-text", "a-bool", "a-string"],
)
def test_a_line_that_is_no_report_line_is_refused_naming_it(tmp_path, bad, number):
    good = json.dumps({"test": "t", **dict.fromkeys(compile_report.FIELDS, 0)})
    path = tmp_path / "r.jsonl"
    path.write_text(f"{good}\n{bad}\n{good}\n")
    with pytest.raises(ValueError, match=f"r.jsonl:{number}: expected a JSON object") as error:
        compile_report.read(path)
    assert repr(bad[:80]) in str(error.value)


def test_the_command_lines_help_its_default_top_and_its_smallest(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    help_ = help_text(compile_report.main, capsys)
    assert help_.startswith(
        "usage: python -m harness.gate.compile_report [-h] [--top TOP] [--tests FILE] path\n"
    )
    assert "Where a --compile-report run's time went: totals, files and tests." in help_
    assert "a file written by pytest --compile-report" in help_
    assert "files and tests shown (default: 10)" in help_
    _, path = _report(tmp_path, [(f"tests/f{i}.py::t", i, 0, 0, 0, 0, 0) for i in range(12)])
    assert compile_report.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "files by wall time (10 of 12):" in out and "tests by wall time (10 of 12):" in out
    assert compile_report.main([str(path), "--top", "1"]) == 0
    assert "files by wall time (1 of 12):" in capsys.readouterr().out
