"""The pre-merge gate: the pytest command it runs, its exit status, and the one-screen
summary parsed from the JUnit report (``posttrain-harness gate``, :mod:`harness.cli`)."""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.devices.devices import suite_env
from harness.gate import junit, sizes
from posttrain import atomic

PYTEST_NO_TESTS_COLLECTED = 5  # pytest.ExitCode.NO_TESTS_COLLECTED
JUNIT_NAME = "junit-gate.xml"
SUMMARY_NAME = "gate-summary.json"
MAX_LISTED = 20  # failures / skip reasons printed; the JSON summary has them all
MESSAGE_WIDTH = 160


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
    summary["sizes"] = sizes.summary_lines(Path(__file__).resolve().parents[2])
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
        "sizes": [],
    }


def summarize_junit(path: Path, root: Path | None = None) -> dict[str, Any]:
    """Counts, failing tests and skip reasons of a pytest JUnit XML report.

    Args:
        path: the JUnit XML file.
        root: directory test ids are resolved against (default: the current
            directory, pytest's rootdir when run from the repository root).

    Returns:
        ``counts`` (one per :data:`harness.gate.junit.OUTCOMES`, and ``total``), ``failures``
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
    lines.extend(summary["sizes"])  # STYLE.md's targets: a warning, not the verdict
    reports = ", ".join(str(p) for p in (summary["junit"], summary_path) if p is not None)
    lines.append(f"reports: {reports}")
    failed = counts["failed"] + counts["error"]
    lines.append(f"gate: {counts['passed']} passed, {failed} failed, {counts['skipped']} skipped")
    return "\n".join(lines)
