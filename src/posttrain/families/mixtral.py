"""Mixtral (HF ``MixtralForCausalLM``): Llama attention, softmax router, top-k always
renormalised, every layer MoE; with ``sliding_window`` every layer slides.

Conversion: hub layout ``block_sparse_moe.gate.weight`` router and per-expert
``block_sparse_moe.experts.{j}.w1`` (gate), ``w3`` (up), ``w2`` (down). Fused layout
(``save_original_format=False``): ``mlp.gate.weight``, ``mlp.experts.gate_up_proj``
``[E, 2F, D]`` (w1 rows then w3 rows), ``mlp.experts.down_proj`` ``[E, D, F]``.
Reference: transformers ``conversion_mapping.py`` "mixtral".
"""

from __future__ import annotations

from posttrain.config import AttentionConfig, ModelConfig, MoEConfig, RopeConfig
from posttrain.families.family import Family, HFOracle
from posttrain.hf_schema import hf_fields
from posttrain.hf_schema.rows import FUSED, HUB, Row
from posttrain.hf_schema.table import ATTENTION_ROWS, GLOBAL_ROWS, L, Table
from posttrain.hf_schema.transforms import (
    EXPERTS_STACK_T,
    EXPERTS_T,
    GATE_UP_CONCAT_T,
    TRANSPOSE,
)

DEFAULT_ROPE_THETA = 1_000_000.0  # MixtralConfig
DEFAULT_AUX_LOSS_COEF = 0.001


def mixtral_8x7b() -> ModelConfig:
    """Mixtral 8x7B (mistralai/Mixtral-8x7B-v0.1 config.json)."""
    return ModelConfig(
        family="mixtral",
        vocab_size=32_000,
        d_model=4096,
        num_layers=32,
        attention={
            "full": AttentionConfig(
                num_heads=32, num_kv_heads=8, head_dim=128, rope=RopeConfig(theta=1_000_000.0)
            )
        },
        moe=MoEConfig(
            num_experts=8, top_k=2, moe_d_ff=14_336, renormalize=True, aux_loss_weight=0.02
        ),
        norm_eps=1e-5,
        dtype="bfloat16",
        param_dtype="bfloat16",
    )


def mixtral_tiny() -> ModelConfig:
    return ModelConfig(
        family="mixtral",
        vocab_size=264,
        d_model=72,
        num_layers=2,
        attention={
            "full": AttentionConfig(
                num_heads=8, num_kv_heads=4, head_dim=10, rope=RopeConfig(theta=1_000_000.0)
            )
        },
        moe=MoEConfig(num_experts=8, top_k=2, moe_d_ff=56, renormalize=True, aux_loss_weight=0.02),
        norm_eps=1e-5,
    )


def from_hf(c, base, attn, max_pos) -> ModelConfig:
    rope = hf_fields.decoder_rope(c, DEFAULT_ROPE_THETA, max_pos)
    window = c.get("sliding_window")
    moe = MoEConfig(
        num_experts=c["num_local_experts"],
        top_k=c["num_experts_per_tok"],
        moe_d_ff=c["intermediate_size"],
        renormalize=True,
        aux_loss_weight=float(c.get("router_aux_loss_coef", DEFAULT_AUX_LOSS_COEF)),
    )
    types = ("sliding" if window is not None else "full",) * c["num_hidden_layers"]
    return hf_fields.decoder_config(
        c, base, attn, rope=rope, layer_types=types, window=window, moe=moe
    )


def to_hf(cfg: ModelConfig) -> dict:
    out = {**hf_fields.decoder_fields(cfg), "sliding_window": hf_fields.sliding_window(cfg)}
    if cfg.moe is not None:
        out["num_local_experts"] = cfg.moe.num_experts
    return out


N = L + "mlp."  # native
HUB_E = L + "block_sparse_moe.experts.{j}."
MOE_ROWS = (
    Row(N + "router.kernel", L + "block_sparse_moe.gate.weight", TRANSPOSE, HUB),
    Row(N + "experts.gate_proj", HUB_E + "w1.weight", EXPERTS_STACK_T, HUB),
    Row(N + "experts.up_proj", HUB_E + "w3.weight", EXPERTS_STACK_T, HUB),
    Row(N + "experts.down_proj", HUB_E + "w2.weight", EXPERTS_STACK_T, HUB),
    Row(N + "router.kernel", L + "mlp.gate.weight", TRANSPOSE, FUSED),
    Row(
        (N + "experts.gate_proj", N + "experts.up_proj"),
        L + "mlp.experts.gate_up_proj",
        GATE_UP_CONCAT_T,
        FUSED,
    ),
    Row(N + "experts.down_proj", L + "mlp.experts.down_proj", EXPERTS_T, FUSED),
)

FAMILY = Family(
    name="mixtral",
    presets={"mixtral-8x7b": mixtral_8x7b, "mixtral-tiny": mixtral_tiny},
    table=Table(GLOBAL_ROWS + ATTENTION_ROWS + MOE_ROWS),
    architecture="MixtralForCausalLM",
    model_type="mixtral",
    from_hf=from_hf,
    to_hf=to_hf,
    default_norm_eps=1e-5,
    oracle=HFOracle(
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(
            intermediate_size=56,
            num_local_experts=6,
            num_experts_per_tok=2,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        ),
    ),
)
