"""Timing helpers shared by the benchmark scripts (run as ``python benchmarks/X.py``, so
this folder is on ``sys.path``)."""

from __future__ import annotations

import time
from collections.abc import Callable


def best_time(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` calls of ``fn``, in seconds (``time.perf_counter``)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def interleaved_medians(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each of ``fns`` over ``repeats`` rounds that call them in turn
    (one of each per round, so a load spike on a shared machine hits all of them alike);
    each is called once first, uncounted (its compile). Each ``fn`` must block until its
    result is ready (``jax.block_until_ready``)."""
    import statistics

    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}
