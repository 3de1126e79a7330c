"""The matrix report: ``compat-matrix.md``, ``.json`` and ``.html`` from the matrix rows.

Rows are entries (in ``compat/entries.toml`` order), columns the contracts (JUnit
``contract`` property, else the test function), then ``sft``, ``rl`` and ``dpo``
(the real runs); a cell is ``pass``, ``fail``, ``skip``, ``error`` or empty (not run there), with
the first error line.
"First failures" lists, per flavour, each contract that fails somewhere and the
first entry where it fails after having passed in an earlier one (or "from the
first entry" when it never passed before).
"""

from __future__ import annotations

import html
import json
import time
from pathlib import Path
from typing import Any

from posttrain import atomic

STATUS_MARK = {"passed": "pass", "failed": "FAIL", "error": "ERROR", "skipped": "skip"}
RUN_CELLS = ("sft", "rl", "dpo")
"""The columns after the contracts: one real run each (``harness.matrix``)."""
COLORS = {"passed": "#d4f4d4", "failed": "#f8d0d0", "error": "#f0b0b0", "skipped": "#eeeeee"}


def columns(rows: list[dict[str, Any]]) -> list[str]:
    """Contract names in first-seen order, then the run cells (:data:`RUN_CELLS`)."""
    names: list[str] = []
    for row in rows:
        for name in row.get("contracts", {}):
            if name not in names:
                names.append(name)
    return [*names, *RUN_CELLS]


def cell(row: dict[str, Any], column: str) -> dict[str, str] | None:
    if column in RUN_CELLS:
        return row.get(column)
    return row.get("contracts", {}).get(column)


def first_failures(rows: list[dict[str, Any]]) -> list[dict[str, str]]:
    """For each (flavour, contract) failing somewhere: where it first fails."""
    found = []
    for flavour in dict.fromkeys(r["flavour"] for r in rows):
        group = [r for r in rows if r["flavour"] == flavour]
        for column in columns(group):
            passed_in = None
            for row in group:
                c = cell(row, column)
                if c is None:
                    continue
                if c["status"] == "passed":
                    passed_in = row["name"]
                elif c["status"] in ("failed", "error"):
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


def _short(column: str) -> str:
    parts = column.split(".")
    return ".".join(parts[-2:]) if len(parts) > 2 else column


def _versions(row: dict[str, Any]) -> str:
    v = row.get("versions", {})
    return " ".join(f"{k} {v[k]}" for k in ("jax", "flax", "qwix", "optax") if k in v)


def markdown(report: dict[str, Any]) -> str:
    rows, cols = report["entries"], report["columns"]
    out = [
        "# Tunix compatibility matrix\n",
        f"Generated {report['generated']} by `posttrain-harness matrix` on "
        f"{report['machine']}. Cells: pass, FAIL, ERROR, skip; the first error line of "
        "each failing cell is listed below the table.\n",
    ]
    out.append(
        "| entry | convention | versions | env | "
        + " | ".join(f"{i + 1}" for i in range(len(cols)))
        + " |"
    )
    out.append("|---|---|---|---|" + "---|" * len(cols))
    notes = []
    for row in rows:
        env = (
            "error"
            if row["env"].get("error")
            else f"{'built' if row['env']['built'] else 'cached'} {row['env']['seconds']:.0f} s"
        )
        name = row["name"] + (" (emulated)" if row.get("emulated") else "")
        cells = []
        for col in cols:
            c = cell(row, col)
            if c is None:
                cells.append("")
                continue
            cells.append(STATUS_MARK[c["status"]])
            if c["status"] in ("failed", "error"):
                notes.append(f"- {row['name']} / {col}: {c.get('message', '')}")
        if row.get("error"):
            notes.append(f"- {row['name']}: {row['error']}")
        out.append(
            f"| {name} | {row['convention']} | {_versions(row)} | {env} | "
            + " | ".join(cells)
            + " |"
        )
    out.append("\nColumns: " + "; ".join(f"{i + 1} = `{c}`" for i, c in enumerate(cols)) + ".\n")
    if notes:
        out.append("## Errors\n")
        out += notes
        out.append("")
    failures = report["first_failures"]
    out.append("## First failures\n")
    if not failures:
        out.append("Every contract passes in every entry that ran it.\n")
    for f in failures:
        after = (
            f"after passing in {f['after_passing']}"
            if f["after_passing"]
            else "from the first entry that ran it"
        )
        out.append(
            f"- [{f['flavour']}] `{f['contract']}`: first fails in "
            f"**{f['first_failing']}** {after}: {f['error']}"
        )
    return "\n".join(out) + "\n"


def html_page(report: dict[str, Any]) -> str:
    rows, cols = report["entries"], report["columns"]
    esc = html.escape
    head = "".join(f'<th title="{esc(c)}">{esc(_short(c))}</th>' for c in cols)
    body = []
    for row in rows:
        tds = []
        for col in cols:
            c = cell(row, col)
            if c is None:
                tds.append("<td></td>")
                continue
            tds.append(
                f'<td style="background:{COLORS[c["status"]]}" '
                f'title="{esc(c.get("message", ""))}">{STATUS_MARK[c["status"]]}</td>'
            )
        error = f"<br><small>{esc(row['error'])}</small>" if row.get("error") else ""
        body.append(
            f"<tr><th>{esc(row['name'])}{error}</th><td>{esc(row['convention'])}</td>"
            f"<td>{esc(_versions(row))}</td>{''.join(tds)}</tr>"
        )
    fails = "".join(
        f"<li>[{esc(f['flavour'])}] <code>{esc(f['contract'])}</code>: first fails "
        f"in <b>{esc(f['first_failing'])}</b>"
        f"{' after ' + esc(f['after_passing']) if f['after_passing'] else ''}: "
        f"{esc(f['error'])}</li>"
        for f in report["first_failures"]
    )
    return (
        f"<!doctype html><meta charset=utf-8><title>Tunix compatibility matrix</title>"
        f"<style>td,th{{border:1px solid #ccc;padding:2px 6px;font:13px sans-serif}}"
        f"table{{border-collapse:collapse}}</style><h1>Tunix compatibility matrix</h1>"
        f"<p>Generated {esc(report['generated'])} on {esc(report['machine'])}.</p>"
        f"<table><tr><th>entry</th><th>convention</th><th>versions</th>{head}</tr>"
        f"{''.join(body)}</table><h2>First failures</h2><ul>{fails}</ul>\n"
    )


def merge(report_dir: Path, rows: list[dict[str, Any]], order: list[str]) -> list[dict[str, Any]]:
    """``rows`` replacing same-named rows of the report in ``report_dir``, in ``order``."""
    path = report_dir / "compat-matrix.json"
    old = json.loads(path.read_text())["entries"] if path.is_file() else []
    by_name = {r["name"]: r for r in old} | {r["name"]: r for r in rows}
    rank = {name: i for i, name in enumerate(order)}
    return sorted(by_name.values(), key=lambda r: rank.get(r["name"], len(rank)))


def build(rows: list[dict[str, Any]], machine: str) -> dict[str, Any]:
    return {
        "generated": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine,
        "entries": rows,
        "columns": columns(rows),
        "first_failures": first_failures(rows),
    }


def write(report: dict[str, Any], report_dir: Path) -> list[Path]:
    """Writes the three files atomically; returns their paths."""

    report_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for suffix, text in (
        ("md", markdown(report)),
        ("json", json.dumps(report, indent=2) + "\n"),
        ("html", html_page(report)),
    ):
        path = report_dir / f"compat-matrix.{suffix}"
        atomic.write_text(path, text)
        paths.append(path)
    return paths
