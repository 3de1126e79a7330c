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
    """Median seconds of each of ``fns`` (:func:`first_and_medians`, the first calls left
    out)."""
    return first_and_medians(fns, repeats)[1]


def first_and_medians(
    fns: dict[str, Callable[[], object]], repeats: int
) -> tuple[dict[str, float], dict[str, float]]:
    """``(seconds of each fn's first call: its compile, median seconds of the later calls)``.

    The later calls run in ``repeats`` rounds that call every fn in turn (one of each per
    round, so a load spike on a shared machine hits all of them alike), each round in its own
    order (shuffled, seed 0), so that no fn always follows the same one (a large matmul
    leaves the caches cold for whatever runs next). Each ``fn`` must block until its result
    is ready (``jax.block_until_ready``)."""
    import random
    import statistics

    first: dict[str, float] = {}
    for name, fn in fns.items():
        start = time.perf_counter()
        fn()
        first[name] = time.perf_counter() - start
    times: dict[str, list[float]] = {name: [] for name in fns}
    names, order = list(fns), random.Random(0)
    for _ in range(repeats):
        order.shuffle(names)
        for name in names:
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
    return first, {name: statistics.median(t) for name, t in times.items()}


def fake_devices(devices: str) -> None:
    """``--devices N``: N fake CPU devices (before JAX starts); ``real``: left as it is."""
    import os

    if devices != "real":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
        )
