"""GPT-OSS (HF ``GptOssForCausalLM``).

Quirks: attention sinks, biases on q/k/v/o, alternating sliding (even layers)
and full layers, YaRN RoPE; router with bias, top-k on the logits then softmax
over the k; experts with biases and the clamped SwiGLU (``ModelConfig.swiglu_alpha``
and ``swiglu_limit``: ``(up + 1) * gate * sigmoid(alpha * gate)``, clamped at the limit).

Conversion: router ``mlp.router.{weight, bias}``; experts already ``[E, in, out]``
with gate/up interleaved in the columns of ``gate_up_proj`` ``[E, D, 2F]`` and its
bias ``[E, 2F]``; ``down_proj`` ``[E, F, D]`` and its bias ``[E, D]`` as they are. One
layout (no transformers conversion mapping). MXFP4 checkpoints (``*_blocks`` /
``*_scales``) are rejected by the engine.
"""

from __future__ import annotations

from posttrain.config import AttentionConfig, ModelConfig, MoEConfig, RopeConfig
from posttrain.families.family import Family, HFOracle
from posttrain.hf_schema import hf_fields
from posttrain.hf_schema.rows import Row
from posttrain.hf_schema.table import ATTENTION_ROWS, GLOBAL_ROWS, L, Table
from posttrain.hf_schema.transforms import (
    GATE_UP_INTERLEAVED,
    GATE_UP_INTERLEAVED_BIAS,
    IDENTITY,
    TRANSPOSE,
)

DEFAULT_ROPE_THETA = 150_000.0  # GptOssConfig
DEFAULT_AUX_LOSS_COEF = 0.001
DEFAULT_ROPE_SCALING = {  # GptOssConfig's, when config.json has none
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
_MOE = dict(score_order="topk_then_score", renormalize=False, router_bias=True, expert_bias=True)


def _yarn(theta: float) -> RopeConfig:
    return RopeConfig(
        kind="yarn",
        theta=theta,
        factor=32.0,
        beta_fast=32.0,
        beta_slow=1.0,
        original_max_position_embeddings=4096,
        truncate=False,
    )


def gpt_oss_20b() -> ModelConfig:
    """gpt-oss-20b (openai/gpt-oss-20b config.json, experts dequantised from MXFP4)."""
    attn = dict(num_heads=64, num_kv_heads=8, head_dim=64, rope=_yarn(150_000.0), bias=True)
    return ModelConfig(
        family="gpt_oss",
        vocab_size=201_088,
        d_model=2880,
        num_layers=24,
        layer_types=("sliding", "full") * 12,
        attention={
            "sliding": AttentionConfig(sliding_window=128, sinks=True, **attn),
            "full": AttentionConfig(sinks=True, **attn),
        },
        activation="clamped_swiglu",
        moe=MoEConfig(num_experts=32, top_k=4, moe_d_ff=2880, **_MOE),
        norm_eps=1e-5,
        dtype="bfloat16",
        param_dtype="bfloat16",
    )


def gpt_oss_tiny() -> ModelConfig:
    """CPU-sized GPT-OSS; original_max_position_embeddings=4096 (as gpt-oss-20b) puts
    YaRN's correction range at frequencies 1.26-2.72 of head_dim 10's five: the ramp
    blends two of them, so beta_fast, beta_slow and truncate all change the model
    (at 16, the range fell below frequency 1 and none of the three did)."""
    attn = dict(num_heads=8, num_kv_heads=4, head_dim=10, rope=_yarn(150_000.0), bias=True)
    return ModelConfig(
        family="gpt_oss",
        vocab_size=264,
        d_model=72,
        num_layers=2,
        layer_types=("sliding", "full"),
        attention={
            "sliding": AttentionConfig(sliding_window=8, sinks=True, **attn),
            "full": AttentionConfig(sinks=True, **attn),
        },
        activation="clamped_swiglu",
        moe=MoEConfig(num_experts=8, top_k=2, moe_d_ff=56, **_MOE),
        norm_eps=1e-5,
    )


def from_hf(c, base, attn, max_pos) -> ModelConfig:
    rope = hf_fields.decoder_rope(c, DEFAULT_ROPE_THETA, max_pos, DEFAULT_ROPE_SCALING)
    n = c["num_hidden_layers"]
    default = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    moe = MoEConfig(
        num_experts=c["num_local_experts"],
        top_k=c["num_experts_per_tok"],
        moe_d_ff=c["intermediate_size"],
        aux_loss_weight=float(c.get("router_aux_loss_coef", DEFAULT_AUX_LOSS_COEF)),
        **_MOE,
    )
    return hf_fields.decoder_config(
        c,
        base,
        attn,
        rope=rope,
        layer_types=hf_fields.layer_types(c, default),
        window=c.get("sliding_window"),
        sinks=True,
        moe=moe,
        activation="clamped_swiglu",
    )


def to_hf(cfg: ModelConfig) -> dict:
    out = {**hf_fields.decoder_fields(cfg), "sliding_window": hf_fields.sliding_window(cfg)}
    if cfg.moe is not None:
        out["num_local_experts"] = cfg.moe.num_experts
    out["swiglu_limit"] = cfg.swiglu_limit
    return out


N = L + "mlp."
MOE_ROWS = (
    Row(N + "router.kernel", N + "router.weight", TRANSPOSE),
    Row(N + "router.bias", N + "router.bias", IDENTITY),
    Row(
        (N + "experts.gate_proj", N + "experts.up_proj"),
        N + "experts.gate_up_proj",
        GATE_UP_INTERLEAVED,
    ),
    Row(
        (N + "experts.gate_proj_bias", N + "experts.up_proj_bias"),
        N + "experts.gate_up_proj_bias",
        GATE_UP_INTERLEAVED_BIAS,
    ),
    Row(N + "experts.down_proj", N + "experts.down_proj", IDENTITY),
    Row(N + "experts.down_proj_bias", N + "experts.down_proj_bias", IDENTITY),
)

FAMILY = Family(
    name="gpt_oss",
    presets={"gpt_oss-20b": gpt_oss_20b, "gpt_oss-tiny": gpt_oss_tiny},
    table=Table(GLOBAL_ROWS + ATTENTION_ROWS + MOE_ROWS),
    architecture="GptOssForCausalLM",
    model_type="gpt_oss",
    from_hf=from_hf,
    to_hf=to_hf,
    default_norm_eps=1e-5,
    default_attention_bias=True,
    writes_layer_types=True,
    oracle=HFOracle(
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            intermediate_size=56,
            num_local_experts=6,
            num_experts_per_tok=2,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150_000.0,
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 4096,
            },  # YaRN's correction range at frequencies 1.26-2.72 of head_dim 10's five
            rms_norm_eps=1e-5,
            attention_bias=True,
            tie_word_embeddings=False,
        ),
        layer_pattern="alternating",
    ),
)
