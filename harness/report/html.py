"""The matrix report as one self-contained HTML page: no script, no network, no framework.

Layout, top to bottom:

- a summary: totals per status, what broke, the first failing entry per contract,
  upstream deprecations (each with the first entry showing it), the cells changed
  since the previous report, newer upstream releases, and where source rows came from;
- the grid: a row per entry (name, then the compact versions ``tunix · jax · flax ·
  qwix · optax``, every version on hover), a column per contract (short vertical
  label, the full name on hover), one coloured glyph per cell (:data:`GLYPHS`). The
  header row and the first column stay in view while the grid scrolls. A cell that is
  not a plain pass is a ``<details>``: a click opens its first error line and test id,
  its deprecations, or why it is n/a. A cell changed since the previous report has
  the ``flip`` outline.

Every cell carries ``data-status`` (the JSON status, ``none``: not run) and
``data-column`` (the full column name), for tests and scripts.
"""

from __future__ import annotations

import html
import re
from typing import Any

from harness.report import drift as _drift
from harness.report import fits
from harness.report.report import (
    LABELS,
    VERSION_COLUMNS,
    cell,
    compact_versions,
    full_versions,
    not_run_lines,
    short_label,
    source_line,
    totals,
)

GLYPHS = {
    "passed": "✓",
    "warned": "!",
    "skipped": "–",
    "failed": "✗",
    "error": "‼",
    None: "·",
}
"""Cell status (None: not run) -> its glyph."""
COLOURS = {
    "passed": ("#1a7f37", "#dafbe1"),
    "warned": ("#7d4e00", "#fff1a8"),
    "skipped": ("#57606a", "#eaeef2"),
    "failed": ("#ffffff", "#cf222e"),
    "error": ("#ffffff", "#82071e"),
    None: ("#8c959f", "#ffffff"),
}
"""Cell status -> (glyph colour, background)."""
FLIP_OUTLINE = "#0969da"

esc = html.escape


def _css() -> str:
    statuses = "".join(
        f".s-{_cls(s)}{{color:{fg};background:{bg}}}" for s, (fg, bg) in COLOURS.items()
    )
    return (
        "body{font:13px/1.45 system-ui,-apple-system,'Segoe UI',sans-serif;margin:16px;"
        "color:#1f2328}h1{font-size:20px;margin:0 0 4px}h2{font-size:14px;margin:0 0 6px}"
        "p.meta{color:#57606a;margin:0 0 12px}code{font:12px ui-monospace,monospace;"
        "overflow-wrap:anywhere}"
        ".totals span{display:inline-block;margin-right:10px}"
        ".glyph{display:inline-block;width:18px;text-align:center;border-radius:3px;"
        "font-weight:700}"
        ".summary{display:grid;grid-template-columns:repeat(auto-fit,minmax(340px,1fr));"
        "gap:10px;margin:12px 0;align-items:start}.card{border:1px solid #d0d7de;"
        "border-radius:6px;padding:8px 12px}.card ul{margin:0;padding-left:18px;"
        "max-height:190px;overflow:auto}.card li{margin:2px 0}"
        ".card.bad{border-color:#cf222e}.card.warn{border-color:#d4a72c}"
        ".wrap{overflow:auto;max-height:85vh;border:1px solid #d0d7de;border-radius:6px}"
        "table.grid{border-collapse:separate;border-spacing:0}"
        ".grid th,.grid td{border-right:1px solid #eaeef2;border-bottom:1px solid #eaeef2;"
        "padding:0;text-align:center}"
        ".grid thead th{position:sticky;top:0;z-index:2;background:#f6f8fa;"
        "vertical-align:bottom}"
        ".grid thead th.col div{writing-mode:vertical-rl;transform:rotate(180deg);"
        "white-space:nowrap;padding:6px 3px;font-weight:500}"
        ".grid thead th.corner{left:0;z-index:3;text-align:left;padding:4px 8px}"
        ".grid tbody th{position:sticky;left:0;z-index:1;background:#fff;text-align:left;"
        "white-space:nowrap;padding:2px 8px;font-weight:600}"
        ".grid td.ver{white-space:nowrap;padding:2px 8px;font:11px ui-monospace,monospace;"
        "color:#57606a}.grid td.c{min-width:22px;height:22px;font-weight:700}"
        ".grid tr.rowerr th{color:#82071e}.tag{font-weight:400;color:#57606a;font-size:11px}"
        f"td.flip{{outline:2px solid {FLIP_OUTLINE};outline-offset:-2px}}"
        "details{position:relative}summary{list-style:none;cursor:pointer}"
        "summary::-webkit-details-marker{display:none}"
        ".pop{position:absolute;z-index:5;left:0;top:100%;width:440px;background:#fff;"
        "color:#1f2328;font-weight:400;border:1px solid #d0d7de;border-radius:6px;"
        "box-shadow:0 8px 24px rgba(140,149,159,.3);padding:6px 8px;text-align:left;"
        "white-space:normal}" + statuses
    )


def _cls(status: str | None) -> str:
    return status or "none"


def _glyph(status: str | None) -> str:
    return f'<span class="glyph s-{_cls(status)}">{GLYPHS[status]}</span>'


def _cell(row: dict[str, Any], column: str, flipped: dict[tuple[str, str], str]) -> str:
    c = cell(row, column)
    status = c["status"] if c else None
    label = LABELS[status]
    classes = f"c s-{_cls(status)}" + (" flip" if (row["name"], column) in flipped else "")
    was = flipped.get((row["name"], column))
    title = f"{row['name']} / {column}: {label}" + (f" (was {LABELS.get(was, was)})" if was else "")
    attrs = (
        f'class="{classes}" data-status="{_cls(status)}" data-column="{esc(column)}" '
        f'title="{esc(title)}"'
    )
    if status is None or (status == "passed" and not was):
        return f"<td {attrs}>{GLYPHS[status]}</td>"
    lines = [f"<b>{esc(row['name'])}</b> / <code>{esc(column)}</code>: <b>{label}</b>"]
    if was:
        lines.append(f"changed: was {esc(LABELS.get(was, was))}")
    if c.get("test"):
        lines.append(f"test: <code>{esc(c['test'])}</code>")
    if status in ("failed", "error", "skipped") and c.get("message"):
        lines.append(esc(c["message"]))
    for text in c.get("warnings", []):
        lines.append(f"deprecation: {esc(text)}")
    pop = "<br>".join(lines)
    return (
        f"<td {attrs}><details><summary>{GLYPHS[status]}</summary>"
        f'<div class="pop">{pop}</div></details></td>'
    )


def _card(title: str, items: list[str], kind: str = "", empty: str = "None.") -> str:
    body = "<ul>" + "".join(f"<li>{i}</li>" for i in items) + "</ul>" if items else esc(empty)
    return f'<section class="card {kind}"><h2>{esc(title)}</h2>{body}</section>'


def summary(report: dict[str, Any]) -> str:
    counts = totals(report)
    total = (
        '<p class="totals">'
        + "".join(f"<span>{_glyph(s)} {n} {esc(LABELS[s])}</span>" for s, n in counts.items())
        + "</p>"
    )
    broken = [
        f"{_glyph(b['status'])} <b>{esc(b['entry'])}</b>"
        + (f" / <code>{esc(b['column'])}</code>" if b["column"] else "")
        + f": {esc(b['message'])}"
        + (f" <code>{esc(b['test'])}</code>" if b.get("test") else "")
        for b in report.get("broken", [])
    ]
    first = [
        f"[{esc(f['flavour'])}] <code>{esc(f['contract'])}</code>: <b>{esc(f['first_failing'])}"
        f"</b>" + (f" (passed in {esc(f['after_passing'])})" if f["after_passing"] else "")
        for f in report.get("first_failures", [])
    ]
    found = [
        f"{esc(d['warning'])} <code>{esc(d['where'])}</code>: first in "
        f"<b>{esc(d['first_entry'])}</b>, {len(d['entries'])} entries"
        for d in report.get("deprecations", [])
    ]
    previous = report.get("previous")
    flips = [
        f"<b>{esc(f['entry'])}</b> / <code>{esc(f['column'])}</code>: "
        f"{esc(LABELS.get(f['from'], f['from']))} → {esc(LABELS.get(f['to'], f['to']))}"
        for f in report.get("changed", [])
    ]
    since = f" ({previous['generated']})" if previous else ""
    cards = [
        _card(
            "What broke", broken, "bad" if broken else "", "Nothing: every cell that ran passes."
        ),
        _card("First failing entry per contract", first, empty="No contract fails anywhere."),
        _card("Upstream deprecations", found, "warn" if found else "", "None seen."),
        _card(
            f"Changed since the previous report{since}",
            flips,
            empty="No cell changed." if previous else "No previous report to compare with.",
        ),
        _card("Upstream releases", [esc(line) for line in _drift.lines(report.get("drift"))]),
    ]
    left = not_run_lines(report)
    if left:
        not_run = [re.sub(r"`([^`]+)`", r"<code>\1</code>", esc(x)) for x in left]
        cards.insert(0, _card("Not run in this report", not_run))
    cards += _optional_cards(report)
    return total + '<div class="summary">' + "".join(cards) + "</div>"


def _optional_cards(report: dict[str, Any]) -> list[str]:
    """The summary's cards shown only when the report has them: the source rows, the
    plans' fits, the suggested (and run) bisects."""
    cards = []
    sources = [
        f"<b>{esc(r['name'])}</b>: {esc(source_line(r))}"
        for r in report["entries"]
        if r.get("source")
    ]
    if sources:
        cards.append(_card("Tunix from source", sources))
    if report.get("fits") is not None:
        lines = fits.markdown_lines(report["fits"])[2:]  # the rows, without the header
        items = [" · ".join(esc(c.strip()) for c in line.strip("|").split("|")) for line in lines]
        cards.append(_card("Fits on TPU slices (posttrain plan)", items))
    suggested = report.get("bisect") or []
    if suggested:
        commands = [
            f"<b>{esc(b['entry'])}</b> / <code>{esc(b['column'])}</code>: "
            f"<code>{esc(b['command'])}</code>"
            + (
                f" → first bad: <code>{esc(b['named']['sha'][:12])}</code> "
                f"{esc(b['named']['subject'])}"
                if b.get("named")
                else ""
            )
            + (f" → not named: {esc(b['why'])}" if b.get("why") else "")
            for b in suggested
        ]
        cards.append(_card("Bisect: the commit behind a source row's cell", commands))
    return cards


def grid(report: dict[str, Any]) -> str:
    rows, cols = report["entries"], report["columns"]
    flipped = {(f["entry"], f["column"]): f["from"] for f in report.get("changed", [])}
    head = "".join(
        f'<th class="col" title="{esc(c)}"><div>{esc(short_label(c))}</div></th>' for c in cols
    )
    body = []
    for row in rows:
        tags = []
        if row.get("emulated"):
            tags.append("emulated")
        if row.get("source"):
            tags.append("source")
        tag = f' <span class="tag">{" ".join(tags)}</span>' if tags else ""
        name_title = f"{row['name']}: convention {row['convention']}, flavour {row['flavour']}"
        if row.get("error"):
            name_title += f"; not run: {row['error']}"
        if row.get("source"):
            name_title += f"; {source_line(row)}"
        cells = "".join(_cell(row, c, flipped) for c in cols)
        body.append(
            f'<tr class="{"rowerr" if row.get("error") else ""}" data-entry="{esc(row["name"])}">'
            f'<th title="{esc(name_title)}">{esc(row["name"])}{tag}</th>'
            f'<td class="ver" title="{esc(full_versions(row))}">{esc(compact_versions(row))}</td>'
            f"{cells}</tr>"
        )
    return (
        '<div class="wrap"><table class="grid"><thead><tr>'
        f'<th class="corner">entry</th><th>{esc(" · ".join(VERSION_COLUMNS))}</th>{head}</tr>'
        f"</thead><tbody>{''.join(body)}</tbody></table></div>"
    )


def page(report: dict[str, Any]) -> str:
    """The whole page (UTF-8 text)."""
    legend = " ".join(f"{_glyph(s)} {esc(label)}" for s, label in LABELS.items())
    return (
        "<!doctype html>\n<html lang=en><head><meta charset=utf-8>"
        "<meta name=viewport content='width=device-width,initial-scale=1'>"
        f"<title>Tunix compatibility matrix</title><style>{_css()}</style></head><body>"
        "<h1>Tunix compatibility matrix</h1>"
        f'<p class="meta">Generated {esc(report["generated"])} by <code>posttrain-harness '
        f"matrix</code> on {esc(report['machine'])}. Cells: {legend}; outlined: changed since "
        "the previous report. Click a cell for its error, deprecations or reason.</p>"
        f"{summary(report)}{grid(report)}</body></html>\n"
    )
