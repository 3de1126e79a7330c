"""``posttrain plan --run-steps N --probe-headroom``: the HBM a step really leaves free,
found by running it beside ballast.

The plan predicts a peak per device from the compiled program (arguments + temporaries +
outputs - aliased); the runtime reports ``peak_bytes_in_use + peak_bytes_reserved``. On a
lent v5e the two disagreed by 19-20% on the donated SFT step (the runtime lower: issue 54),
and neither says which is the truth about what still fits. This does: it holds ``b`` bytes
of ballast on every device, runs one more step, and bisects ``b`` (:func:`probe`) between
0 (the steps ran) and the runtime's ``bytes_limit`` until the largest ballast the step
runs beside is known within ``resolution``. That ballast is the step's real headroom, to
hold against the plan's predicted headroom (``bytes_limit`` - peak).

A step that fails for memory fails with ``RESOURCE_EXHAUSTED`` (in the ballast's
allocation or the step's); any other error is raised.
"""

from __future__ import annotations

from collections.abc import Callable

#: the bisection stops when the bracket is this narrow (64 MiB)
RESOLUTION = 64 * 2**20


def out_of_memory(error: Exception) -> bool:
    """Whether ``error`` is the runtime refusing memory (``RESOURCE_EXHAUSTED``)."""
    return "RESOURCE_EXHAUSTED" in str(error)


def probe(
    step: Callable[[], None],
    hold: Callable[[int], object],
    limit: int,
    resolution: int = RESOLUTION,
) -> int:
    """The largest ballast, in bytes per device, beside which ``step`` still runs: a
    multiple of ``resolution`` within ``resolution`` of the true one.

    Args:
      step: runs one step to its results (raises on failure).
      hold: allocates ``n`` bytes on every device and returns what holds them (dropped
        after the step: the ballast is freed).
      limit: the runtime's ``bytes_limit`` per device: ballast that large never fits
        beside a step.
      resolution: the bracket's width at which the bisection stops (bytes > 0).

    Returns:
      0 when the step runs beside no ballast only (or not even then: the caller has
      already run the steps, so it ran).

    Raises:
      ValueError: ``limit`` or ``resolution`` not positive.
      Exception: whatever ``step`` or ``hold`` raise other than running out of memory.
    """
    if limit <= 0 or resolution <= 0:
        raise ValueError(
            f"probe needs limit > 0 and resolution > 0 bytes, got {limit} and {resolution}"
        )
    fits, fails = 0, -(-limit // resolution)  # in units of resolution
    for _ in range(fails.bit_length()):  # each try halves the bracket: it ends in time
        if fails - fits <= 1:
            break
        middle = (fits + fails) // 2
        if _runs_beside(step, hold, middle * resolution):
            fits = middle
        else:
            fails = middle
    return fits * resolution


def _runs_beside(step: Callable[[], None], hold: Callable[[int], object], size: int) -> bool:
    ballast = None
    try:
        ballast = hold(size)
        step()
    except Exception as e:  # XlaRuntimeError
        if not out_of_memory(e):
            raise
        return False
    finally:
        del ballast  # freed before the next try
    return True
