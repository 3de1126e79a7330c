"""Gemma 4 text, MoE variant (HF ``Gemma4ForCausalLM`` with ``enable_moe_block=True``).

Quirks (../shared/research/hf-reference.md section 8): sliding and full layers of
different shapes (full layers: their own head_dim and kv heads, k used as v,
proportional RoPE); q/k RMSNorm and weightless v-norm; attention scale 1.0;
sandwich norms; a dense GeGLU MLP beside the experts; the router reads the raw
residual through its own weightless RMSNorm x ``scale`` x d_model^-1/2, and
``per_expert_scale`` multiplies the renormalised weights; a per-layer scalar;
embeddings x sqrt(d_model); final logit soft-capping; tied embeddings.

Presets: ``gemma4-tiny``, ``gemma4-vision-tiny`` (with the tiny vision tower) and
``gemma4-26b-a4b`` (:func:`gemma4_26b_a4b`, the released MoE size; the dense sizes have
no MoE block and other features, per-layer embeddings and shared KV layers, that this
family does not model).

Conversion: sandwich norms, a per-layer ``layer_scalar`` (a persistent buffer,
stored), a dense MLP in every layer and, with MoE, ``router.{proj.weight, scale,
per_expert_scale}`` and ``experts.{gate_up_proj [E, 2F, D], down_proj [E, D, F]}``
directly under the layer (native: under ``moe.``). Full layers with
``attention_k_eq_v`` have no ``v_proj`` (``V_PROJ``). transformers has no
conversion mapping for Gemma 4, so the hub and fused layouts are the same.
Real checkpoints are ``Gemma4ForConditionalGeneration``: the text weights sit
under ``model.language_model.``, beside vision and audio towers. The audio tower is
skipped; the vision tower is read when the config has one (``vision_config``) and
skipped otherwise: ``VISION_ROWS`` (:mod:`posttrain.families.gemma4_vision`).
"""

from __future__ import annotations

from posttrain.config import AttentionConfig, ModelConfig, MoEConfig, RopeConfig
from posttrain.families.family import Family, HFOracle
from posttrain.families.gemma4_vision import (
    VISION_ROWS,
    text_with_vision,
    vision_from_hf,
    vision_tiny,
    vision_to_hf,
)
from posttrain.hf_schema import hf_fields
from posttrain.hf_schema.rows import DENSE_AND_MOE, LAYER_SCALAR, MOE, SANDWICH, Row
from posttrain.hf_schema.table import ATTENTION_ROWS, DENSE_MLP_ROWS, GLOBAL_ROWS, L, Table
from posttrain.hf_schema.transforms import EXPERTS_T, GATE_UP_CONCAT_T, IDENTITY, TRANSPOSE

WRAPPER_ARCHITECTURE, WRAPPER_MODEL_TYPE = "Gemma4ForConditionalGeneration", "gemma4"
DEFAULT_ROPE_THETA = 10_000.0
DEFAULT_HEAD_DIM = 256
DEFAULT_SLIDING_WINDOW = 512
DEFAULT_ROPE_PARAMETERS = {  # Gemma4TextConfig's, per HF layer type
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {
        "rope_type": "proportional",
        "partial_rotary_factor": 0.25,
        "rope_theta": 1_000_000.0,
    },
}


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


def gemma4_vision_tiny() -> ModelConfig:
    """``gemma4-tiny`` with the CPU-sized vision tower (:func:`~posttrain.families.
    gemma4_vision.vision_tiny`): ``posttrain sft --vision``'s default model."""
    return gemma4_tiny().replace(vision=vision_tiny())


def gemma4_26b_a4b() -> ModelConfig:
    """Gemma 4 26B-A4B, text (google/gemma-4-26B-A4B-it ``config.json``'s ``text_config``:
    hidden_size 2816, 30 layers of 5 sliding (window 1024, 8 kv heads of 256) to 1 full
    (2 kv heads of 512, k used as v, proportional RoPE 0.25), 16 heads, a dense GeGLU MLP
    of 2112 beside 128 experts of 704 (top 8), vocab 262144, tied, soft-cap 30).

    Sources disagree on two fields. intermediate_size 2112 and num_global_key_value_heads
    2 are taken from the copies of the released ``config.json`` quoted in public code and
    from transformers 5.24's own note on this checkpoint (``Gemma4TextConfig``'s expert
    plan: "num_global_key_value_heads=2 too small to partition"); one test fixture gives
    9216 (``Gemma4TextConfig``'s default) and 4 (the 31B's). With 2112 the text model has
    25.23B parameters, the model card's 25.2B; 9216 would add 1.8B.
    """
    full = ("sliding",) * 5 + ("full",)
    sliding = AttentionConfig(
        num_heads=16,
        num_kv_heads=8,
        head_dim=256,
        rope=RopeConfig(theta=10_000.0),
        sliding_window=1024,
        qk_norm=True,
        v_norm=True,
        scale=1.0,
    )
    global_ = AttentionConfig(
        num_heads=16,
        num_kv_heads=2,
        head_dim=512,
        rope=RopeConfig(kind="proportional", theta=1_000_000.0, partial_rotary_factor=0.25),
        qk_norm=True,
        v_norm=True,
        k_eq_v=True,
        scale=1.0,
    )
    return gemma4_tiny().replace(
        vocab_size=262_144,
        d_model=2816,
        num_layers=30,
        d_ff=2112,
        layer_types=full * 5,
        attention={"sliding": sliding, "full": global_},
        moe=MoEConfig(
            num_experts=128,
            top_k=8,
            moe_d_ff=704,
            renormalize=True,
            router_input_norm=True,
            per_expert_scale=True,
        ),
    )


def _layer_dims(c, layer_types) -> dict[str, tuple[int, int]]:
    """(head_dim, kv heads) per layer type: ``per_layer_config`` (transformers >= 5.2x
    config.json), else ``global_head_dim`` / ``num_global_key_value_heads`` for full layers."""
    k_eq_v = bool(c.get("attention_k_eq_v", False))
    kv = c.get("num_key_value_heads") or c["num_attention_heads"]
    hd = c.get("head_dim", DEFAULT_HEAD_DIM)
    full_kv = (c.get("num_global_key_value_heads") or kv) if k_eq_v else kv
    dims = {"sliding": (hd, kv), "full": (c.get("global_head_dim") or hd, full_kv)}
    per_layer = c.get("per_layer_config") or {}
    seen: dict[str, set] = {}
    for index, entry in per_layer.items():
        t = layer_types[int(index)]
        d = dims[t]
        seen.setdefault(t, set()).add(
            (entry.get("head_dim", d[0]), entry.get("num_key_value_heads", d[1]))
        )
    for t, values in seen.items():
        if len(values) > 1:
            hf_fields.fail(
                "per_layer_config",
                f"{t} layers with different (head_dim, kv heads) "
                f"{sorted(values)} are not supported",
            )
        dims[t] = values.pop()
    return dims


def from_hf(c, base, attn, max_pos) -> ModelConfig:
    n = c["num_hidden_layers"]
    default = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]
    default[-1] = "full_attention"
    layer_types = hf_fields.layer_types(c, default)
    ropes = c.get("rope_parameters") or DEFAULT_ROPE_PARAMETERS
    dims = _layer_dims(c, layer_types)
    attention = {}
    for t in set(layer_types):
        hf_t = hf_fields.HF_LAYER_TYPES[t]
        head_dim, kv = dims[t]
        attention[t] = AttentionConfig(
            num_heads=attn["num_heads"],
            num_kv_heads=kv,
            head_dim=head_dim,
            bias=attn["bias"],
            rope=hf_fields.rope_config(
                ropes[hf_t], DEFAULT_ROPE_THETA, max_pos, f"rope_parameters.{hf_t}"
            ),
            sliding_window=c.get("sliding_window", DEFAULT_SLIDING_WINDOW)
            if t == "sliding"
            else None,
            qk_norm=True,
            v_norm=True,
            scale=1.0,
            k_eq_v=bool(c.get("attention_k_eq_v", False)) and t == "full",
        )
    moe = None
    if c.get("enable_moe_block", False):
        moe = MoEConfig(
            num_experts=c["num_experts"],
            top_k=c["top_k_experts"],
            moe_d_ff=c["moe_intermediate_size"],
            renormalize=True,
            router_input_norm=True,
            per_expert_scale=True,
        )
    return ModelConfig(
        **base,
        layer_types=layer_types,
        attention=attention,
        d_ff=c["intermediate_size"],
        activation="gelu_tanh",
        moe=moe,
        dense_mlp_with_moe=moe is not None,
        sandwich_norm=True,
        layer_scalar=True,
        embed_scale=True,
        final_logit_softcap=c.get("final_logit_softcapping"),
    )


def to_hf(cfg: ModelConfig) -> dict:
    types = sorted(set(cfg.layer_types))
    first = cfg.attention[types[0]]
    sliding = cfg.attention.get("sliding", first)
    full = cfg.attention.get("full", first)
    moe = cfg.moe
    out = dict(
        head_dim=sliding.head_dim,
        num_key_value_heads=sliding.num_kv_heads,
        global_head_dim=full.head_dim,
        attention_k_eq_v=full.k_eq_v,
        num_global_key_value_heads=full.num_kv_heads if full.k_eq_v else None,
        sliding_window=hf_fields.sliding_window(cfg) or DEFAULT_SLIDING_WINDOW,
        intermediate_size=cfg.d_ff,
        hidden_activation="gelu_pytorch_tanh",
        hidden_size_per_layer_input=0,
        num_kv_shared_layers=0,
        final_logit_softcapping=cfg.final_logit_softcap,
        rope_parameters={
            hf_fields.HF_LAYER_TYPES[t]: hf_fields.rope_dict(cfg.attention[t].rope) for t in types
        },
        enable_moe_block=moe is not None,
    )
    if moe is not None:
        out.update(
            num_experts=moe.num_experts,
            top_k_experts=moe.top_k,
            moe_intermediate_size=moe.moe_d_ff,
        )
    return out


def wrap_hf(cfg: ModelConfig, text: dict) -> dict:
    """The ``Gemma4ForConditionalGeneration`` config.json around text config ``text``
    (with ``cfg``'s vision tower, if any; no audio tower)."""
    return {
        "architectures": [WRAPPER_ARCHITECTURE],
        "model_type": WRAPPER_MODEL_TYPE,
        "text_config": text_with_vision(text, cfg.vision),
        "vision_config": None,
        "audio_config": None,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "dtype": cfg.param_dtype,
        **vision_to_hf(cfg.vision),
    }


def _norm(name, when=SANDWICH):
    return Row(L + name + ".scale", L + name + ".weight", IDENTITY, when)


M = L + "moe."
LAYER_ROWS = (
    _norm("pre_feedforward_layernorm"),
    _norm("post_feedforward_layernorm"),
    _norm("post_feedforward_layernorm_1", DENSE_AND_MOE),
    _norm("pre_feedforward_layernorm_2", DENSE_AND_MOE),
    _norm("post_feedforward_layernorm_2", DENSE_AND_MOE),
    Row(L + "layer_scalar", L + "layer_scalar", IDENTITY, LAYER_SCALAR),
    Row(M + "router.kernel", L + "router.proj.weight", TRANSPOSE, MOE),
    Row(M + "router.scale", L + "router.scale", IDENTITY, MOE),
    Row(M + "router.per_expert_scale", L + "router.per_expert_scale", IDENTITY, MOE),
    Row(
        (M + "experts.gate_proj", M + "experts.up_proj"),
        L + "experts.gate_up_proj",
        GATE_UP_CONCAT_T,
        MOE,
    ),
    Row(M + "experts.down_proj", L + "experts.down_proj", EXPERTS_T, MOE),
)

FAMILY = Family(
    name="gemma4",
    presets={
        "gemma4-tiny": gemma4_tiny,
        "gemma4-vision-tiny": gemma4_vision_tiny,
        "gemma4-26b-a4b": gemma4_26b_a4b,
    },
    table=Table(
        GLOBAL_ROWS + ATTENTION_ROWS + DENSE_MLP_ROWS + LAYER_ROWS + VISION_ROWS,
        prefixes=("model.", "model.language_model."),
        ignored=(
            "model.vision_tower.",
            "model.audio_tower.",
            "model.embed_vision.",
            "model.embed_audio.",
        ),
    ),
    architecture="Gemma4ForCausalLM",
    model_type="gemma4_text",
    from_hf=from_hf,
    to_hf=to_hf,
    default_norm_eps=1e-6,
    default_tied=True,
    writes_layer_types=True,
    read_architectures=(WRAPPER_ARCHITECTURE,),
    read_model_types=(WRAPPER_MODEL_TYPE,),
    wrap_hf=wrap_hf,
    vision_from_hf=vision_from_hf,
    oracle=HFOracle(
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        dict(
            intermediate_size=88,
            global_head_dim=12,
            num_global_key_value_heads=2,
            attention_k_eq_v=True,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=8,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {
                    "rope_type": "proportional",
                    "partial_rotary_factor": 0.25,
                    "rope_theta": 1_000_000.0,
                },
            },
            enable_moe_block=True,
            num_experts=6,
            top_k_experts=2,
            moe_intermediate_size=56,
            hidden_size_per_layer_input=0,
            final_logit_softcapping=30.0,
            hidden_activation="gelu_pytorch_tanh",
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        ),
        layer_pattern="ends_full",
    ),
)
