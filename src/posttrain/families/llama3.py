"""Llama 3 (HF ``LlamaForCausalLM``): GQA, SwiGLU, RMSNorm, Llama 3.1 RoPE scaling.

Conversion: nothing fused; optional attention and MLP biases.
"""

from __future__ import annotations

from posttrain.config import AttentionConfig, ModelConfig, RopeConfig
from posttrain.families.family import Family, HFOracle
from posttrain.hf_schema import hf_fields
from posttrain.hf_schema.table import ATTENTION_ROWS, DENSE_MLP_ROWS, GLOBAL_ROWS, Table

DEFAULT_ROPE_THETA = 10_000.0  # LlamaConfig


def llama3_8b() -> ModelConfig:
    """Llama 3.1 8B (meta-llama/Llama-3.1-8B config.json)."""
    rope = RopeConfig(
        kind="llama3",
        theta=500_000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )
    return ModelConfig(
        family="llama3",
        vocab_size=128_256,
        d_model=4096,
        num_layers=32,
        d_ff=14_336,
        attention={"full": AttentionConfig(num_heads=32, num_kv_heads=8, head_dim=128, rope=rope)},
        norm_eps=1e-5,
        dtype="bfloat16",
        param_dtype="bfloat16",
    )


def llama3_70b() -> ModelConfig:
    """Llama 3.1 70B (meta-llama/Llama-3.1-70B config.json: hidden_size 8192,
    intermediate_size 28672, 80 layers, 64 heads, 8 kv heads, head_dim 128, vocab 128256,
    rope_theta 500000 with llama3 scaling factor 8, rms_norm_eps 1e-5, untied)."""
    return llama3_8b().replace(
        d_model=8192,
        num_layers=80,
        layer_types=("full",) * 80,
        d_ff=28_672,
        attention={
            "full": AttentionConfig(
                num_heads=64, num_kv_heads=8, head_dim=128, rope=llama3_8b().attention["full"].rope
            )
        },
    )


def llama3_tiny() -> ModelConfig:
    """CPU-sized Llama 3; original_max_position_embeddings=256 puts the 5 RoPE
    frequencies of head_dim 10 (wavelengths 6.3, 87, 1197 ...) in all three llama3
    bands (high, blended, low)."""
    rope = RopeConfig(
        kind="llama3",
        theta=500_000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=256,
    )
    return ModelConfig(
        family="llama3",
        vocab_size=264,
        d_model=72,
        num_layers=2,
        d_ff=88,
        attention={"full": AttentionConfig(num_heads=8, num_kv_heads=4, head_dim=10, rope=rope)},
        norm_eps=1e-5,
    )


def from_hf(c, base, attn, max_pos) -> ModelConfig:
    rope = hf_fields.decoder_rope(c, DEFAULT_ROPE_THETA, max_pos)
    n = c["num_hidden_layers"]
    return hf_fields.decoder_config(
        c, base, attn, rope=rope, layer_types=("full",) * n, window=None
    )


def to_hf(cfg: ModelConfig) -> dict:
    return {**hf_fields.decoder_fields(cfg), "mlp_bias": cfg.mlp_bias}


FAMILY = Family(
    name="llama3",
    presets={"llama3-8b": llama3_8b, "llama3-70b": llama3_70b, "llama3-tiny": llama3_tiny},
    table=Table(GLOBAL_ROWS + ATTENTION_ROWS + DENSE_MLP_ROWS),
    architecture="LlamaForCausalLM",
    model_type="llama",
    from_hf=from_hf,
    to_hf=to_hf,
    default_norm_eps=1e-6,
    oracle=HFOracle(
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            intermediate_size=88,
            rms_norm_eps=1e-5,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500_000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
            tie_word_embeddings=False,
        ),
    ),
)
