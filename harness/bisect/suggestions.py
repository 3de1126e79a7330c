"""The bisects a matrix report suggests: for each source row's failing or warning cell
that the newest release passes cleanly, the ``posttrain-harness bisect`` command that
names the upstream commit (:func:`suggestions`; :mod:`harness.bisect.bisect` runs them)."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import Any

from packaging.version import InvalidVersion, Version

from harness.report.report import RUN_CELLS
from harness.report.report import cell as report_cell
from harness.report.report import columns as report_columns


def suggestions(rows: Sequence[dict[str, Any]]) -> list[dict[str, str]]:
    """For each FAIL or warn cell of a source row whose column the newest release row
    passes cleanly (no deprecation): the ``bisect`` command that names the commit.
    ``{"entry", "column", "status", "command"}`` each; the report's summary lists them."""

    def version(row: dict[str, Any]) -> Version:
        try:
            return Version(row["tunix"])
        except InvalidVersion:
            return Version("0")

    releases = [
        r
        for r in rows
        if r["flavour"] == "current" and not r.get("emulated") and not r.get("source")
    ]
    if not releases:
        return []
    newest = max(releases, key=version)
    found = []
    for row in rows:
        source = row.get("source") or {}
        if not source.get("resolved"):
            continue
        for column in report_columns([row]):
            here, there = report_cell(row, column), report_cell(newest, column)
            if not here or here["status"] not in ("failed", "error", "warned"):
                continue
            if not there or there["status"] != "passed" or there.get("warnings"):
                continue
            target = column if column in RUN_CELLS else here.get("test") or column
            command = [
                "posttrain-harness",
                "bisect",
                "--source",
                source["spec"],
                "--good",
                f"v{newest['tunix']}",
                "--bad",
                source["resolved"],
                "--contract",
                target,
            ]
            if here["status"] == "warned":
                command += ["--verdict", "warn"]
            found.append(
                {
                    "entry": row["name"],
                    "column": column,
                    "status": here["status"],
                    "command": shlex.join(command),
                    "source": source["spec"],
                    "good": f"v{newest['tunix']}",
                    "bad": source["resolved"],
                    "contract": target,
                    "verdict": "warn" if here["status"] == "warned" else "fail",
                }
            )
    return found
