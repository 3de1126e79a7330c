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
        COMMAND joined into one JAX runtime (harness/devices/launch.py).
    matrix: the Tunix compatibility matrix (harness/matrix/matrix.py, harness/report/report.py):
        one cached env per compat/entries.toml entry, contracts + a short SFT run
        in each, reports/compat-matrix.{md,json,html}. ``--list [--json]`` prints the
        selected entries (one CI job each); ``--tunix-source`` adds Tunix from source.
    report merge DIR...: one report from several per-entry reports (the CI fan-out's
        last job), in the entries file's order.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from harness.gate.gate import run_gate
from harness.matrix import sources
from harness.report import drift
from harness.subcommands import (
    LATEST_REPORTS,
    REFERENCE_REPORTS,
    run_bisect,
    run_launch,
    run_matrix,
    run_report_merge,
    show_devices,
)
from posttrain import flags, signals


def default_compile_cache() -> str:
    """``$XDG_CACHE_HOME`` (or ``~/.cache``) ``/posttrain-harness/jax-compile``.

    Per user, not per checkout: fresh clones and worktrees on one machine share
    compiles (JAX keys each entry by program, compile options, backend and version).
    """
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return str(root / "posttrain-harness" / "jax-compile")


def _parser() -> argparse.ArgumentParser:
    parser = flags.Parser(
        prog="posttrain-harness",
        description="Harness of the posttrain stack: device setup and the pre-merge gate.",
        allow_abbrev=False,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    _devices_command(commands)
    _gate_command(commands)
    _launch_command(commands)
    _matrix_command(commands)
    _bisect_command(commands)
    _report_command(commands)
    return parser


def _devices_command(commands) -> None:
    """``devices``: the device source to configure and print."""
    devices = commands.add_parser(
        "devices", help="print the backend, device count and devices", allow_abbrev=False
    )
    devices.add_argument(
        "--devices",
        metavar="N|real",
        default=None,
        help="N fake CPU devices or 'real' (default: $POSTTRAIN_DEVICES or 8)",
    )


def _gate_command(commands) -> None:
    """``gate``: the pre-merge gate (pytest arguments after ``--``)."""
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


def _launch_command(commands) -> None:
    """``launch``: N local processes of the command after ``--``, one JAX runtime."""
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


def _matrix_command(commands) -> None:
    """``matrix``: the Tunix compatibility matrix and its report."""
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
        "--jobs", "-j", default="2", type=_jobs, help="xdist workers per entry, run cells at once"
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


def _bisect_command(commands) -> None:
    """``bisect``: the upstream commit that first breaks a contract or run cell."""
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
        "--cache",
        default=None,
        type=Path,
        help="environment cache (as matrix --cache); a URL --source is cloned under CACHE/sources",
    )


def _report_command(commands) -> None:
    """``report merge``: one matrix report from per-entry reports."""
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


def _index_option(parser: argparse.ArgumentParser) -> None:
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
        # SIGTERM as Ctrl-C: exports, half-built environments and clones are removed on the
        # way out (gate: pytest's own handling; launch: its own, which stops the ranks)
        with (
            contextlib.nullcontext()
            if args.command in ("gate", "launch")
            else (signals.interrupts())
        ):
            return _dispatch(parser, args, passthrough)
    except KeyboardInterrupt as interrupt:
        name, status = signals.exit_status(interrupt)
        print(signals.line(name, "posttrain-harness"), file=sys.stderr)
        return status
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


if __name__ == "__main__":
    sys.exit(main())
