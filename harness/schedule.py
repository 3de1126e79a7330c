"""Test order for the gate's xdist workers: the last run's long tests first.

pytest-xdist's ``worksteal`` gives each worker a contiguous block of the collected
tests and lets an idle worker take the tail of a busy worker's queue. A long test
near the end of a queue (an SFT run with checkpoints: 6-20 s on 2 cores) then runs
while the other worker has nothing left: ~6 s of one idle core at the end of a
~120 s gate. With the tests that took at least :data:`LONG_TEST_S` in the last run
moved to the front (longest first) and every other test in collection order, the
queues end in short tests and the workers finish within about a second of each other.

The durations live in a JSON file (``{node id: seconds}``; setup + call + teardown)
beside the gate's JAX compilation cache, so a fresh clone reuses the user's (or the
CI cache's) last run; each run merges its own durations in. Without the file, or
with a test it does not know, the order is pytest's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

#: A test that took at least this long (seconds) last time is scheduled first.
LONG_TEST_S = 2.0


def long_first(
    node_ids: Sequence[str], durations: Mapping[str, float], threshold: float = LONG_TEST_S
) -> list[int]:
    """Indices into ``node_ids``: those whose last duration is at least ``threshold``
    seconds, longest first (ties in collection order), then all others in collection
    order."""
    long = [i for i, node in enumerate(node_ids) if durations.get(node, 0.0) >= threshold]
    long.sort(key=lambda i: -durations[node_ids[i]])  # stable: ties keep their order
    chosen = set(long)
    return long + [i for i in range(len(node_ids)) if i not in chosen]


def read_durations(path: str | os.PathLike) -> dict[str, float]:
    """``{node id: seconds}`` from ``path``; empty when it is missing or unreadable (the
    order then stays pytest's: a broken file must not fail the gate)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {
        str(node): float(seconds)
        for node, seconds in data.items()
        if isinstance(seconds, (int, float)) and not isinstance(seconds, bool)
    }


def merge_durations(path: str | os.PathLike, measured: Mapping[str, float]) -> None:
    """Writes ``path``'s durations updated with ``measured`` (through a temporary file,
    so a concurrent reader sees the old file or the new one)."""
    from harness.cli import write_atomic

    merged = {**read_durations(path), **{n: round(s, 3) for n, s in measured.items()}}
    write_atomic(Path(path), json.dumps(merged, indent=1, sort_keys=True) + "\n")
