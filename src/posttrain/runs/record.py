"""What a run directory says about itself: ``run.json`` and ``metrics.jsonl`` on resume.

``run.json`` holds the settings of the run (its options' fields,
:mod:`posttrain.runs.options`), the facts of its latest segment at the top level
(``global_batch``, ``rows``, ``convention``, ``started`` ...), and ``segments``: one
record per start or resume, each with its own settings and the step it resumed from.

A rerun into the same directory resumes only when every training-relevant setting (the
options' ``TRAINING_FIELDS``) equals the recorded one; otherwise it is refused before
anything is read or written. ``metrics.jsonl`` keeps each step once: on resume from step
k the records past k (steps the interrupted run logged but did not checkpoint) are
dropped before training replays them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import time
from typing import Any

from posttrain import atomic

RUN_FILE, METRICS_FILE = "run.json", "metrics.jsonl"


def read(out: str | os.PathLike) -> dict[str, Any] | None:
    """The ``run.json`` of run directory ``out``, or None when there is none.

    Raises:
      ValueError: it exists but is not a JSON object.
    """
    path = pathlib.Path(out) / RUN_FILE
    if not path.exists():
        return None
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: not readable JSON ({error})") from None
    if not isinstance(body, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return body


def check_resumable(cfg, out: str | os.PathLike) -> None:
    """Refuses to run ``cfg`` into ``out`` when ``out`` holds a run with other
    ``cfg.TRAINING_FIELDS``.

    Raises:
      ValueError: one line naming each training-relevant field that differs, with the
        recorded and the new value.
    """
    recorded = read(out)
    if recorded is None:
        return
    settings = recorded.get("settings", recorded)  # run.json before segments: top level
    new = dataclasses.asdict(cfg)
    differ = [
        f"{name} {settings.get(name)!r} -> {new[name]!r}"
        for name in cfg.TRAINING_FIELDS
        if _normal(settings.get(name)) != _normal(new[name])
    ]
    if differ:
        raise ValueError(
            f"{pathlib.Path(out)} holds a run with other settings ({'; '.join(differ)}); "
            "refusing to resume it: use a new --output, or the recorded settings"
        )


def _normal(value):
    """JSON round trip (tuples become lists, mesh dicts compare by content)."""
    return json.loads(json.dumps(value))


def record_segment(out: str | os.PathLike, cfg, facts: dict[str, Any], resumed_from: int) -> None:
    """Appends this start (``resumed_from`` 0) or resume to ``out``'s ``run.json``."""
    out = pathlib.Path(out)
    previous = read(out) or {}
    segment = {
        **dataclasses.asdict(cfg),
        **facts,
        "resumed_from_step": resumed_from,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    segments = [*previous.get("segments", []), segment] if resumed_from else [segment]
    body = {**segment, "settings": dataclasses.asdict(cfg), "segments": segments}
    atomic.write_text(out / RUN_FILE, json.dumps(body, indent=2) + "\n")


def begin_segment(out: str | os.PathLike, cfg, facts: dict[str, Any], resumed_from: int) -> None:
    """A start or resume of the run in ``out``: ``metrics.jsonl`` keeps the steps up to
    ``resumed_from`` (:func:`truncate_metrics`) and ``run.json`` gets the segment
    (:func:`record_segment`). Called by the writing process only."""
    truncate_metrics(out, resumed_from)
    record_segment(out, cfg, facts, resumed_from)


def truncate_metrics(out: str | os.PathLike, step: int) -> int:
    """Drops the records of ``out``'s ``metrics.jsonl`` past ``step``; returns how many."""
    path = pathlib.Path(out) / METRICS_FILE
    if not path.exists():
        return 0
    lines = path.read_text(encoding="utf-8").splitlines()
    kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
    if len(kept) != len(lines):
        atomic.write_text(path, "".join(line + "\n" for line in kept))
    return len(lines) - len(kept)
