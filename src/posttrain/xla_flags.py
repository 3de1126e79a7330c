"""XLA flags for fake CPU devices that depend on the installed jaxlib.

XLA:CPU aborts the process when one fake device's thread reaches a collective 60 s after
another: a warning at 20 s, then rendezvous.cc's "Termination timeout ... of 40 seconds
exceeded" and SIGABRT. Reproduced with one of 8 devices 70 s late to an all-gather (with
the flag below the step completes); the README's matrix lost a GRPO run to it at load 9-10
on 2 cores (2026-12-06). Fake devices are threads of one process, so a late thread is a
busy machine, not a hang; with :data:`COLLECTIVE_TIMEOUT_SECONDS` a real hang still aborts.
The flag exists from jaxlib 0.8.0 (``strings`` of the 0.7.1, 0.7.2, 0.8.0, 0.8.1, 0.9.1,
0.10.1 and 0.10.2 wheels); XLA aborts at start on a flag it does not know.

Used by ``posttrain --devices N`` and by the harness's ``configure_devices``. Imports no JAX.
"""

from __future__ import annotations

import importlib.metadata
import re

COLLECTIVE_TIMEOUT_FLAG = "--xla_cpu_collective_call_terminate_timeout_seconds"
COLLECTIVE_TIMEOUT_SECONDS = 600
COLLECTIVE_TIMEOUT_SINCE = (0, 8)


def with_collective_timeout(xla_flags: str, jaxlib_version: str | None) -> str:
    """``xla_flags`` with :data:`COLLECTIVE_TIMEOUT_FLAG` where ``jaxlib_version`` knows it
    (added at :data:`COLLECTIVE_TIMEOUT_SECONDS` unless already named), and without it
    where it does not (an older jaxlib, or none installed: XLA would abort on the flag,
    which a child process in another environment inherits).

    Args:
      xla_flags: the ``XLA_FLAGS`` value, space-separated.
      jaxlib_version: the installed jaxlib's version (:func:`jaxlib_version`), or None.
    """
    tokens = xla_flags.split()
    named = [
        t
        for t in tokens
        if t == COLLECTIVE_TIMEOUT_FLAG or t.startswith(COLLECTIVE_TIMEOUT_FLAG + "=")
    ]
    if not _knows_collective_timeout(jaxlib_version):
        return " ".join(t for t in tokens if t not in named)
    if not named:
        tokens.append(f"{COLLECTIVE_TIMEOUT_FLAG}={COLLECTIVE_TIMEOUT_SECONDS}")
    return " ".join(tokens)


def _knows_collective_timeout(version: str | None) -> bool:
    if version is None:
        return False
    parts = re.match(r"(\d+)\.(\d+)", version)
    return parts is not None and (int(parts[1]), int(parts[2])) >= COLLECTIVE_TIMEOUT_SINCE


def jaxlib_version() -> str | None:
    """The installed jaxlib's version (its distribution metadata: JAX is not imported), or
    None without one."""
    try:
        return importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        return None
