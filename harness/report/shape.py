"""The shape a matrix report must have to be merged or rendered (:func:`check_shape`):
the keys and types :mod:`harness.report.report`'s merge, flips and renderers read, so a
malformed part (a CI fan-out's, or a hand-edited file) is one line naming the first
wrong value instead of an internal error in a renderer."""

from __future__ import annotations

from typing import Any

STATUSES = ("passed", "warned", "skipped", "failed", "error")
"""Cell statuses, best to worst; ``skipped`` is shown as n/a (its message says why)."""
RUN_CELLS = ("sft", "rl", "dpo", "distill", "vision")
"""The columns after the contracts: one real run each (:data:`harness.matrix.run_cells.CELLS`)."""


def _cell_problem(cell: Any) -> str | None:
    if not isinstance(cell, dict):
        return f"{cell!r}; expected a table"
    if cell.get("status") not in STATUSES:
        return f"status {cell.get('status')!r}; expected one of {', '.join(STATUSES)}"
    if not isinstance(cell.get("message", ""), str):
        return f"message {cell['message']!r}; expected a string"
    return None


def _row_problem(row: dict[str, Any]) -> str | None:
    """What is wrong with a row's fields the renderers read besides its cells
    (``versions``, ``source``, ``error``), None when nothing."""
    versions, source, error = row.get("versions", {}), row.get("source"), row.get("error")
    if not isinstance(versions, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in versions.items()
    ):
        return f"versions = {versions!r}; expected an object of name: version strings"
    if source is not None and not (
        isinstance(source, dict)
        and isinstance(source.get("spec"), str)
        and isinstance(source.get("resolved", ""), str | None)
    ):
        return f"source = {source!r}; expected an object with a spec string and resolved"
    if error is not None and not isinstance(error, str):
        return f"error = {error!r}; expected a string"
    return None


def check_shape(report: Any) -> str | None:
    """What is wrong with a loaded report's shape, in a few words (None: nothing): the
    keys the merge, the flips and the renderers read, each of the type they expect."""
    if not isinstance(report, dict):
        return f"{type(report).__name__}; expected a JSON object"
    missing = [k for k in ("entries", "columns", "generated", "machine") if k not in report]
    if missing:
        return ", ".join(repr(k) for k in missing)
    for key in ("generated", "machine"):
        if not isinstance(report[key], str):
            return f"{key} = {report[key]!r}; expected a string"
    if not isinstance(report["columns"], list) or not all(
        isinstance(c, str) for c in report["columns"]
    ):
        return f"columns = {report['columns']!r}; expected a list of strings"
    if not isinstance(report["entries"], list):
        return f"entries = {report['entries']!r}; expected a list"
    for i, row in enumerate(report["entries"]):
        if not isinstance(row, dict):
            return f"entry {i} is {row!r}; expected an object"
        missing = [k for k in ("name", "flavour", "convention", "contracts") if k not in row]
        if missing:
            return f"entry {i} has no {', '.join(missing)}"
        for key in ("name", "flavour", "convention"):
            if not isinstance(row[key], str):
                return f"entry {i}: {key} = {row[key]!r}; expected a string"
        if not isinstance(row["contracts"], dict):
            got = row["contracts"]
            return f"entry {i} ({row['name']}): contracts = {got!r}; expected an object"
        problem = _row_problem(row)
        if problem:
            return f"entry {i} ({row['name']}): {problem}"
        cells = [(f"contracts[{k!r}]", v) for k, v in row["contracts"].items()]
        cells += [(c, row[c]) for c in RUN_CELLS if row.get(c) is not None]
        for where, cell in cells:
            problem = _cell_problem(cell)
            if problem:
                return f"entry {i} ({row['name']}): {where} {problem}"
    return None
