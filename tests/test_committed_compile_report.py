"""The chip's committed compile report (``reports/compile-tpu-v5e.jsonl``, docs/testing.md)
reads as a report. Apart from tests/test_compile_report.py: mutation runs copy no
``reports/``."""

from __future__ import annotations

import pathlib

import pytest

from harness.gate import compile_report

pytestmark = pytest.mark.host

REPORT = pathlib.Path(__file__).parents[1] / "reports/compile-tpu-v5e.jsonl"


def test_the_chips_committed_report_reads_whole():
    """``reports/compile-tpu-v5e.jsonl`` (docs/testing.md) is a report: every line reads,
    each names its command, and its files' sums are its totals."""
    path = REPORT
    rows = compile_report.read(path)
    assert len(rows) == len(path.read_text().splitlines()) > 800
    assert {row["command"] for row in rows} == {1, 2, 3}
    files = compile_report.by_file(rows)
    assert sum(sums["tests"] for sums in files.values()) == len(rows)
    assert sum(sums["programs"] for sums in files.values()) == sum(r["programs"] for r in rows)
