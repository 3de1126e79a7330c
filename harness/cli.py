"""The ``posttrain-harness`` command.

Subcommands:
    devices: configure the device source (``--devices N|real``) and print the
        backend, device count and devices JAX then sees.
    gate: the pre-merge gate. Runs pytest (same interpreter, xdist ``-n auto
        --dist worksteal``, ``--strict-skips``, ``-m "not slow"`` unless ``--slow``)
        with a JUnit report, prints a one-screen summary parsed from it and writes
        ``gate-summary.json`` beside it. Arguments after ``--`` go to pytest.
        Exit status: pytest's, except that a run that ran no test (pytest exit
        5, or every test skipped) is 1 with the message "gate ran no tests".
    launch: ``-n N [--devices-per-process M] -- COMMAND``: N local processes of
        COMMAND joined into one JAX runtime (harness/launch.py).
    matrix: the Tunix compatibility matrix (harness/matrix.py, harness/report.py):
        one cached env per compat/entries.toml entry, contracts + a short SFT run
        in each, reports/compat-matrix.{md,json,html}. ``--list [--json]`` prints the
        selected entries (one CI job each); ``--tunix-source`` adds Tunix from source.
    report merge DIR...: one report from several per-entry reports (the CI fan-out's
        last job), in the entries file's order.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness import junit, sources
from harness.devices import configure_devices, device_facts, suite_env
from posttrain import atomic

PYTEST_NO_TESTS_COLLECTED = 5  # pytest.ExitCode.NO_TESTS_COLLECTED
JUNIT_NAME = "junit-gate.xml"
SUMMARY_NAME = "gate-summary.json"
MAX_LISTED = 20  # failures / skip reasons printed; the JSON summary has them all
MESSAGE_WIDTH = 160
REFERENCE_REPORTS = "reports"
"""The committed matrix report (the project's reference), relative to the checkout."""
LATEST_REPORTS = "reports/latest"
"""Where a user's matrix run writes by default (ignored by git)."""


def default_compile_cache() -> str:
    """``$XDG_CACHE_HOME`` (or ``~/.cache``) ``/posttrain-harness/jax-compile``.

    Per user, not per checkout: fresh clones and worktrees on one machine share
    compiles (JAX keys each entry by program, compile options, backend and version).
    """
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return str(root / "posttrain-harness" / "jax-compile")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="posttrain-harness",
        description="Harness of the posttrain stack: device setup and the pre-merge gate.",
        allow_abbrev=False,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    devices = commands.add_parser(
        "devices", help="print the backend, device count and devices", allow_abbrev=False
    )
    devices.add_argument(
        "--devices",
        metavar="N|real",
        default=None,
        help="N fake CPU devices or 'real' (default: $POSTTRAIN_DEVICES or 8)",
    )

    gate = commands.add_parser(
        "gate",
        help="run the pre-merge gate (pytest args after --)",
        description="Run the pre-merge gate. Arguments after -- are passed to pytest.",
        allow_abbrev=False,
    )
    gate.add_argument(
        "--jobs", "-j", default="auto", type=_jobs, help="xdist workers (default: auto)"
    )
    gate.add_argument(
        "--report-dir", default="reports", type=Path, help="where the JUnit and JSON reports go"
    )
    gate.add_argument("--slow", action="store_true", help="also run tests marked slow")
    gate.add_argument(
        "--devices", metavar="N|real", default=None, help="passed to pytest's --devices"
    )
    gate.add_argument(
        "--compile-cache",
        metavar="DIR|off",
        default=os.environ.get("JAX_COMPILATION_CACHE_DIR") or default_compile_cache(),
        help="JAX persistent compilation cache shared by the workers and kept between runs "
        "(default: $JAX_COMPILATION_CACHE_DIR or %(default)s); 'off' disables it",
    )
    launch = commands.add_parser(
        "launch",
        help="run a command in N local processes as one JAX runtime (command after --)",
        description="Start N processes of the command after --, each with M fake CPU "
        "devices, joined by jax.distributed (gloo) into one runtime of N x M devices; "
        "output prefixed with each rank; the first failure stops the others.",
        allow_abbrev=False,
    )
    launch.add_argument("-n", type=int, required=True, help="number of processes")
    launch.add_argument(
        "--devices-per-process", type=int, default=4, help="fake CPU devices each (default 4)"
    )
    launch.add_argument(
        "--grace",
        type=float,
        default=10.0,
        help="seconds between SIGTERM and SIGKILL when stopping the others (default 10)",
    )
    matrix = commands.add_parser(
        "matrix",
        help="run contracts + a short SFT run in one env per compat/ entry; write the report",
        description="The Tunix compatibility matrix (compat/entries.toml). No options: the "
        "default entries (newest releases and emulated main).",
        allow_abbrev=False,
    )
    matrix.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="NAME",
        help="entry name or prefix (repeatable)",
    )
    matrix.add_argument("--all", action="store_true", help="every entry")
    matrix.add_argument(
        "--jobs", "-j", default="2", type=_jobs, help="pytest-xdist workers per entry"
    )
    matrix.add_argument("--rebuild", action="store_true", help="rebuild the environments")
    matrix.add_argument(
        "--report-dir",
        default=LATEST_REPORTS,
        type=Path,
        help="where the report goes (default: %(default)s, untracked; the committed "
        f"reference in {REFERENCE_REPORTS}/ is regenerated on purpose with --report-dir "
        f"{REFERENCE_REPORTS})",
    )
    matrix.add_argument(
        "--cache",
        default=None,
        type=Path,
        help="environment cache (default: $POSTTRAIN_MATRIX_CACHE or "
        "~/.cache/posttrain-harness/envs)",
    )
    matrix.add_argument("--entries", default=None, type=Path, help="entries file")
    matrix.add_argument(
        "--update",
        action="store_true",
        help="merge these rows into the existing report (other rows kept)",
    )
    matrix.add_argument(
        "--tunix-source",
        metavar="PATH_OR_URL",
        default=None,
        help="Tunix from a local checkout or a git URL (@ref): the source entry's source "
        "(a new 'tunix-source' row when the entries have none), added to the selection",
    )
    matrix.add_argument(
        "--list", action="store_true", help="print the selected entries and exit (no run)"
    )
    matrix.add_argument("--json", action="store_true", help="with --list: as a JSON list")
    matrix.add_argument(
        "--bisect",
        action="store_true",
        help="for each source row's FAIL or warn cell that the newest release passes "
        "cleanly, run the bisect the report suggests and name the commit in its summary",
    )
    _index_option(matrix)
    bisect = commands.add_parser(
        "bisect",
        help="name the upstream commit that first breaks a contract (or a run cell)",
        description="Binary search over an upstream checkout's first-parent history "
        "good..bad: each step builds the commit's environment as the matrix's source rows "
        "do, runs one contract or run cell, and calls it good, bad or skip.",
        allow_abbrev=False,
    )
    bisect.add_argument(
        "--contract",
        required=True,
        metavar="NODEID|COLUMN|CELL",
        help="a node id (contracts/FILE::test), a contract name (a matrix column) or a run "
        "cell (sft, rl, dpo)",
    )
    bisect.add_argument(
        "--source", required=True, metavar="PATH_OR_URL", help="a git checkout (or URL)"
    )
    bisect.add_argument("--good", required=True, metavar="REF", help="a commit that passes")
    bisect.add_argument("--bad", required=True, metavar="REF", help="a commit that fails")
    bisect.add_argument(
        "--package", default="tunix", choices=("tunix", "qwix", "flax"), help="what it holds"
    )
    bisect.add_argument(
        "--verdict",
        default="fail",
        choices=("fail", "warn"),
        help="'warn': the first commit that makes the contract warn (an upstream "
        "deprecation on our path, the matrix's warn cell) or fail",
    )
    bisect.add_argument("--report-dir", default=LATEST_REPORTS, type=Path)
    bisect.add_argument(
        "--cache", default=None, type=Path, help="environment cache (as matrix --cache)"
    )
    report_cmd = commands.add_parser(
        "report",
        help="the matrix report from per-entry reports (report merge DIR...)",
        allow_abbrev=False,
    )
    report_actions = report_cmd.add_subparsers(dest="action", required=True, metavar="ACTION")
    merge = report_actions.add_parser(
        "merge",
        help="merge compat-matrix.json reports (one per entry, e.g. one per CI job) into one",
        description="Merge the rows of several matrix reports into one report, in the "
        "entries file's order; the same code as matrix --update.",
        allow_abbrev=False,
    )
    merge.add_argument(
        "parts", nargs="+", type=Path, metavar="DIR", help="directories holding compat-matrix.json"
    )
    merge.add_argument("--report-dir", default=LATEST_REPORTS, type=Path)
    merge.add_argument("--entries", default=None, type=Path, help="entries file (row order)")
    _index_option(merge)
    return parser


def _index_option(parser: argparse.ArgumentParser) -> None:
    from harness import drift

    parser.add_argument(
        "--index-url",
        default=drift.DEFAULT_INDEX,
        help="package index JSON API asked for newer upstream releases (default: "
        "$POSTTRAIN_INDEX_URL or %(default)s); 'off': not asked",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1 :]
    parser = _parser()
    args = parser.parse_args(argv)
    reports = args.report_dir if args.command in ("gate", "matrix", "report", "bisect") else None
    if reports is not None and reports.exists() and not reports.is_dir():
        parser.error(f"--report-dir {reports} is a file; expected a directory")
    try:
        return _dispatch(parser, args, passthrough)
    except KeyboardInterrupt:
        print("posttrain-harness: interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        if os.environ.get("POSTTRAIN_DEBUG", "") not in ("", "0"):
            raise
        text = sources.redact((str(error).strip().splitlines() or [""])[0])
        print(
            f"posttrain-harness: internal error: {type(error).__name__}: {text} "
            "(rerun with POSTTRAIN_DEBUG=1 for the traceback)",
            file=sys.stderr,
        )
        return 1


def _jobs(value: str) -> str:
    """``--jobs``: ``auto`` or a non-negative integer (0: no xdist workers; argparse type)."""
    if value == "auto" or re.fullmatch(r"[0-9]+", value):
        return value
    raise argparse.ArgumentTypeError(f"{value!r}: expected a non-negative integer or 'auto'")


def _dispatch(parser: argparse.ArgumentParser, args: argparse.Namespace, passthrough) -> int:
    if args.command == "gate":
        return run_gate(args, passthrough)
    if args.command == "launch":
        return run_launch(args, passthrough)
    if args.command == "matrix":
        if passthrough:
            parser.error("arguments after -- are for 'gate' and 'launch' only")
        if args.json and not args.list:
            parser.error("--json goes with --list")
        return run_matrix(args)
    if args.command == "bisect":
        if passthrough:
            parser.error("arguments after -- are for 'gate' and 'launch' only")
        return run_bisect(args)
    if args.command == "report":
        if passthrough:
            parser.error("arguments after -- are for 'gate' and 'launch' only")
        return run_report_merge(args)
    if passthrough:
        parser.error("arguments after -- are for 'gate' and 'launch' only")
    return show_devices(args.devices)


def run_launch(args: argparse.Namespace, command: list[str]) -> int:
    """``posttrain-harness launch``: :func:`harness.launch.launch`; bad input is one line
    and exit status 2, before any process starts."""
    from harness import launch

    try:
        return launch.launch(
            args.n, command, devices_per_process=args.devices_per_process, grace=args.grace
        )
    except ValueError as error:
        print(f"posttrain-harness launch: error: {error}", file=sys.stderr)
        return 2
    except launch.Stopped as stopped:
        print(f"posttrain-harness launch: {stopped}; ranks stopped", file=sys.stderr)
        return 128 + stopped.signum


def run_matrix(args: argparse.Namespace) -> int:
    """Runs the selected matrix entries and writes the report (``--list``: prints them).

    Exit status: 0 when no cell of the written report fails (``warn`` and ``n/a`` pass;
    with ``--update`` the kept rows count too) and every row ran, 1 otherwise, 2 for bad
    options (a malformed ``--tunix-source`` included; an unreachable one is an error row).
    """
    import platform

    from harness import entries, envs, matrix, progress, report

    try:
        loaded = entries.load_entries(args.entries or entries.ENTRIES_FILE)
        chosen = entries.select(loaded, args.only, args.all)
        if args.tunix_source is not None:
            parsed = sources.parse(args.tunix_source)  # malformed: exit 2 now
            if parsed.path is not None:  # a local tree that is not there: bad input, not a row
                sources.check_directory(parsed.path, args.tunix_source)
            loaded, row = entries.with_source(loaded, args.tunix_source)
            chosen = [row if e.name == row.name else e for e in chosen]
            chosen += [] if row in chosen else [row]
    except ValueError as error:
        print(f"posttrain-harness matrix: {sources.redact(str(error))}", file=sys.stderr)
        return 2
    if args.list:
        return _list_entries(chosen, as_json=args.json)
    start = time.monotonic()
    shown = progress.Progress(len(chosen))
    try:
        rows = matrix.run(
            chosen,
            loaded,
            envs.EnvCache(args.cache or envs.DEFAULT_CACHE),
            args.report_dir,
            args.jobs,
            rebuild=args.rebuild,
            progress=shown,
        )
    finally:
        shown.close()
    machine = (
        f"{platform.node()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, {len(rows)} entries in "
        f"{time.monotonic() - start:.0f} s"
    )
    try:
        previous = report.load(args.report_dir)
    except ValueError as error:
        print(f"posttrain-harness matrix: {error}; not compared", file=sys.stderr)
        previous = None
    if args.update and previous:
        ran = len(rows)
        rows = report.combine([previous["entries"], rows], [e.name for e in loaded])
        machine += f" ({ran} rerun with --update; the other {len(rows) - ran} rows kept)"
    if previous is None:
        previous = _reference_report(args.report_dir)
    named = None
    if args.bisect:
        from harness import bisect

        named = bisect.run_suggestions(
            bisect.suggestions(rows),
            envs.EnvCache(args.cache or envs.DEFAULT_CACHE),
            log=lambda line: print(sources.redact(line), file=sys.stderr, flush=True),
        )
    return _write_report(rows, machine, previous, args, [e.name for e in loaded], named)


def _reference_report(report_dir: Path) -> dict[str, Any] | None:
    """The committed reference report, to compare a first run in another directory with
    (None when ``report_dir`` is the reference's, or it is absent or unreadable)."""
    from harness import entries, report

    reference = entries.REPO / REFERENCE_REPORTS
    if report_dir.resolve() == reference.resolve():
        return None
    try:
        return report.load(reference)
    except ValueError:
        return None


def _write_report(
    rows,
    machine: str,
    previous,
    args: argparse.Namespace,
    every: Sequence[str],
    bisected: list[dict[str, Any]] | None = None,
) -> int:
    """Builds (with drift, the flips against ``previous`` and the entries of ``every``
    it leaves out), writes and prints the report; the exit status of its cells."""
    from harness import bisect, drift, fits, report, report_md

    built = report.build(
        rows,
        machine,
        previous=previous,
        drift=drift.check(rows, args.index_url),
        not_run=every,
        bisect=bisect.suggestions(rows) if bisected is None else bisected,
        fits=fits.load(args.report_dir),  # the plans' rows beside the report, if any
    )
    paths = report.write(built, args.report_dir)
    print(sources.redact(report_md.markdown(built)))
    print("report: " + ", ".join(str(p) for p in paths), file=sys.stderr)
    return 1 if built["broken"] else 0


def _list_entries(chosen, as_json: bool) -> int:
    if as_json:
        fields = ("name", "tunix", "flavour", "convention", "default", "emulated", "source")
        print(sources.redact(json.dumps([{f: getattr(e, f) for f in fields} for e in chosen])))
        return 0
    for e in chosen:
        print(sources.redact(f"{e.name}\t{e.flavour}\t{e.convention}\t{e.source or e.tunix}"))
    return 0


def run_bisect(args: argparse.Namespace) -> int:
    """``bisect``: the first bad commit, printed and written to ``bisect.json``. Exit
    status 0 when one commit is named, 1 when skips leave a range, 2 for bad input
    (refs, a contract that does not exist, endpoints that are not what they claim)."""
    import tempfile

    from harness import bisect, envs

    def log(line: str) -> None:
        print(sources.redact(line), file=sys.stderr, flush=True)

    try:
        target = bisect.parse_target(args.contract)
        if target.kind == "cell" and args.verdict == "warn":
            raise ValueError(f"--verdict warn needs a contract; run cell {target.name!r} "
                             "records no deprecations")  # fmt: skip
        repo = bisect.local_checkout(args.source, (args.cache or envs.DEFAULT_CACHE).parent)
        with tempfile.TemporaryDirectory(prefix="bisect-") as work:
            stepper = bisect.Stepper(
                repo,
                target,
                package=args.package,
                verdict=args.verdict,
                cache=envs.EnvCache(args.cache or envs.DEFAULT_CACHE),
                work=Path(work),
                log=log,
            )
            result = bisect.bisect(
                repo, args.good, args.bad, target, stepper,
                package=args.package, verdict=args.verdict,
            )  # fmt: skip
    except ValueError as error:
        print(f"posttrain-harness bisect: {sources.redact(str(error))}", file=sys.stderr)
        return 2
    path = bisect.write(result, args.report_dir)
    for line in bisect.summary(result):
        print(line)
    print(f"bisect: {path}", file=sys.stderr)
    return 0 if result["first_bad"] else 1


def run_report_merge(args: argparse.Namespace) -> int:
    """``report merge DIR...``: the rows of each DIR's report, combined in the entries
    file's order (as ``matrix --update``), written to ``--report-dir`` and compared with
    the report already there. Exit status as ``matrix``; 2 for a missing or bad part."""
    from harness import entries, report

    parts = []
    try:
        loaded = entries.load_entries(args.entries or entries.ENTRIES_FILE)
        for directory in args.parts:
            part = report.load(directory)
            if part is None:
                raise ValueError(f"{directory} holds no compat-matrix.json")
            if not part["entries"]:
                raise ValueError(f"{directory}: its report holds no entries; nothing to merge")
            parts.append(part)
        previous = report.load(args.report_dir)
    except ValueError as error:
        print(f"posttrain-harness report merge: {error}", file=sys.stderr)
        return 2
    rows = report.combine([p["entries"] for p in parts], [e.name for e in loaded])
    # a part's host: its machine line up to the details (", 2 cores ...") or an earlier
    # merge's note ("; merged from ..."), so a merged report merged again says it once
    machines = sorted({re.split(r"[,;]", p["machine"])[0].strip() for p in parts})
    machine = f"{', '.join(machines)}; merged from {len(parts)} reports ({len(rows)} entries)"
    return _write_report(rows, machine, previous, args, [e.name for e in loaded])


def show_devices(devices: str | None) -> int:
    """Prints backend, device count and devices after configuring ``devices``."""
    try:
        configure_devices(devices)
    except (ValueError, RuntimeError) as error:
        print(f"posttrain-harness devices: {error}", file=sys.stderr)
        return 2
    facts = device_facts()
    print(f"backend: {facts['backend']}")
    print(f"device_count: {facts['device_count']}")
    print("devices:")
    for device in facts["devices"]:
        print(f"  {device}")
    return 0


def gate_command(args: argparse.Namespace, junit: Path, extra: Sequence[str]) -> list[str]:
    """The pytest command line the gate runs."""
    command = [sys.executable, "-m", "pytest"]
    if importlib.util.find_spec("xdist") is not None:
        # worksteal: an idle worker takes queued tests from a busy one, so a few long
        # tests (SFT runs, MoE compiles) do not leave the other worker idle at the end.
        command += ["-n", str(args.jobs), "--dist", "worksteal"]
    else:
        print("gate: pytest-xdist is not installed; running tests in one process", flush=True)
    command += ["--strict-skips", f"--junitxml={junit}"]
    if not args.slow:
        command += ["-m", "not slow"]
    if args.devices is not None:
        command += ["--devices", str(args.devices)]
    return [*command, *extra]  # extra last: a later -m/-n overrides ours


def run_gate(args: argparse.Namespace, extra: Sequence[str]) -> int:
    """Runs the gate; returns its exit status (see the module docstring)."""
    report_dir: Path = args.report_dir
    report_dir.mkdir(parents=True, exist_ok=True)
    junit = report_dir / JUNIT_NAME
    junit.unlink(missing_ok=True)  # never summarise a stale report
    command = gate_command(args, junit, extra)
    print(f"gate: {shlex.join(command)}", flush=True)
    start = time.monotonic()
    pytest_code = subprocess.call(command, env=suite_env(args.compile_cache))
    wall_time = time.monotonic() - start

    summary = summarize_junit(junit) if junit.is_file() else empty_summary()
    executed = sum(summary["counts"][key] for key in ("passed", "failed", "error"))
    status, message = gate_exit_status(pytest_code, executed)
    if not junit.is_file():
        message += ", no JUnit report written"
    summary.update(
        result="passed" if status == 0 else "failed",
        message=message,
        exit_code=status,
        pytest_exit_code=pytest_code,
        wall_time_s=round(wall_time, 2),
        command=command,
        junit=str(junit) if junit.is_file() else None,
    )
    summary_path = report_dir / SUMMARY_NAME
    atomic.write_text(summary_path, json.dumps(summary, indent=2) + "\n")
    print(format_summary(summary, summary_path), flush=True)
    return status


def gate_exit_status(pytest_code: int, executed: int) -> tuple[int, str]:
    """The gate's exit status and message from pytest's code and the tests that ran.

    Args:
        pytest_code: pytest's exit status.
        executed: tests that passed, failed or errored (skips excluded).
    """
    if pytest_code == PYTEST_NO_TESTS_COLLECTED or (pytest_code == 0 and executed == 0):
        return 1, "gate ran no tests"
    if pytest_code == 0:
        return 0, "gate passed"
    return pytest_code, f"gate failed (pytest exit {pytest_code})"


def empty_summary() -> dict[str, Any]:
    """A summary with no results, for a run that wrote no JUnit report."""
    return {
        "counts": {**dict.fromkeys(junit.OUTCOMES, 0), "total": 0},
        "failures": [],
        "skip_reasons": {},
        "junit_time_s": 0.0,
        "properties": {},
    }


def summarize_junit(path: Path, root: Path | None = None) -> dict[str, Any]:
    """Counts, failing tests and skip reasons of a pytest JUnit XML report.

    Args:
        path: the JUnit XML file.
        root: directory test ids are resolved against (default: the current
            directory, pytest's rootdir when run from the repository root).

    Returns:
        ``counts`` (one per :data:`harness.junit.OUTCOMES`, and ``total``), ``failures``
        (each ``id``, ``outcome`` and first ``message`` line), ``skip_reasons`` (first
        line -> count), ``junit_time_s`` and the testsuite ``properties``.
    """
    root = Path.cwd() if root is None else root
    report = junit.read(path, MESSAGE_WIDTH)
    summary = empty_summary()
    counts = collections.Counter(case.outcome for case in report.cases)
    summary["counts"] = {**summary["counts"], **counts, "total": len(report.cases)}
    summary["failures"] = [
        {"id": case.node_id(root), "outcome": case.outcome, "message": case.message}
        for case in report.cases
        if case.outcome in ("failed", "error")
    ]
    skips = collections.Counter(c.message for c in report.cases if c.outcome == "skipped")
    summary["skip_reasons"] = dict(skips.most_common())
    summary["junit_time_s"] = report.time_s
    summary["properties"] = report.properties
    return summary


def format_summary(summary: dict[str, Any], summary_path: Path) -> str:
    """The one-screen gate summary; its last line is ``gate: N passed, N failed, N skipped``."""
    counts = summary["counts"]
    lines = [
        "-" * 24 + " posttrain-harness gate " + "-" * 24,
        f"{summary['message']} in {summary['wall_time_s']:.1f} s "
        f"(tests {summary['junit_time_s']:.1f} s)",
        f"passed {counts['passed']}, failed {counts['failed']}, errors {counts['error']}, "
        f"skipped {counts['skipped']} (of {counts['total']})",
    ]
    failures = summary["failures"]
    if failures:
        lines.append("failures and errors:")
        for failure in failures[:MAX_LISTED]:
            label = "FAILED" if failure["outcome"] == "failed" else "ERROR "
            lines.append(f"  {label} {failure['id']}: {failure['message']}")
        if len(failures) > MAX_LISTED:
            lines.append(f"  ... and {len(failures) - MAX_LISTED} more in {summary_path}")
    if summary["skip_reasons"]:
        lines.append("skip reasons:")
        for reason, count in list(summary["skip_reasons"].items())[:MAX_LISTED]:
            lines.append(f"  {count:4d} x {reason}")
    reports = ", ".join(str(p) for p in (summary["junit"], summary_path) if p is not None)
    lines.append(f"reports: {reports}")
    failed = counts["failed"] + counts["error"]
    lines.append(f"gate: {counts['passed']} passed, {failed} failed, {counts['skipped']} skipped")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
