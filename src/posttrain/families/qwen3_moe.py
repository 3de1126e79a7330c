"""Qwen3-MoE (HF ``Qwen3MoeForCausalLM``): Qwen3 attention, softmax router, top-k
renormalised when ``norm_topk_prob``, no shared expert, every layer MoE.

Conversion: router ``mlp.gate.weight`` ``[E, D]``. Experts: hub layout (what
``save_pretrained`` writes by default, and real checkpoints) one 2-D weight per
expert, ``mlp.experts.{j}.gate_proj/up_proj/down_proj.weight``; fused layout
(``save_original_format=False``) ``mlp.experts.gate_up_proj`` ``[E, 2F, D]`` (gate
rows then up rows) and ``mlp.experts.down_proj`` ``[E, D, F]``. Reference:
transformers ``conversion_mapping.py`` "qwen2_moe" (reused by qwen3_moe).
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

DEFAULT_ROPE_THETA = 10_000.0  # Qwen3MoeConfig
DEFAULT_AUX_LOSS_COEF = 0.001


def qwen3_moe_30b_a3b() -> ModelConfig:
    """Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B config.json)."""
    return ModelConfig(
        family="qwen3_moe",
        vocab_size=151_936,
        d_model=2048,
        num_layers=48,
        attention={
            "full": AttentionConfig(
                num_heads=32,
                num_kv_heads=4,
                head_dim=128,
                rope=RopeConfig(theta=1_000_000.0),
                qk_norm=True,
            )
        },
        moe=MoEConfig(
            num_experts=128, top_k=8, moe_d_ff=768, renormalize=True, aux_loss_weight=0.001
        ),
        norm_eps=1e-6,
        dtype="bfloat16",
        param_dtype="bfloat16",
    )


def qwen3_moe_tiny() -> ModelConfig:
    return ModelConfig(
        family="qwen3_moe",
        vocab_size=264,
        d_model=72,
        num_layers=2,
        attention={
            "full": AttentionConfig(
                num_heads=8,
                num_kv_heads=4,
                head_dim=10,
                rope=RopeConfig(theta=1_000_000.0),
                qk_norm=True,
            )
        },
        moe=MoEConfig(num_experts=8, top_k=2, moe_d_ff=56, renormalize=True, aux_loss_weight=0.001),
        norm_eps=1e-6,
    )


def from_hf(c, base, attn, max_pos) -> ModelConfig:
    rope = hf_fields.decoder_rope(c, DEFAULT_ROPE_THETA, max_pos)
    window = c.get("sliding_window") if c.get("use_sliding_window", False) else None
    moe = MoEConfig(
        num_experts=c.get("num_experts") or c["num_local_experts"],
        top_k=c["num_experts_per_tok"],
        moe_d_ff=c["moe_intermediate_size"],
        renormalize=bool(c.get("norm_topk_prob", False)),
        aux_loss_weight=float(c.get("router_aux_loss_coef", DEFAULT_AUX_LOSS_COEF)),
    )
    types = ("sliding" if window is not None else "full",) * c["num_hidden_layers"]
    return hf_fields.decoder_config(
        c, base, attn, rope=rope, layer_types=types, window=window, qk_norm=True, moe=moe
    )


def to_hf(cfg: ModelConfig) -> dict:
    window, moe = hf_fields.sliding_window(cfg), cfg.moe
    out = {
        **hf_fields.decoder_fields(cfg),
        "use_sliding_window": window is not None,
        "max_window_layers": 0,
        "sliding_window": window,
    }
    if moe is not None:  # else the read-back check names what is missing
        out.update(
            num_experts=moe.num_experts,
            moe_intermediate_size=moe.moe_d_ff,
            norm_topk_prob=moe.renormalize,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    return out


E = L + "mlp.experts."
MOE_ROWS = (
    Row(L + "mlp.router.kernel", L + "mlp.gate.weight", TRANSPOSE),
    Row(E + "gate_proj", E + "{j}.gate_proj.weight", EXPERTS_STACK_T, HUB),
    Row(E + "up_proj", E + "{j}.up_proj.weight", EXPERTS_STACK_T, HUB),
    Row(E + "down_proj", E + "{j}.down_proj.weight", EXPERTS_STACK_T, HUB),
    Row((E + "gate_proj", E + "up_proj"), E + "gate_up_proj", GATE_UP_CONCAT_T, FUSED),
    Row(E + "down_proj", E + "down_proj", EXPERTS_T, FUSED),
)

FAMILY = Family(
    name="qwen3_moe",
    presets={"qwen3_moe-30b-a3b": qwen3_moe_30b_a3b, "qwen3_moe-tiny": qwen3_moe_tiny},
    table=Table(GLOBAL_ROWS + ATTENTION_ROWS + MOE_ROWS),
    architecture="Qwen3MoeForCausalLM",
    model_type="qwen3_moe",
    from_hf=from_hf,
    to_hf=to_hf,
    default_norm_eps=1e-6,
    oracle=HFOracle(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            intermediate_size=88,
            moe_intermediate_size=56,
            num_experts=6,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        ),
    ),
)
