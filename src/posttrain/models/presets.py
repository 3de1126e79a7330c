"""The presets of every family (:mod:`posttrain.families`): each is a ``ModelConfig``,
never a new model class.

Every family has a CPU-sized ``<family>-tiny`` preset used by tests and the CLI, and
most a full-size one (real dimensions, for conversion and accelerators). Tiny
dimensions are distinct from each other (d_model 72, d_ff 88, num_heads * head_dim
80, moe_d_ff 56, vocab 264) so a missing transpose is a shape error, not a silent
scramble; dimensions that mesh axes shard are multiples of 8 (so every 8-device
factorisation the heads allow is usable), heads, kv heads and experts divide by 2 and 4.
"""

from __future__ import annotations

from collections.abc import Callable

from posttrain import families
from posttrain.config import ModelConfig

PRESETS: dict[str, Callable[[], ModelConfig]] = families.presets()
FAMILIES: tuple[str, ...] = families.NAMES
TINY_PRESETS: tuple[str, ...] = tuple(f.tiny for f in families.FAMILIES.values())


def get_config(name: str, **overrides) -> ModelConfig:
    """The preset ``name`` with ``overrides`` applied (e.g. ``scan_layers=True``).

    Raises:
      ValueError: unknown preset (the message lists the known ones) or an
        override the config rejects.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; expected one of {sorted(PRESETS)}")
    cfg = PRESETS[name]()
    return cfg.replace(**overrides) if overrides else cfg
