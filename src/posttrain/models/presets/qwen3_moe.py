"""Qwen3-MoE (HF ``Qwen3MoeForCausalLM``): Qwen3 attention, softmax router, top-k renormalised
when ``norm_topk_prob``, no shared expert."""

from posttrain.config import AttentionConfig, ModelConfig, MoEConfig, RopeConfig


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


PRESETS = {"qwen3_moe-30b-a3b": qwen3_moe_30b_a3b, "qwen3_moe-tiny": qwen3_moe_tiny}
