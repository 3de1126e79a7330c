"""The bodies of ``posttrain-harness``'s subcommands other than the gate (devices,
launch, matrix, bisect, report merge); the parser and dispatch are :mod:`harness.cli`.
Each returns its exit status: bad input is one line on stderr and 2."""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.devices.devices import configure_devices, device_facts
from harness.matrix import sources

REFERENCE_REPORTS = "reports"
"""The committed matrix report (the project's reference), relative to the checkout."""
LATEST_REPORTS = "reports/latest"
"""Where a user's matrix run writes by default (ignored by git)."""


def run_launch(args: argparse.Namespace, command: list[str]) -> int:
    """``posttrain-harness launch``: :func:`harness.devices.launch.launch`; bad input is one line
    and exit status 2, before any process starts."""
    from harness.devices import launch

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
    from harness.matrix import entries, envs, matrix, progress
    from harness.report import report

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
        from harness.bisect import bisect, suggestions

        named = bisect.run_suggestions(
            suggestions.suggestions(rows),
            envs.EnvCache(args.cache or envs.DEFAULT_CACHE),
            log=lambda line: print(sources.redact(line), file=sys.stderr, flush=True),
        )
    return _write_report(rows, machine, previous, args, [e.name for e in loaded], named)


def _reference_report(report_dir: Path) -> dict[str, Any] | None:
    """The committed reference report, to compare a first run in another directory with
    (None when ``report_dir`` is the reference's, or it is absent or unreadable)."""
    from harness.matrix import entries
    from harness.report import report

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
    from harness.bisect import suggestions
    from harness.report import drift, files, fits, markdown, report

    built = report.build(
        rows,
        machine,
        previous=previous,
        drift=drift.check(rows, args.index_url),
        not_run=every,
        bisect=suggestions.suggestions(rows) if bisected is None else bisected,
        fits=fits.load(args.report_dir),  # the plans' rows beside the report, if any
    )
    paths = files.write(built, args.report_dir)
    print(sources.redact(markdown.markdown(built)))
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
    from harness.bisect import bisect, git_history
    from harness.matrix import envs

    def log(line: str) -> None:
        print(sources.redact(line), file=sys.stderr, flush=True)

    try:
        target = bisect.parse_target(args.contract)
        if target.kind == "cell" and args.verdict == "warn":
            raise ValueError(
                f"--verdict warn needs a contract; run cell {target.name!r} records no deprecations"
            )
        repo = git_history.local_checkout(args.source, args.cache or envs.DEFAULT_CACHE)
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
                repo,
                args.good,
                args.bad,
                target,
                stepper,
                package=args.package,
                verdict=args.verdict,
            )
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
    from harness.matrix import entries
    from harness.report import report

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
        print(f"posttrain-harness report merge: {sources.redact(str(error))}", file=sys.stderr)
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
