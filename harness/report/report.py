"""The matrix report: ``compat-matrix.json``, ``.md`` and ``.html`` from the matrix rows.

Rows are entries (in ``compat/entries.toml`` order), columns the contracts (JUnit
``contract`` property, else the test function), then ``sft``, ``rl`` and ``dpo``
(the real runs). A cell's status is one of :data:`STATUSES`; an absent cell is
"not run". The report's JSON (:func:`build`) holds the rows and what is derived from
them:

- ``first_failures``: per flavour, each column failing somewhere, the first entry where
  it fails and the last entry before it where it passed (empty when it never had);
- ``broken``: every failing cell and every row that could not run;
- ``deprecations``: every upstream deprecation seen, with the first entry (in entry
  order) where it appears and how many entries show it;
- ``previous`` and ``changed``: the statuses of the report this one replaced (when
  there was one) and the cells whose status flipped since;
- ``drift``: newer upstream releases than the newest tested (:mod:`harness.report.drift`);
- ``fits``: the seed's scale configurations compiled for their TPU slices by
  ``posttrain plan`` (:mod:`harness.report.fits`), or None when no plan rows exist.

The Markdown (:mod:`harness.report.markdown`) is for a PR comment; the HTML
(:mod:`harness.report.html`) is one self-contained page; both and the JSON are
written by :func:`harness.report.files.write`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.matrix import sources
from harness.report.shape import RUN_CELLS, STATUSES, check_shape

BAD = ("failed", "error")
REPORT_NAME = "compat-matrix"


def columns(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Contract names in first-seen order, then the run cells (:data:`RUN_CELLS`)."""
    names: list[str] = []
    for row in rows:
        for name in row.get("contracts", {}):
            if name not in names:
                names.append(name)
    return [*names, *RUN_CELLS]


def cell(row: dict[str, Any], column: str) -> dict[str, Any] | None:
    """The row's cell in ``column``; None when it did not run there."""
    if column in RUN_CELLS:
        return row.get(column)
    return row.get("contracts", {}).get(column)


def first_failures(rows: Sequence[dict[str, Any]]) -> list[dict[str, str]]:
    """For each (flavour, column) failing somewhere: where it first fails."""
    found = []
    for flavour in dict.fromkeys(r["flavour"] for r in rows):
        group = [r for r in rows if r["flavour"] == flavour]
        for column in columns(group):
            passed_in = None
            for row in group:
                c = cell(row, column)
                if c is None:
                    continue
                if c["status"] in ("passed", "warned"):
                    passed_in = row["name"]
                elif c["status"] in BAD:
                    found.append(
                        {
                            "flavour": flavour,
                            "contract": column,
                            "first_failing": row["name"],
                            "after_passing": passed_in or "",
                            "error": c.get("message", ""),
                        }
                    )
                    break
    return found


def broken(rows: Sequence[dict[str, Any]], cols: Sequence[str]) -> list[dict[str, str]]:
    """Every row that could not run (``column`` empty) and every failing cell, in grid order."""
    found = []
    for row in rows:
        if row.get("error"):
            found.append(
                {"entry": row["name"], "column": "", "status": "error", "message": row["error"]}
            )
        for column in cols:
            c = cell(row, column)
            if c and c["status"] in BAD:
                found.append(
                    {
                        "entry": row["name"],
                        "column": column,
                        "status": c["status"],
                        "message": c.get("message", ""),
                        "test": c.get("test", ""),
                    }
                )
    return found


def _warning_key(text: str) -> str:
    """A deprecation without its ``(path:line)``: line numbers move between releases."""
    return text.rsplit(" (", 1)[0] if text.endswith(")") else text


def deprecations(rows: Sequence[dict[str, Any]], cols: Sequence[str]) -> list[dict[str, Any]]:
    """Every distinct upstream deprecation: ``{"warning", "where", "first_entry",
    "entries", "columns"}`` (``where``: its first ``path:line``), in first-seen order.
    Distinct: the text, and the package raising it (the first part of its path; the
    same deprecation from qwix and from tunix are two findings), not the line."""
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for row in rows:
        for column in cols:
            c = cell(row, column) or {}
            for text in c.get("warnings", []):
                key = _warning_key(text)
                where = text[len(key) + 2 : -1] if text != key else ""
                item = found.setdefault(
                    (key, where.split("/")[0]),
                    {
                        "warning": key,
                        "where": where,
                        "first_entry": row["name"],
                        "entries": [],
                        "columns": [],
                    },
                )
                if row["name"] not in item["entries"]:
                    item["entries"].append(row["name"])
                if column not in item["columns"]:
                    item["columns"].append(column)
    return list(found.values())


def statuses(report: dict[str, Any]) -> dict[str, dict[str, str]]:
    """Entry -> column -> status of every cell that ran (what ``previous`` keeps)."""
    return {
        row["name"]: {
            column: c["status"]
            for column in report["columns"]
            if (c := cell(row, column)) is not None
        }
        for row in report["entries"]
    }


def changed(previous: dict[str, Any] | None, now: dict[str, Any]) -> list[dict[str, str]]:
    """The cells whose status flipped: in an entry and a column both reports have, the
    status differs (a cell that ran in one and not the other counts, as "not run").
    Entries or columns new to this report are new, not flipped."""
    if not previous:
        return []
    before, after = previous["cells"], statuses(now)
    old_columns = set(previous["columns"])
    flips = []
    for entry, cells in after.items():
        if entry not in before:
            continue
        for column in now["columns"]:
            if column not in old_columns:
                continue
            was, is_ = before[entry].get(column, "not run"), cells.get(column, "not run")
            if was != is_:
                flips.append({"entry": entry, "column": column, "from": was, "to": is_})
    return flips


def build(
    rows: Sequence[dict[str, Any]],
    machine: str,
    *,
    previous: dict[str, Any] | None = None,
    drift: dict[str, Any] | None = None,
    not_run: Sequence[str] = (),
    bisect: Sequence[dict[str, str]] = (),
    fits: Sequence[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The report of ``rows``; ``previous``: the report it replaces (its statuses are
    kept, to mark flips); ``drift``: :func:`harness.report.drift.check`'s result; ``not_run``:
    the entries of the entries file this report leaves out (the summary names them and
    the command that runs them: :func:`not_run_lines`); ``bisect``: the ``bisect``
    commands that would name the commit behind a source row's FAIL or warn cell
    (:func:`harness.bisect.suggestions.suggestions`); ``fits``: the rows of
    :func:`harness.report.fits.load` (None: no plans were run)."""
    cols = columns(rows)
    report: dict[str, Any] = {
        "generated": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine,
        "entries": list(rows),
        "columns": cols,
        "first_failures": first_failures(rows),
        "broken": broken(rows, cols),
        "deprecations": deprecations(rows, cols),
        "drift": drift,
        "not_run": [name for name in not_run if name not in {r["name"] for r in rows}],
        "bisect": list(bisect),
        "fits": None if fits is None else list(fits),
    }
    report["previous"] = (
        {
            "generated": previous["generated"],
            "columns": previous["columns"],
            "cells": statuses(previous),
        }
        if previous
        else None
    )
    report["changed"] = changed(report["previous"], report)
    return report


def not_run_lines(report: dict[str, Any]) -> list[str]:
    """What the report leaves out and how to run it (``[]`` when it holds every entry)."""
    left = report.get("not_run") or []
    if not left:
        return []
    return [
        f"Not run here ({len(left)} entries): {', '.join(left)}.",
        "Run them with `posttrain-harness matrix --all` (every entry) or "
        "`posttrain-harness matrix --only NAME` (repeatable, prefixes allowed).",
    ]


def load(report_dir: Path) -> dict[str, Any] | None:
    """The report in ``report_dir`` (None when there is none), its shape checked
    (:func:`check_shape`).

    Raises:
      ValueError: the file is not a report's JSON, in one line naming the file and the
        first key whose value is missing or of the wrong type.
    """
    path = Path(report_dir) / f"{REPORT_NAME}.json"
    if not path.is_file():
        return None
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not a matrix report ({error})") from None
    except RecursionError:  # [[[[...: past Python's recursion limit
        raise ValueError(f"{path} is not a matrix report (nested too deeply)") from None
    problem = check_shape(report)
    if problem:
        # the value named may be a source URL's: never its credentials
        raise ValueError(sources.redact(f"{path} is not a matrix report ({problem})"))
    return report


def combine(
    parts: Sequence[Sequence[dict[str, Any]]], order: Sequence[str]
) -> list[dict[str, Any]]:
    """Rows of several runs as one list in ``order`` (entry names; unknown names last,
    in the order given); a later part's row replaces an earlier one of the same name.
    What ``--update`` and ``report merge`` both use."""
    by_name: dict[str, dict[str, Any]] = {}
    for rows in parts:
        for row in rows:
            by_name[row["name"]] = row
    rank = {name: i for i, name in enumerate(order)}
    return sorted(by_name.values(), key=lambda r: rank.get(r["name"], len(rank)))


# What the two renderings share.
LABELS = {
    "passed": "pass",
    "warned": "warn",
    "skipped": "n/a",
    "failed": "FAIL",
    "error": "ERROR",
    None: "not run",
}
"""Cell status (None: not run) -> its name in the legend."""
VERSION_COLUMNS = ("tunix", "jax", "flax", "qwix", "optax")
_DISTRIBUTION = {"tunix": "google-tunix"}


def short_label(column: str, width: int = 26) -> str:
    """A column's header: a dotted contract name's last two parts (its last part and
    the words after it, a parenthesis only when short, when it has words), a test function's
    name without ``test_``; cut to ``width`` characters."""
    head, _, rest = column.partition(" ")
    words, paren, note = rest.partition("(")
    rest = words.strip() + (f" ({note}" if paren and len(note) <= 8 else "")
    rest = rest.strip()
    parts = head.split(".")
    if rest:  # "tunix.sft.dpo dpo_loss_fn (ORPO)" -> "dpo dpo_loss_fn"
        label = f"{parts[-1]} {rest}"
    else:
        label = ".".join(parts[-2:]) if len(parts) > 2 else head.removeprefix("test_")
    return label if len(label) <= width else label[: width - 1] + "…"


def compact_versions(row: dict[str, Any]) -> str:
    """``0.1.7 · 0.10.2 · 0.12.8 · 0.1.8 · 0.2.8`` (:data:`VERSION_COLUMNS`; ``-``: absent)."""
    v = row.get("versions", {})
    return " · ".join(v.get(_DISTRIBUTION.get(k, k), "-") for k in VERSION_COLUMNS)


def full_versions(row: dict[str, Any]) -> str:
    """Every installed distribution of the row, ``name version`` comma-separated."""
    return ", ".join(f"{k} {v}" for k, v in row.get("versions", {}).items())


def source_line(row: dict[str, Any]) -> str:
    """Where a source row's Tunix came from, and whether it could be had ("" for a
    release row): a git URL and the commit it resolved to, or a local directory and its
    commit or tree hash, or why it was not run."""
    source = row.get("source")
    if not source:
        return ""
    kind = "git URL" if "://" in source["spec"] else "local checkout"
    if source["resolved"] is None:
        return f"Tunix from the {kind} {source['spec']}: not run ({row.get('error', '')})"
    return f"Tunix from the {kind} {source['spec']} at {source['resolved']}"


def totals(report: dict[str, Any]) -> dict[str | None, int]:
    """Status -> number of cells over the grid (None: not run)."""
    counts: dict[str | None, int] = dict.fromkeys([*STATUSES, None], 0)
    for row in report["entries"]:
        for column in report["columns"]:
            c = cell(row, column)
            counts[c["status"] if c else None] += 1
    return counts
