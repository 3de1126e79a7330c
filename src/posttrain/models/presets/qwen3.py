"""Qwen3 dense (HF ``Qwen3ForCausalLM``): GQA with per-head q/k RMSNorm before RoPE."""

from posttrain.config import AttentionConfig, ModelConfig, RopeConfig


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


PRESETS = {"qwen3-0.6b": qwen3_0_6b, "qwen3-tiny": qwen3_tiny}
