"""GPT-OSS (HF ``GptOssForCausalLM``).

Quirks: attention sinks, biases on q/k/v/o, alternating sliding (even layers)
and full layers, YaRN RoPE; router with bias, top-k on the logits then softmax
over the k; experts with biases and the clamped SwiGLU
((up + 1) * gate * sigmoid(1.702 * gate), clamps at 7).
"""

from posttrain.config import AttentionConfig, ModelConfig, MoEConfig, RopeConfig

_MOE = dict(score_order="topk_then_score", renormalize=False, router_bias=True, expert_bias=True)


def gpt_oss_20b() -> ModelConfig:
    """gpt-oss-20b (openai/gpt-oss-20b config.json, experts dequantised from MXFP4)."""
    rope = RopeConfig(
        kind="yarn",
        theta=150_000.0,
        factor=32.0,
        beta_fast=32.0,
        beta_slow=1.0,
        original_max_position_embeddings=4096,
        truncate=False,
    )
    attn = dict(num_heads=64, num_kv_heads=8, head_dim=64, rope=rope, bias=True, sinks=True)
    return ModelConfig(
        family="gpt_oss",
        vocab_size=201_088,
        d_model=2880,
        num_layers=24,
        layer_types=("sliding", "full") * 12,
        attention={
            "sliding": AttentionConfig(sliding_window=128, **attn),
            "full": AttentionConfig(**attn),
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
    rope = RopeConfig(
        kind="yarn",
        theta=150_000.0,
        factor=32.0,
        beta_fast=32.0,
        beta_slow=1.0,
        original_max_position_embeddings=4096,
        truncate=False,
    )
    attn = dict(num_heads=8, num_kv_heads=4, head_dim=10, rope=rope, bias=True, sinks=True)
    return ModelConfig(
        family="gpt_oss",
        vocab_size=264,
        d_model=72,
        num_layers=2,
        layer_types=("sliding", "full"),
        attention={
            "sliding": AttentionConfig(sliding_window=8, **attn),
            "full": AttentionConfig(**attn),
        },
        activation="clamped_swiglu",
        moe=MoEConfig(num_experts=8, top_k=2, moe_d_ff=56, **_MOE),
        norm_eps=1e-5,
    )


PRESETS = {"gpt_oss-20b": gpt_oss_20b, "gpt_oss-tiny": gpt_oss_tiny}
