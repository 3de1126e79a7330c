"""The report's three files, ``compat-matrix.md``, ``.json`` and ``.html`` (:func:`write`):
the renderings of :mod:`harness.report.markdown` and :mod:`harness.report.html`
beside the JSON, each written atomically with no credentials of a source URL.

Apart from :mod:`harness.report.report` so that the renderings, which read its helpers,
and the report it builds import one way only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from harness.matrix import sources
from harness.report import html, markdown
from harness.report.report import REPORT_NAME
from posttrain import atomic


def write(report: dict[str, Any], report_dir: Path) -> list[Path]:
    """Writes the three files atomically; returns their paths."""
    report_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for suffix, text in (
        ("md", markdown.markdown(report)),
        ("json", json.dumps(report, indent=2) + "\n"),
        ("html", html.page(report)),
    ):
        path = report_dir / f"{REPORT_NAME}.{suffix}"
        atomic.write_text(path, sources.redact(text))  # no credentials of a source URL
        paths.append(path)
    return paths
