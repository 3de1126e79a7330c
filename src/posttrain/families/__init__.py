"""The model families: one module each, one registry that every consumer reads.

A family module (``posttrain/families/<name>.py``) holds everything that is true
of that family and of no other: its presets (full-size and ``<name>-tiny``), its
conversion table, its HF architecture and ``model_type``, the HF config defaults
the reader needs, ``from_hf`` / ``to_hf`` hooks for what really differs, and what
the reference tests need to build its tiny model in transformers
(:class:`HFOracle`). It ends with ``FAMILY = Family(...)``.

:data:`FAMILIES` (name -> :class:`Family`, in the order below) is read by the
presets (:mod:`posttrain.models.presets`), the HF config reader and writer
(:mod:`posttrain.conversion.hf_config`), the conversion engine, the PEFT export,
the CLI and the test strategies. Adding a family: README, "Adding a family".
"""

from __future__ import annotations

from collections.abc import Callable

from posttrain.config import ModelConfig
from posttrain.families import gemma4, gpt_oss, llama3, mixtral, qwen3, qwen3_moe
from posttrain.families.family import Family, FromHF, HFOracle

__all__ = [
    "FAMILIES",
    "NAMES",
    "Family",
    "FromHF",
    "HFOracle",
    "architectures",
    "by_architecture",
    "by_model_type",
    "get",
    "model_types",
    "presets",
]


def _registry() -> dict[str, Family]:
    modules = (llama3, qwen3, qwen3_moe, mixtral, gemma4, gpt_oss)
    return {m.FAMILY.name: m.FAMILY for m in modules}


FAMILIES: dict[str, Family] = _registry()
NAMES: tuple[str, ...] = tuple(FAMILIES)


def get(name: str) -> Family:
    """The family ``name``.

    Raises:
      KeyError: unknown family (the message lists the known ones).
    """
    if name not in FAMILIES:
        raise KeyError(f"unknown family {name!r}; expected one of {', '.join(NAMES)}")
    return FAMILIES[name]


def by_architecture(architecture: str) -> Family | None:
    """The family HF ``architectures[0]`` belongs to, if any."""
    for family in FAMILIES.values():
        if architecture in (family.architecture, *family.read_architectures):
            return family
    return None


def by_model_type(model_type: str) -> Family | None:
    """The family of an HF ``model_type``, if any."""
    for family in FAMILIES.values():
        if model_type in (family.model_type, *family.read_model_types):
            return family
    return None


def architectures() -> list[str]:
    """Every HF architecture read, sorted (for messages)."""
    return sorted(a for f in FAMILIES.values() for a in (f.architecture, *f.read_architectures))


def model_types() -> list[str]:
    """Every HF ``model_type`` read, sorted (for messages)."""
    return sorted(m for f in FAMILIES.values() for m in (f.model_type, *f.read_model_types))


def presets() -> dict[str, Callable[[], ModelConfig]]:
    """Every preset of every family, by name."""
    return {name: factory for f in FAMILIES.values() for name, factory in f.presets.items()}
