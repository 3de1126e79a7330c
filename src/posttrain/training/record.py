"""What a run directory says about itself: ``run.json`` and ``metrics.jsonl`` on resume.

``run.json`` holds the settings of the run (its options' fields,
:mod:`posttrain.training.options`), the facts of its latest segment at the top level
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
import statistics
import sys
import time
from collections.abc import Callable
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
    for key, kind in _SHAPE.items():
        if key in body and not isinstance(body[key], kind[0]):
            raise ValueError(
                f"{path}: {key!r} is {_json_type(body[key])}, expected {kind[1]} (a damaged "
                "run.json: restore it, or use a new --output)"
            )
    if any(not isinstance(s, dict) for s in body.get("segments", [])):
        raise ValueError(f"{path}: 'segments' holds a non-object; expected a list of objects")
    return body


#: The keys of ``run.json`` a resume reads, and the JSON type each must have.
_SHAPE = {
    "settings": (dict, "an object"),
    "segments": (list, "a list"),
    "global_batch": (int, "an integer"),
    "data_shards": ((int, type(None)), "an integer or null"),
    "devices": (int, "an integer"),
    "data_sha256": ((str, type(None)), "a string or null"),
}


def _json_type(value) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}
    return "null" if value is None else names.get(type(value), f"a {type(value).__name__}")


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
    # a setting added after the run was recorded (sft's vision, #39) had its default then
    defaults = {
        f.name: None if f.default is dataclasses.MISSING else f.default
        for f in dataclasses.fields(cfg)
    }
    was = {name: settings.get(name, defaults[name]) for name in cfg.TRAINING_FIELDS}
    differ = [
        f"{name} {was[name]!r} -> {new[name]!r}"
        for name in cfg.TRAINING_FIELDS
        if _normal(was[name]) != _normal(new[name])
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
    """Drops the records of ``out``'s ``metrics.jsonl`` past ``step``; returns how many.

    A torn last line (a kill mid-write: not a whole JSON record) is dropped too, with a
    one-line notice on stderr naming the file and the line; the steps it held are
    replayed from the checkpoint.

    Raises:
      ValueError: a line before the last is not a step record (file and line named).
    """
    path = pathlib.Path(out) / METRICS_FILE
    if not path.exists():
        return 0
    lines = path.read_bytes().decode("utf-8", errors="replace").splitlines()
    records = [_metrics_record(line) for line in lines]
    if lines and records[-1] is None and lines[-1].strip():
        print(
            f"posttrain: notice: {path}, line {len(lines)}: a torn record (a kill "
            f"mid-write?); removed it ({len(lines[-1].encode())} bytes)",
            file=sys.stderr,
        )
        records[-1] = _TORN
    bad = next((i for i, r in enumerate(records) if r is None and lines[i].strip()), None)
    if bad is not None:
        raise ValueError(
            f"{path}, line {bad + 1}: not a step record ({lines[bad][:40]!r}); expected "
            'one JSON object with an integer "step" per line'
        )
    kept = [line for line, r in zip(lines, records, strict=True) if r and r["step"] <= step]
    if len(kept) != len(lines):
        atomic.write_text(path, "".join(line + "\n" for line in kept))
    return len(lines) - len(kept)


_TORN: dict = {}  # a torn last line: dropped


def _metrics_record(line: str) -> dict | None:
    """The step record of one ``metrics.jsonl`` line; None when it is not one."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return None
    ok = isinstance(record, dict) and isinstance(record.get("step"), int)
    return record if ok else None


def steps_line(history: list[dict], at_step: int, details: Callable[[dict], str]) -> str:
    """``steps a-b: loss x -> y<details>, N tokens/s`` over the history's training records
    (those with a loss; the median speed), ``details`` of the last; or ``no steps run
    (already at step k)`` when a resume found nothing left to do."""
    h = [r for r in history if r.get("loss") is not None]
    if not h:
        return f"no steps run (already at step {at_step})"
    speeds = [r["tokens_per_s"] for r in h if r.get("tokens_per_s")]
    speed = f", {statistics.median(speeds):,.0f} tokens/s" if speeds else ""
    first, last = h[0], h[-1]
    return (
        f"steps {first['step']}-{last['step']}: loss {first['loss']:.3f} -> {last['loss']:.3f}"
        f"{details(last)}{speed}"
    )
