"""The :class:`Table` type and the rows several families share.

Native paths are those of :class:`posttrain.models.CausalLM` (unscanned,
``model.layers.{i}...``); HF keys are those of ``<Family>ForCausalLM`` in
transformers 5.12 - 5.24 (hf-reference.md sections 4-9).
"""

from __future__ import annotations

import dataclasses

from posttrain.hf_schema.rows import (
    ATTN_BIAS,
    DENSE_MLP,
    MLP_BIAS,
    QK_NORM,
    SINKS,
    UNTIED,
    V_PROJ,
    Row,
)
from posttrain.hf_schema.transforms import HEAD_BIAS, HEADS_IN, HEADS_OUT, IDENTITY, TRANSPOSE

L = "model.layers.{i}."


@dataclasses.dataclass(frozen=True)
class Table:
    """A family's conversion table (its family: :class:`posttrain.families.Family`).

    Attributes:
      rows: the rows; every native parameter and every HF tensor is in exactly one.
      layouts: on-disk layouts (``hub``: what ``save_pretrained`` writes by default and
        hub checkpoints use; ``fused``: ``save_original_format=False``, HF's in-memory
        layout). Rows without a layout condition belong to both; the first is written
        by default.
      prefixes: HF key prefixes accepted on read, mapped to the canonical ``model.``
        (Gemma 4's multimodal checkpoints keep the text model under ``model.language_model.``).
      ignored: key prefixes (after the prefix mapping) skipped on read, e.g. the
        vision and audio towers of a multimodal checkpoint.
    """

    rows: tuple[Row, ...]
    layouts: tuple[str, ...] = ("hub", "fused")
    prefixes: tuple[str, ...] = ("model.",)
    ignored: tuple[str, ...] = ()


GLOBAL_ROWS = (
    Row("model.embed_tokens.embedding", "model.embed_tokens.weight", IDENTITY),
    Row("model.norm.scale", "model.norm.weight", IDENTITY),
    Row("lm_head.kernel", "lm_head.weight", TRANSPOSE, UNTIED),
)

ATTENTION_ROWS = (
    Row(L + "input_layernorm.scale", L + "input_layernorm.weight", IDENTITY),
    Row(L + "post_attention_layernorm.scale", L + "post_attention_layernorm.weight", IDENTITY),
    Row(L + "self_attn.q_proj.kernel", L + "self_attn.q_proj.weight", HEADS_IN),
    Row(L + "self_attn.k_proj.kernel", L + "self_attn.k_proj.weight", HEADS_IN),
    Row(L + "self_attn.v_proj.kernel", L + "self_attn.v_proj.weight", HEADS_IN, V_PROJ),
    Row(L + "self_attn.o_proj.kernel", L + "self_attn.o_proj.weight", HEADS_OUT),
    Row(L + "self_attn.q_proj.bias", L + "self_attn.q_proj.bias", HEAD_BIAS, ATTN_BIAS),
    Row(L + "self_attn.k_proj.bias", L + "self_attn.k_proj.bias", HEAD_BIAS, ATTN_BIAS),
    Row(L + "self_attn.v_proj.bias", L + "self_attn.v_proj.bias", HEAD_BIAS, ATTN_BIAS & V_PROJ),
    Row(L + "self_attn.o_proj.bias", L + "self_attn.o_proj.bias", IDENTITY, ATTN_BIAS),
    Row(L + "self_attn.q_norm.scale", L + "self_attn.q_norm.weight", IDENTITY, QK_NORM),
    Row(L + "self_attn.k_norm.scale", L + "self_attn.k_norm.weight", IDENTITY, QK_NORM),
    Row(L + "self_attn.sinks", L + "self_attn.sinks", IDENTITY, SINKS),
)

DENSE_MLP_ROWS = (
    Row(L + "mlp.gate_proj.kernel", L + "mlp.gate_proj.weight", TRANSPOSE, DENSE_MLP),
    Row(L + "mlp.up_proj.kernel", L + "mlp.up_proj.weight", TRANSPOSE, DENSE_MLP),
    Row(L + "mlp.down_proj.kernel", L + "mlp.down_proj.weight", TRANSPOSE, DENSE_MLP),
    Row(L + "mlp.gate_proj.bias", L + "mlp.gate_proj.bias", IDENTITY, MLP_BIAS),
    Row(L + "mlp.up_proj.bias", L + "mlp.up_proj.bias", IDENTITY, MLP_BIAS),
    Row(L + "mlp.down_proj.bias", L + "mlp.down_proj.bias", IDENTITY, MLP_BIAS),
)
