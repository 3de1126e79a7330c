"""Hypothesis strategies shared by the tests. Each docstring states what it guarantees."""

from __future__ import annotations

import itertools
import math

from hypothesis import strategies as st

from posttrain import sharding
from posttrain.config import ModelConfig


def factorisations(devices: int, axes: tuple[str, ...]) -> list[dict[str, int]]:
    """Every assignment of sizes to ``axes`` whose product is ``devices`` (sizes >= 1)."""
    divisors = [d for d in range(1, devices + 1) if devices % d == 0]
    out = []
    for sizes in itertools.product(divisors, repeat=len(axes)):
        if math.prod(sizes) == devices:
            out.append({a: s for a, s in zip(axes, sizes, strict=True) if s > 1})
    return out


def usable(cfg: ModelConfig, mesh_shape: dict[str, int]) -> bool:
    """Whether ``cfg.check_mesh`` accepts ``mesh_shape``."""
    try:
        cfg.check_mesh(mesh_shape)
    except ValueError:
        return False
    return True


def meshes(
    cfg: ModelConfig,
    devices: int = 8,
    axes: tuple[str, ...] = ("data", "fsdp", "expert", "tensor"),
) -> st.SearchStrategy[dict[str, int]]:
    """Mesh shapes over exactly ``devices`` devices on ``axes`` that ``cfg`` can use.

    Drawn from the full list of factorisations, so shrinking goes towards the
    first (fewest sharded axes, data-heavy) mesh.
    """
    shapes = [m for m in factorisations(devices, axes) if usable(cfg, m)]
    shapes.sort(key=lambda m: (len(m), sorted(m.items())))
    return st.sampled_from(shapes)


def mesh_id(mesh_shape: dict[str, int]) -> str:
    """Readable id: ``fsdp4-tensor2`` (``single`` when every axis is 1)."""
    return "-".join(f"{a}{s}" for a, s in mesh_shape.items() if s > 1) or "single"


ALL_AXES = sharding.MESH_AXES
