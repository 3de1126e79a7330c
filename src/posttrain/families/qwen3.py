"""Qwen3 dense (HF ``Qwen3ForCausalLM``): GQA with per-head q/k RMSNorm before RoPE.

Conversion: the Llama rows plus the per-head q/k norms (``QK_NORM``). Sliding
layers: with ``use_sliding_window``, layers from ``max_window_layers`` on slide
(HF ``Qwen3Config.__post_init__``), unless ``layer_types`` says otherwise.
"""

from __future__ import annotations

from posttrain.config import AttentionConfig, ModelConfig, RopeConfig
from posttrain.families.family import Family, HFOracle
from posttrain.hf_schema import hf_fields
from posttrain.hf_schema.table import ATTENTION_ROWS, DENSE_MLP_ROWS, GLOBAL_ROWS, Table

DEFAULT_ROPE_THETA = 10_000.0  # Qwen3Config
DEFAULT_MAX_WINDOW_LAYERS = 28


def qwen3_0_6b() -> ModelConfig:
    """Qwen3 0.6B (Qwen/Qwen3-0.6B config.json): tied embeddings, head_dim 128."""
    return ModelConfig(
        family="qwen3",
        vocab_size=151_936,
        d_model=1024,
        num_layers=28,
        d_ff=3072,
        attention={
            "full": AttentionConfig(
                num_heads=16,
                num_kv_heads=8,
                head_dim=128,
                rope=RopeConfig(theta=1_000_000.0),
                qk_norm=True,
            )
        },
        norm_eps=1e-6,
        tie_word_embeddings=True,
        dtype="bfloat16",
        param_dtype="bfloat16",
    )


def qwen3_tiny() -> ModelConfig:
    return ModelConfig(
        family="qwen3",
        vocab_size=264,
        d_model=72,
        num_layers=2,
        d_ff=88,
        attention={
            "full": AttentionConfig(
                num_heads=8,
                num_kv_heads=4,
                head_dim=10,
                rope=RopeConfig(theta=1_000_000.0),
                qk_norm=True,
            )
        },
        norm_eps=1e-6,
        tie_word_embeddings=True,
    )


def from_hf(c, base, attn, max_pos) -> ModelConfig:
    rope = hf_fields.decoder_rope(c, DEFAULT_ROPE_THETA, max_pos)
    types, window = hf_fields.max_window_layers(c, DEFAULT_MAX_WINDOW_LAYERS)
    return hf_fields.decoder_config(
        c, base, attn, rope=rope, layer_types=types, window=window, qk_norm=True
    )


def to_hf(cfg: ModelConfig) -> dict:
    return {**hf_fields.decoder_fields(cfg), **hf_fields.max_window_fields(cfg)}


FAMILY = Family(
    name="qwen3",
    presets={"qwen3-0.6b": qwen3_0_6b, "qwen3-tiny": qwen3_tiny},
    table=Table(GLOBAL_ROWS + ATTENTION_ROWS + DENSE_MLP_ROWS),
    architecture="Qwen3ForCausalLM",
    model_type="qwen3",
    from_hf=from_hf,
    to_hf=to_hf,
    default_norm_eps=1e-6,
    writes_layer_types=True,
    oracle=HFOracle(
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(
            intermediate_size=88,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        ),
    ),
)
