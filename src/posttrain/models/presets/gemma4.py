"""Gemma 4 text, MoE variant (HF ``Gemma4ForCausalLM`` with ``enable_moe_block=True``).

Quirks (../shared/research/hf-reference.md section 8): sliding and full layers of
different shapes (full layers: their own head_dim and kv heads, k used as v,
proportional RoPE); q/k RMSNorm and weightless v-norm; attention scale 1.0;
sandwich norms; a dense GeGLU MLP beside the experts; the router reads the raw
residual through its own weightless RMSNorm x ``scale`` x d_model^-1/2, and
``per_expert_scale`` multiplies the renormalised weights; a per-layer scalar;
embeddings x sqrt(d_model); final logit soft-capping; tied embeddings.

Only a tiny preset ships: full-size Gemma 4 configs come from ``config.json``
through the conversion package.
"""

from posttrain.config import AttentionConfig, ModelConfig, MoEConfig, RopeConfig


def gemma4_tiny() -> ModelConfig:
    sliding = AttentionConfig(
        num_heads=8,
        num_kv_heads=4,
        head_dim=10,
        rope=RopeConfig(theta=10_000.0),
        sliding_window=8,
        qk_norm=True,
        v_norm=True,
        scale=1.0,
    )
    full = AttentionConfig(
        num_heads=8,
        num_kv_heads=4,
        head_dim=12,
        rope=RopeConfig(kind="proportional", theta=1_000_000.0, partial_rotary_factor=0.25),
        qk_norm=True,
        v_norm=True,
        k_eq_v=True,
        scale=1.0,
    )
    return ModelConfig(
        family="gemma4",
        vocab_size=264,
        d_model=72,
        num_layers=2,
        d_ff=88,
        layer_types=("sliding", "full"),
        attention={"sliding": sliding, "full": full},
        activation="gelu_tanh",
        moe=MoEConfig(
            num_experts=8,
            top_k=2,
            moe_d_ff=56,
            renormalize=True,
            router_input_norm=True,
            per_expert_scale=True,
        ),
        dense_mlp_with_moe=True,
        sandwich_norm=True,
        layer_scalar=True,
        embed_scale=True,
        final_logit_softcap=30.0,
        tie_word_embeddings=True,
        norm_eps=1e-6,
    )


PRESETS = {"gemma4-tiny": gemma4_tiny}
