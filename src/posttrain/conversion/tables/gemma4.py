"""Gemma 4 text (HF ``Gemma4ForCausalLM``; MoE with ``enable_moe_block``).

Sandwich norms, a per-layer ``layer_scalar`` (a persistent buffer, stored), a
dense MLP in every layer and, with MoE, ``router.{proj.weight, scale,
per_expert_scale}`` and ``experts.{gate_up_proj [E, 2F, D], down_proj [E, D, F]}``
directly under the layer (native: under ``moe.``). Full layers with
``attention_k_eq_v`` have no ``v_proj`` (``V_PROJ``). transformers has no
conversion mapping for Gemma 4, so the hub and fused layouts are the same.
Real checkpoints are ``Gemma4ForConditionalGeneration``: the text weights sit
under ``model.language_model.``, beside vision and audio towers that are skipped.
"""

from posttrain.conversion.rows import DENSE_AND_MOE, LAYER_SCALAR, MOE, SANDWICH, Row
from posttrain.conversion.tables.common import (
    ATTENTION_ROWS,
    DENSE_MLP_ROWS,
    GLOBAL_ROWS,
    L,
    Table,
)
from posttrain.conversion.transforms import EXPERTS_T, GATE_UP_CONCAT_T, IDENTITY, TRANSPOSE


def _norm(name, when=SANDWICH):
    return Row(L + name + ".scale", L + name + ".weight", IDENTITY, when)


M = L + "moe."
LAYER_ROWS = (
    _norm("pre_feedforward_layernorm"),
    _norm("post_feedforward_layernorm"),
    _norm("post_feedforward_layernorm_1", DENSE_AND_MOE),
    _norm("pre_feedforward_layernorm_2", DENSE_AND_MOE),
    _norm("post_feedforward_layernorm_2", DENSE_AND_MOE),
    Row(L + "layer_scalar", L + "layer_scalar", IDENTITY, LAYER_SCALAR),
    Row(M + "router.kernel", L + "router.proj.weight", TRANSPOSE, MOE),
    Row(M + "router.scale", L + "router.scale", IDENTITY, MOE),
    Row(M + "router.per_expert_scale", L + "router.per_expert_scale", IDENTITY, MOE),
    Row(
        (M + "experts.gate_proj", M + "experts.up_proj"),
        L + "experts.gate_up_proj",
        GATE_UP_CONCAT_T,
        MOE,
    ),
    Row(M + "experts.down_proj", L + "experts.down_proj", EXPERTS_T, MOE),
)

TABLE = Table(
    "gemma4",
    GLOBAL_ROWS + ATTENTION_ROWS + DENSE_MLP_ROWS + LAYER_ROWS,
    "Gemma4ForCausalLM",
    prefixes=("model.", "model.language_model."),
    ignored=(
        "model.vision_tower.",
        "model.audio_tower.",
        "model.embed_vision.",
        "model.embed_audio.",
    ),
)
