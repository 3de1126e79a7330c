"""Llama 3 (HF ``LlamaForCausalLM``): GQA, SwiGLU, RMSNorm, Llama 3.1 RoPE scaling."""

from posttrain.config import AttentionConfig, ModelConfig, RopeConfig


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


def llama3_tiny() -> ModelConfig:
    """CPU-sized Llama 3; original_max_position_embeddings=256 puts the 5 RoPE
    frequencies of head_dim 10 in all three llama3 bands (high, blended, low)."""
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


PRESETS = {"llama3-8b": llama3_8b, "llama3-tiny": llama3_tiny}
