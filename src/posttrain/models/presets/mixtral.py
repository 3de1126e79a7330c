"""Mixtral (HF ``MixtralForCausalLM``): Llama attention, softmax router, top-k always
renormalised."""

from posttrain.config import AttentionConfig, ModelConfig, MoEConfig, RopeConfig


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


PRESETS = {"mixtral-8x7b": mixtral_8x7b, "mixtral-tiny": mixtral_tiny}
