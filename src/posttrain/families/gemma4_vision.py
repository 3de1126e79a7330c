"""Gemma 4's vision tower as a part of the ``gemma4`` family: its conversion rows, its
``vision_config`` reader and writer, and a tiny config.

Quirks (transformers 5.12.1 ``modeling_gemma4.py``): the tower's linears are
``Gemma4ClippableLinear``, so their HF keys end ``<name>.linear.weight``; the patch
embedder's ``position_embedding_table`` ``[2, positions, D_v]`` holds x then y; the
projection into the text model (``model.embed_vision``) sits outside the tower, after a
weightless RMSNorm; ``std_bias`` / ``std_scale`` are persistent buffers, stored only with
``standardize``; the tower's keys are never under the text model's prefix
(``model.language_model.``), so the engine reads and writes them as they are.
With ``use_clipped_linears`` (real checkpoints) each linear has 0-d bounds ``input_min``,
``input_max``, ``output_min``, ``output_max`` beside ``linear``.
Not supported yet (refused by name): a RoPE other than ``default``, an activation other
than ``gelu_pytorch_tanh``, attention biases, and the text model's bidirectional attention
over image tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from posttrain.config import VisionConfig
from posttrain.hf_schema import hf_fields
from posttrain.hf_schema.rows import CLIPPED, STANDARDIZE, VISION, Row
from posttrain.hf_schema.transforms import HEADS_IN, HEADS_OUT, IDENTITY, TRANSPOSE
from posttrain.layers.mlp import CLIP_BOUNDS

HF_TOWER, TOWER = "model.vision_tower.", "vision_tower."
V_HF, V = HF_TOWER + "encoder.layers.{v}.", TOWER + "layers.{v}."
DEFAULT_TOKENS = {  # Gemma4Config's defaults (transformers 5.12.1)
    "image_token_id": 258_880,
    "boi_token_id": 255_999,
    "eoi_token_id": 258_882,
}


def _norm(name: str) -> Row:
    return Row(V + name + ".scale", V_HF + name + ".weight", IDENTITY, VISION)


def _linear(name: str, transform) -> Row:
    return Row(V + name + ".kernel", V_HF + name + ".linear.weight", transform, VISION)


LINEARS = (
    ("self_attn.q_proj", HEADS_IN),
    ("self_attn.k_proj", HEADS_IN),
    ("self_attn.v_proj", HEADS_IN),
    ("self_attn.o_proj", HEADS_OUT),
    ("mlp.gate_proj", TRANSPOSE),
    ("mlp.up_proj", TRANSPOSE),
    ("mlp.down_proj", TRANSPOSE),
)


VISION_ROWS = (
    Row(
        TOWER + "patch_embedder.input_proj.kernel",
        HF_TOWER + "patch_embedder.input_proj.weight",
        TRANSPOSE,
        VISION,
    ),
    Row(
        TOWER + "patch_embedder.position_embedding_table",
        HF_TOWER + "patch_embedder.position_embedding_table",
        IDENTITY,
        VISION,
    ),
    _norm("input_layernorm"),
    _norm("post_attention_layernorm"),
    _norm("pre_feedforward_layernorm"),
    _norm("post_feedforward_layernorm"),
    *(_linear(name, transform) for name, transform in LINEARS),
    # Gemma4ClippableLinear's bounds: 0-d buffers beside the linear, not under it
    *(
        Row(V + name + "." + bound, V_HF + name + "." + bound, IDENTITY, CLIPPED)
        for name, _ in LINEARS
        for bound in CLIP_BOUNDS
    ),
    _norm("self_attn.q_norm"),
    _norm("self_attn.k_norm"),
    Row(TOWER + "std_bias", HF_TOWER + "std_bias", IDENTITY, STANDARDIZE),
    Row(TOWER + "std_scale", HF_TOWER + "std_scale", IDENTITY, STANDARDIZE),
    Row(
        "embed_vision.embedding_projection.kernel",
        "model.embed_vision.embedding_projection.weight",
        TRANSPOSE,
        VISION,
    ),
)
"""The tower's rows; ``{v}`` is the vision layer index (``VisionConfig.num_layers``)."""


UNSUPPORTED = (  # (vision_config field, values the native tower supports, why not others)
    ("hidden_activation", ("gelu_pytorch_tanh", None), "gelu_pytorch_tanh only"),
    ("attention_bias", (False, None), "attention biases"),
)


# The tower's 2-D rope (head_dim // 2 frequencies per axis, laid out h, h, w, w) by both of
# its names: transformers 5.12 writes "default"; newer releases (5.25) call the same rope
# "axial" and read a "default" as "axial" (Gemma4VisionConfig.default_rope_type), so a
# written config keeps "default" and both releases load it.
VISION_ROPE_TYPES = ("default", "axial")


def vision_from_hf(config: Mapping[str, Any]) -> VisionConfig | None:
    """The :class:`VisionConfig` of a ``Gemma4ForConditionalGeneration`` config.json,
    ``None`` when its ``vision_config`` is null or absent.

    Raises:
      ConversionError: a vision feature the native tower does not have (field named).
    """
    v = config.get("vision_config")
    if v is None:
        return None
    if not isinstance(v, Mapping):
        hf_fields.fail("vision_config", f"{v!r} is not an object")
    field = "vision_config."
    for name, allowed, why in UNSUPPORTED:
        if name in v and v[name] not in allowed:
            hf_fields.fail(field + name, f"{v[name]!r} is not supported ({why})")
    rope = v.get("rope_parameters") or {}
    if rope.get("rope_type", "default") not in VISION_ROPE_TYPES:
        hf_fields.fail(
            field + "rope_parameters",
            f"rope_type {rope['rope_type']!r}: one of {', '.join(VISION_ROPE_TYPES)} only",
        )
    heads = v.get("num_attention_heads", 12)
    text = config.get("text_config") or {}
    bidirectional = text.get("use_bidirectional_attention")
    if bidirectional not in (None, "vision"):
        hf_fields.fail(
            "text_config.use_bidirectional_attention",
            f"{bidirectional!r} is not supported (None or 'vision' only)",
        )
    return VisionConfig(
        d_model=v.get("hidden_size", 768),
        num_layers=v.get("num_hidden_layers", 16),
        num_heads=heads,
        num_kv_heads=v.get("num_key_value_heads") or heads,
        head_dim=v.get("head_dim", 64),
        d_ff=v.get("intermediate_size", 3072),
        patch_size=v.get("patch_size", 16),
        pooling_kernel_size=v.get("pooling_kernel_size", 3),
        position_embedding_size=v.get("position_embedding_size", 10 * 1024),
        rope_theta=float(rope.get("rope_theta", 100.0)),
        norm_eps=v.get("rms_norm_eps", 1e-6),
        standardize=bool(v.get("standardize", False)),
        clipped_linears=bool(v.get("use_clipped_linears", False)),
        **{name: config.get(name, default) for name, default in DEFAULT_TOKENS.items()},
        bidirectional=bidirectional == "vision",
    )


def text_with_vision(text: dict[str, Any], vision: VisionConfig | None) -> dict[str, Any]:
    """The wrapper's ``text_config``: ``text`` with ``use_bidirectional_attention:
    "vision"`` when the tower's images are seen bidirectionally."""
    if vision is None or not vision.bidirectional:
        return text
    return {**text, "use_bidirectional_attention": "vision"}


def vision_to_hf(vision: VisionConfig | None) -> dict[str, Any]:
    """The wrapper's ``vision_config`` and image token ids for ``vision`` (``{}`` for None)."""
    if vision is None:
        return {}
    return {
        "vision_config": {
            "model_type": "gemma4_vision",
            "hidden_size": vision.d_model,
            "intermediate_size": vision.d_ff,
            "num_hidden_layers": vision.num_layers,
            "num_attention_heads": vision.num_heads,
            "num_key_value_heads": vision.num_kv_heads,
            "head_dim": vision.head_dim,
            "hidden_activation": "gelu_pytorch_tanh",
            "rms_norm_eps": vision.norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": vision.rope_theta},
            "pooling_kernel_size": vision.pooling_kernel_size,
            "patch_size": vision.patch_size,
            "position_embedding_size": vision.position_embedding_size,
            "use_clipped_linears": vision.clipped_linears,
            "standardize": vision.standardize,
        },
        "image_token_id": vision.image_token_id,
        "boi_token_id": vision.boi_token_id,
        "eoi_token_id": vision.eoi_token_id,
    }


def vision_tiny() -> VisionConfig:
    """A CPU-sized tower for ``gemma4-tiny`` (vocab 264): distinct dims (D_v 40, d_ff 56,
    heads x head_dim 4 x 12 = 48, patch 4 x 4 x 3 = 48 values but a [48, 40] kernel), 2 x 2
    pooling, standardised, clipped linears (as real checkpoints), image tokens at the top of
    the vocabulary."""
    return VisionConfig(
        d_model=40,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=12,
        d_ff=56,
        patch_size=4,
        pooling_kernel_size=2,
        position_embedding_size=16,
        rope_theta=100.0,
        standardize=True,
        clipped_linears=True,
        image_token_id=261,
        boi_token_id=262,
        eoi_token_id=263,
    )
