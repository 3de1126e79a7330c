"""The chip's committed compile report (``reports/compile-tpu-v5e.jsonl``, docs/testing.md)
reads as a report. Apart from tests/test_compile_report.py: mutation runs copy no
``reports/``."""

from __future__ import annotations

import pathlib

import pytest

from harness.gate import compile_report

pytestmark = pytest.mark.host

REPORTS = pathlib.Path(__file__).parents[1] / "reports"


@pytest.mark.parametrize(
    ("name", "commands", "tests"),
    [("compile-tpu-v5e.jsonl", {1, 2, 3}, 912), ("compile-tpu-v5e-sampled.jsonl", {1, 2, 3}, 762)],
    ids=["whole-tier", "chips-selection"],
)
def test_the_chips_committed_report_reads_whole(name, commands, tests):
    """The chip's committed reports (docs/testing.md: the whole tier at XLA's defaults, and
    the chip's selection, its third command the eighteenth session's) are reports: every
    line reads, each names its command, and the files' sums are the totals."""
    path = REPORTS / name
    rows = compile_report.read(path)
    assert len(rows) == len(path.read_text().splitlines()) == tests
    assert len({row["test"] for row in rows}) == tests  # each test once
    assert {row["command"] for row in rows} == commands
    files = compile_report.by_file(rows)
    assert sum(sums["tests"] for sums in files.values()) == len(rows)
    assert sum(sums["programs"] for sums in files.values()) == sum(r["programs"] for r in rows)
