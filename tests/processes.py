"""Whether processes a test started (or had started) have ended, read from ``/proc``: a
zombie nobody reaped has ended too. Shared by the tests that kill process trees
(tests/test_launch.py's ranks, tests/test_matrix.py's commands)."""

from __future__ import annotations

import time


def alive(pid: int) -> bool:
    """``pid`` exists and is no zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def gone_within(pids: list[int], seconds: float) -> bool:
    """Whether every one of ``pids`` has ended within ``seconds``: a SIGKILL is delivered
    at once, but the exit can take a moment on a loaded machine (the gate's)."""
    deadline = time.monotonic() + seconds
    while any(alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
