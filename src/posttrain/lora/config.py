"""LoRA / QLoRA configuration: rank, scaling, target modules, base-weight quantisation.

Targets are regular expressions over Qwix module paths: the NNX attribute path
of a module joined by ``/`` (``model/layers/3/self_attn/q_proj`` unscanned,
``model/blocks/0/self_attn/q_proj`` scanned), matched with ``re.fullmatch``.
Module names follow HF, so one default serves every family.
"""

from __future__ import annotations

import dataclasses
import math
import re

ATTENTION_TARGET = r".*/self_attn/(q_proj|k_proj|v_proj|o_proj)"
"""Attention projections (all families)."""

MLP_TARGET = r".*/(mlp|shared_expert)/(gate_proj|up_proj|down_proj)"
"""Dense MLP projections, the Gemma 4 dense MLP beside the experts, and shared experts."""

EXPERTS_TARGET = r".*/experts"
"""The routed experts module (``Experts``: stacked gate/up/down projections)."""

WEIGHT_QTYPES: tuple[str, ...] = ("int8", "int4", "nf4", "float8_e4m3fn")
"""Base-weight types for QLoRA (Qwix ``weight_qtype``; ``nf4`` is NormalFloat4)."""


def default_target(experts: bool = False) -> str:
    """Attention q/k/v/o and MLP gate/up/down projections; routed experts when ``experts``."""
    parts = [ATTENTION_TARGET, MLP_TARGET] + ([EXPERTS_TARGET] if experts else [])
    return "|".join(f"(?:{p})" for p in parts)


VISION_TOWER = "vision_tower/"
"""The module path prefix of a model's vision tower (:mod:`posttrain.layers.vision`)."""


def text_only(target: str) -> str:
    """``target`` restricted to paths outside the vision tower (its layers are named like
    the text model's: ``vision_tower/layers/0/self_attn/q_proj``)."""
    return f"(?!{VISION_TOWER})(?:{target})"


def _fail(message: str) -> None:
    raise ValueError(message)


def _finite_number(value) -> bool:
    """An int or float (not a bool, a string or None) that is finite."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """Low-rank adapters ``W x + (alpha / rank) * B(A(x))`` on the target modules' weights.

    Attributes:
      rank: adapter rank r (> 0).
      alpha: scaling numerator (> 0); the adapter output is multiplied by alpha / rank.
      dropout: LoRA dropout rate in [0, 1). Only 0 is supported by
        :func:`~posttrain.lora.apply_lora` for now (see its Raises).
      target: regex over module paths (see the module docstring); ``None`` is
        :func:`default_target` (attention and MLP; routed experts with ``experts``).
      experts: with ``target=None``, also adapt the routed experts (needs
        ``MoEConfig.algorithm='dense'``, the only expert path Qwix can intercept).
      weight_qtype: QLoRA: quantise the adapted base weights to this type
        (one of :data:`WEIGHT_QTYPES`); ``None`` keeps them in ``param_dtype``.
      tile_size: QLoRA sub-channel tile along each weight's innermost contraction
        axis (int: rows per tile, which must divide that axis of every adapted
        weight, or Qwix raises "cannot be tiled"; float 1/n: n tiles); ``None`` is
        per-channel.
      seed: seed of the adapter initialisation (A: he-uniform, Qwix's default,
        uniform in +-sqrt(6 / fan_in); B: zeros, so a new adapter changes nothing).
    """

    rank: int
    alpha: float
    dropout: float = 0.0
    target: str | None = None
    experts: bool = False
    weight_qtype: str | None = None
    tile_size: int | float | None = None
    seed: int = 0

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            _fail(f"rank={self.rank!r} must be an integer > 0")
        if not _finite_number(self.alpha) or not self.alpha > 0:
            _fail(f"alpha={self.alpha!r} must be a finite number > 0")
        if not 0.0 <= self.dropout < 1.0:
            _fail(f"dropout={self.dropout!r} must be in [0, 1)")
        if self.target is not None:
            if self.experts:
                _fail(
                    f"experts=True only extends the default target; with target={self.target!r} "
                    f"add {EXPERTS_TARGET!r} to the regex instead"
                )
            try:
                re.compile(self.target)
            except re.error as e:
                _fail(f"target={self.target!r} is not a valid regex: {e}")
        if self.weight_qtype is not None and self.weight_qtype not in WEIGHT_QTYPES:
            _fail(
                f"weight_qtype={self.weight_qtype!r} must be one of {', '.join(WEIGHT_QTYPES)} "
                f"or None"
            )
        if self.tile_size is not None:
            if self.weight_qtype is None:
                _fail(f"tile_size={self.tile_size!r} needs weight_qtype (QLoRA)")
            if not _finite_number(self.tile_size) or not self.tile_size > 0:
                _fail(f"tile_size={self.tile_size!r} must be a finite number > 0")

    @property
    def target_regex(self) -> str:
        """The effective target regex (``target`` or the default)."""
        return self.target if self.target is not None else default_target(self.experts)

    def for_model(self, model_config) -> LoraConfig:
        """This config as applied to a model of ``model_config``: with a vision tower the
        default target covers the text model only (:func:`text_only`); otherwise as it is."""
        if self.target is not None or model_config.vision is None:
            return self
        return self.replace(target=text_only(self.target_regex))

    @property
    def scale(self) -> float:
        """alpha / rank, the factor on the adapter output."""
        return self.alpha / self.rank

    def replace(self, **changes) -> LoraConfig:
        """A copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)


def lora_config_of(model) -> LoraConfig:
    """The :class:`LoraConfig` that :func:`posttrain.lora.apply_lora` attached to ``model``.

    Raises:
      ValueError: ``model`` was not built by ``apply_lora`` (its ``lora_config`` is None).
    """
    config = model.lora_config
    if config is None:
        raise ValueError("model has no lora_config; build it with posttrain.lora.apply_lora")
    return config
