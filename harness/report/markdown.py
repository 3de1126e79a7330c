"""The matrix report as Markdown, pasteable into a PR comment.

GitHub caps a comment at 65,536 characters; the grid is numbered columns of one
glyph each, and the lists below it are cut at :data:`MAX_LISTED` items, so the full
matrix stays far under the cap (the test measures it on the committed report).
"""

from __future__ import annotations

from typing import Any

from harness.report import drift as _drift
from harness.report import fits
from harness.report.report import (
    LABELS,
    VERSION_COLUMNS,
    cell,
    compact_versions,
    not_run_lines,
    source_line,
    totals,
)

GLYPHS = {
    "passed": "✅",
    "warned": "⚠️",
    "skipped": "➖",
    "failed": "❌",
    "error": "💥",
    None: "",
}
"""Cell status (None: not run) -> what its cell shows."""
FLIP_MARK = "🔁"
MAX_LISTED = 40
COMMENT_LIMIT = 65_536


def _text(message: str) -> str:
    """A message as Markdown text: no HTML (``<``, ``>``), no code spans or emphasis it
    did not mean (a message from a failing test can hold anything)."""
    out = message.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    for char in "`*_[]|":
        out = out.replace(char, "\\" + char)
    return out


def _listed(lines: list[str]) -> list[str]:
    if len(lines) <= MAX_LISTED:
        return lines
    return [*lines[:MAX_LISTED], f"- … and {len(lines) - MAX_LISTED} more (see the JSON report)"]


def legend() -> str:
    return ", ".join(f"{GLYPHS[s] or '(blank)'} {label}" for s, label in LABELS.items())


def summary(report: dict[str, Any]) -> list[str]:
    """The lines above the grid: totals, what broke, flips, deprecations, drift, sources."""
    counts = totals(report)
    out = [
        f"**{len(report['entries'])} entries × {len(report['columns'])} columns: "
        + ", ".join(f"{counts[s]} {LABELS[s]}" for s in counts)
        + "**\n",
    ]
    out += [f"{line}\n" for line in not_run_lines(report)]
    out += _broken_lines(report) + _changed_lines(report) + _deprecation_lines(report)
    out.append("\n### Upstream releases\n")
    out += [f"- {line}" for line in _drift.lines(report.get("drift"))]
    sources = [f"- **{r['name']}**: {source_line(r)}" for r in report["entries"] if r.get("source")]
    if sources:
        out.append("\n### Tunix from source\n")
        out += sources
    return out + _bisect_lines(report)


def _broken_lines(report: dict[str, Any]) -> list[str]:
    """``### What broke``: each failing cell, its message and test."""
    broken = report.get("broken", [])
    return [f"### What broke ({len(broken)})\n"] + (
        _listed(
            [
                f"- {GLYPHS[b['status']]} **{b['entry']}**"
                + (f" / `{b['column']}`" if b["column"] else "")
                + f": {_text(b['message'])}"
                + (f" (`{b['test']}`)" if b.get("test") else "")
                for b in broken
            ]
        )
        or ["Nothing: every cell that ran passes."]
    )


def _changed_lines(report: dict[str, Any]) -> list[str]:
    """``### Changed since the previous report``: each cell whose verdict flipped."""
    previous = report.get("previous")
    flips = report.get("changed", [])
    since = f"since the previous report ({previous['generated']})" if previous else ""
    out = [f"\n### Changed {since or 'since the previous report'} ({len(flips)})\n"]
    if not previous:
        out.append("No previous report to compare with.")
    return out + (
        _listed(
            [
                f"- {FLIP_MARK} **{f['entry']}** / `{f['column']}`: "
                f"{LABELS.get(f['from'], f['from'])} → {LABELS.get(f['to'], f['to'])}"
                for f in flips
            ]
        )
        or ([] if not previous else ["No cell changed."])
    )


def _deprecation_lines(report: dict[str, Any]) -> list[str]:
    """``### Upstream deprecations``: each warning, where, and its first entry."""
    found = report.get("deprecations", [])
    return [f"\n### Upstream deprecations ({len(found)})\n"] + (
        _listed(
            [
                f"- {_text(d['warning'])} (`{d['where']}`): first in **{d['first_entry']}**, "
                f"{len(d['entries'])} entries"
                for d in found
            ]
        )
        or ["None seen."]
    )


def _bisect_lines(report: dict[str, Any]) -> list[str]:
    """``### Bisect``: the command for each source row's cell, and what it named."""
    suggested = report.get("bisect") or []
    if not suggested:
        return []
    return ["\n### Bisect: the commit behind a source row's cell\n"] + [
        f"- **{b['entry']}** / `{b['column']}` ({LABELS[b['status']]}): `{b['command']}`"
        + (
            f" → first bad: `{b['named']['sha'][:12]}` {b['named']['subject']}"
            if b.get("named")
            else ""
        )
        + (f" → not named: {b['why']}" if b.get("why") else "")
        for b in suggested
    ]


def fits_section(report: dict[str, Any]) -> list[str]:
    """The seed configurations on their TPU slices (:mod:`harness.report.fits`); nothing when the
    report has no plan rows."""
    if report.get("fits") is None:
        return []
    return [
        "### Fits on TPU slices (`posttrain plan`, deviceless compiles)\n",
        *fits.markdown_lines(report["fits"]),
        "",
    ]


def markdown(report: dict[str, Any]) -> str:
    rows, cols = report["entries"], report["columns"]
    flipped = {(f["entry"], f["column"]) for f in report.get("changed", [])}
    out = [
        "# Tunix compatibility matrix\n",
        f"Generated {report['generated']} by `posttrain-harness matrix` on "
        f"{report['machine']}. Cells: {legend()}; {FLIP_MARK} changed since the previous "
        "report.\n",
        *summary(report),
        "\n### Grid\n",
        f"| entry | {' · '.join(VERSION_COLUMNS)} | "
        + " | ".join(str(i + 1) for i in range(len(cols)))
        + " |",
        "|---|---|" + "---|" * len(cols),
    ]
    reasons: dict[str, list[str]] = {}
    for row in rows:
        name = row["name"] + (" (emulated)" if row.get("emulated") else "")
        if row.get("error"):
            name += " 💥"
        marks = []
        for column in cols:
            c = cell(row, column)
            glyph = GLYPHS[c["status"] if c else None]
            if (row["name"], column) in flipped:
                glyph += FLIP_MARK
            marks.append(glyph)
            if c and c["status"] == "skipped":
                reasons.setdefault(c.get("message", ""), []).append(f"{row['name']} / {column}")
        out.append(f"| {name} | {compact_versions(row)} | " + " | ".join(marks) + " |")
    out.append("\nColumns: " + "; ".join(f"{i + 1} = `{c}`" for i, c in enumerate(cols)) + ".\n")
    out += fits_section(report)
    failures = report.get("first_failures", [])
    out.append("### First failing entry per contract\n")
    out += _listed(
        [
            f"- [{f['flavour']}] `{f['contract']}`: first fails in **{f['first_failing']}** "
            + (
                f"after passing in {f['after_passing']}"
                if f["after_passing"]
                else "from the first entry that ran it"
            )
            + f": {_text(f['error'])}"
            for f in failures
        ]
    ) or ["Every contract passes in every entry that ran it."]
    if reasons:
        out.append("\n### Why n/a\n")
        out += _listed(
            [
                f"- {_text(why) or 'skipped'}: {len(where)} cells ({', '.join(where[:3])}"
                + (", …" if len(where) > 3 else "")
                + ")"
                for why, where in reasons.items()
            ]
        )
    return "\n".join(out) + "\n"
