"""A model family's record (:class:`Family`) and what the reference tests need of it
(:class:`HFOracle`): the types every family module fills in and the registry
(:mod:`posttrain.families`) lists. Apart from the registry so that a family module
imports them without importing the registry that imports it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Literal

from posttrain.config import ModelConfig, VisionConfig
from posttrain.hf_schema.table import Table

FromHF = Callable[[Mapping[str, Any], dict[str, Any], dict[str, Any], "int | None"], ModelConfig]
"""``(text config, base fields, attention fields, max_position_embeddings) -> ModelConfig``:
``base`` holds the ``ModelConfig`` fields every family reads alike (family, vocab_size,
d_model, num_layers, norm_eps, tie_word_embeddings, dtype, param_dtype), ``attention``
the ``AttentionConfig`` ones (num_heads, num_kv_heads, head_dim, bias)."""


@dataclasses.dataclass(frozen=True)
class HFOracle:
    """What the reference tests need to build the family's tiny model in transformers.

    Attributes:
      config_class, model_class: ``transformers`` class names (``LlamaConfig``,
        ``LlamaForCausalLM``).
      tiny_config: constructor keywords of the tiny config beyond the dimensions all
        families share (``tests/hf_tiny.py``): the family's RoPE, norm eps, experts ...
      layer_pattern: which ``layer_types`` HF accepts: ``full`` (every layer full),
        ``alternating`` (sliding, full, sliding ...) or ``ends_full`` (any mix whose
        last layer is full).
    """

    config_class: str
    model_class: str
    tiny_config: Mapping[str, Any]
    layer_pattern: Literal["full", "alternating", "ends_full"] = "full"


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family.

    Attributes:
      name: ``ModelConfig.family``; preset names start with it.
      presets: preset name -> config factory; one of them is ``<name>-tiny``.
      table: the HF <-> native conversion table.
      architecture, model_type: HF ``architectures[0]`` and ``model_type`` written.
      from_hf: :data:`FromHF`, the family's part of reading ``config.json``.
      to_hf: ``ModelConfig -> dict``, the family's ``config.json`` fields beyond the
        ones every family writes (they override those).
      default_norm_eps, default_tied, default_attention_bias: the HF config class's
        defaults of ``rms_norm_eps``, ``tie_word_embeddings`` and ``attention_bias``.
      writes_layer_types: whether ``config.json`` gets ``layer_types``.
      read_architectures, read_model_types: further HF names read as this family
        (a multimodal wrapper of the text model).
      wrap_hf: ``(cfg, text config) -> config.json`` of the multimodal wrapper, for
        writing under a wrapper's key prefix; ``None`` when the family has none.
      oracle: see :class:`HFOracle`.
      vision_from_hf: ``config.json -> VisionConfig | None``, the wrapper's vision tower
        (``None`` when it has none); ``None`` for a family without one.
    """

    name: str
    presets: Mapping[str, Callable[[], ModelConfig]]
    table: Table
    architecture: str
    model_type: str
    from_hf: FromHF
    to_hf: Callable[[ModelConfig], dict[str, Any]]
    default_norm_eps: float
    oracle: HFOracle
    default_tied: bool = False
    default_attention_bias: bool = False
    writes_layer_types: bool = False
    read_architectures: tuple[str, ...] = ()
    read_model_types: tuple[str, ...] = ()
    wrap_hf: Callable[[ModelConfig, dict[str, Any]], dict[str, Any]] | None = None
    vision_from_hf: Callable[[Mapping[str, Any]], VisionConfig | None] | None = None

    @property
    def tiny(self) -> str:
        """The name of the CPU-sized preset the tests and the CLI default to."""
        return f"{self.name}-tiny"

    @property
    def layouts(self) -> tuple[str, ...]:
        """Every HF on-disk layout: the table's, plus ``multimodal`` with a wrapper."""
        return self.table.layouts + (("multimodal",) if self.wrap_hf else ())
