"""Mesh sizes fitted to the devices a run has (8 fake CPU devices by default,
one chip on a single-TPU host).

For tests whose property does not need several devices (an equivalence, a run
that trains, a loader that refuses): they state the mesh they prefer and get the
nearest one the devices allow. A test whose property is about sharding over
several devices keeps its mesh and a ``devices(n)`` marker instead.
"""

from __future__ import annotations

import math
from collections.abc import Mapping


def fitted(
    sizes: Mapping[str, int], rest: str = "fsdp", devices: int | None = None
) -> dict[str, int]:
    """The preferred axis sizes fitted to ``devices`` (default: ``jax.device_count()``).

    Each axis other than ``rest``, in the order given, gets gcd(its preferred
    size, the devices not yet placed); ``rest`` gets the devices left (its
    preferred size, if given, is ignored).

    Guarantees: the product of the sizes equals the device count, so
    ``sharding.make_mesh`` accepts it; every non-``rest`` axis divides its
    preferred size (a shape that divides by the preferred axis divides by the
    fitted one); and where the device count is the product of the preferred
    sizes and those non-``rest`` sizes divide it in order, the result is the
    preferred sizes themselves (``{"fsdp": 4, "tensor": 2}`` at 8 devices,
    ``{"fsdp": 2, "tensor": 2}`` at 4, all 1 at 1).

    Raises:
      ValueError: a preferred size < 1, or ``devices`` < 1.
    """
    if devices is None:
        import jax  # not at import: the harness sets the device source first

        devices = jax.device_count()
    if devices < 1:
        raise ValueError(f"devices={devices} must be >= 1")
    left = devices
    out: dict[str, int] = {}
    for name, size in sizes.items():
        if int(size) < 1:
            raise ValueError(f"preferred {name}={size} must be >= 1")
        if name == rest:
            continue
        out[name] = math.gcd(int(size), left)
        left //= out[name]
    ordered = {name: out.get(name, left) for name in sizes}
    ordered.setdefault(rest, left)
    return ordered
