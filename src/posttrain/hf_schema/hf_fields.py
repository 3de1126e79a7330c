"""Readers and writers of HF ``config.json`` fields that several families share.

The families (:mod:`posttrain.families`) build their ``from_hf`` / ``to_hf`` hooks
from these; :mod:`posttrain.conversion.hf_config` holds the part every family has. RoPE
is read from ``rope_parameters`` (transformers >= 5) or from the older top-level
``rope_theta`` + ``rope_scaling``.

Reference: the ``configuration_*.py`` and ``modeling_rope_utils.py`` files of
transformers 5.12.1 (defaults are theirs).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from posttrain.config import AttentionConfig, ModelConfig, MoEConfig, RopeConfig
from posttrain.hf_schema.errors import ConversionError

LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}  # HF -> native
HF_LAYER_TYPES = {native: hf for hf, native in LAYER_TYPES.items()}


def fail(field: str, message: str) -> None:
    """Raises :class:`ConversionError` ``config.json <field>: <message>``."""
    raise ConversionError(f"config.json {field}: {message}")


def reject(c: Mapping[str, Any], field: str, allowed, why: str) -> None:
    """Fails when ``field`` is present with a value outside ``allowed``."""
    if field in c and c[field] not in allowed:
        fail(field, f"{c[field]!r} is not supported ({why})")


def rope_config(
    params: Mapping[str, Any], theta: float, max_pos: int | None, field: str
) -> RopeConfig:
    """The :class:`RopeConfig` of one HF ``rope_parameters`` dict (``theta``: the
    family's default ``rope_theta``; ``field``: the dict's name in messages)."""
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", theta))
    partial = float(params.get("partial_rotary_factor", 1.0))
    if kind != "proportional" and partial != 1.0:
        fail(
            f"{field}.partial_rotary_factor",
            f"{partial} is only supported with rope_type 'proportional', got {kind!r}",
        )
    if kind == "default":
        return RopeConfig(theta=theta)
    original = params.get("original_max_position_embeddings", max_pos)
    if kind == "llama3":
        return RopeConfig(
            kind="llama3",
            theta=theta,
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(original),
        )
    if kind == "yarn":
        for name in ("attention_factor", "mscale", "mscale_all_dim"):
            if params.get(name) is not None:
                fail(
                    f"{field}.{name}",
                    f"{params[name]} is not supported (yarn attention "
                    "factor is 0.1 ln(factor) + 1 here)",
                )
        factor = params.get("factor") or (max_pos / original)
        return RopeConfig(
            kind="yarn",
            theta=theta,
            factor=float(factor),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            truncate=bool(params.get("truncate", True)),
            original_max_position_embeddings=int(original),
        )
    if kind == "proportional":
        return RopeConfig(
            kind="proportional",
            theta=theta,
            factor=float(params.get("factor", 1.0)),
            partial_rotary_factor=partial,
        )
    fail(
        f"{field}.rope_type",
        f"{kind!r} is not supported; supported: default, llama3, yarn, proportional",
    )
    raise AssertionError  # unreachable


def rope_parameters(
    c: Mapping[str, Any], default: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """``rope_parameters``, or the legacy top-level ``rope_theta`` + ``rope_scaling`` folded
    in; ``default`` (the family's HF default scaling) when neither gives any."""
    params = c.get("rope_parameters")
    if params is None:
        params = dict(c.get("rope_scaling") or {}) or dict(default or {})
    params = dict(params)
    if "rope_theta" in c:
        params.setdefault("rope_theta", c["rope_theta"])
    return params


def decoder_rope(
    c: Mapping[str, Any],
    theta: float,
    max_pos: int | None,
    default: Mapping[str, Any] | None = None,
) -> RopeConfig:
    """The one RoPE of a Llama-like decoder's config (:func:`rope_parameters` read with
    :func:`rope_config`; ``theta``, ``default``: the family's HF defaults)."""
    return rope_config(rope_parameters(c, default), theta, max_pos, "rope_parameters")


def rope_dict(rope: RopeConfig) -> dict[str, Any]:
    """The HF ``rope_parameters`` dict of ``rope`` (inverse of :func:`rope_config`)."""
    out: dict[str, Any] = {"rope_type": rope.kind, "rope_theta": rope.theta}
    if rope.kind == "llama3":
        out.update(
            factor=rope.factor,
            low_freq_factor=rope.low_freq_factor,
            high_freq_factor=rope.high_freq_factor,
            original_max_position_embeddings=rope.original_max_position_embeddings,
        )
    elif rope.kind == "yarn":
        out.update(
            factor=rope.factor,
            beta_fast=rope.beta_fast,
            beta_slow=rope.beta_slow,
            truncate=rope.truncate,
            original_max_position_embeddings=rope.original_max_position_embeddings,
        )
    elif rope.kind == "proportional":
        out.update(partial_rotary_factor=rope.partial_rotary_factor, factor=rope.factor)
    return out


def layer_types(c: Mapping[str, Any], default: Sequence[str]) -> tuple[str, ...]:
    """Native layer types of HF ``layer_types`` (``default``, HF names, when absent).

    Raises:
      ConversionError: an unknown type, or not one per layer.
    """
    hf_types = c.get("layer_types") or default
    for t in hf_types:
        if t not in LAYER_TYPES:
            fail(
                "layer_types",
                f"layer type {t!r} is not supported; supported: {', '.join(LAYER_TYPES)}",
            )
    if len(hf_types) != c["num_hidden_layers"]:
        fail(
            "layer_types", f"{len(hf_types)} entries but num_hidden_layers={c['num_hidden_layers']}"
        )
    return tuple(LAYER_TYPES[t] for t in hf_types)


def max_window_layers(
    c: Mapping[str, Any], default_start: int
) -> tuple[tuple[str, ...], int | None]:
    """``(layer types, window)`` of a Qwen2/Qwen3 config: with ``use_sliding_window``,
    layers from ``max_window_layers`` (``default_start``: the config class's default) on
    slide (HF ``Qwen2Config`` / ``Qwen3Config.__post_init__``), unless ``layer_types``
    says otherwise; the window is ``None`` when no layer slides."""
    window = c.get("sliding_window") if c.get("use_sliding_window", False) else None
    start = c.get("max_window_layers", default_start)
    default = [
        "sliding_attention" if window is not None and i >= start else "full_attention"
        for i in range(c["num_hidden_layers"])
    ]
    types = layer_types(c, default)
    return types, window if "sliding" in types else None


def max_window_fields(cfg: ModelConfig) -> dict[str, Any]:
    """The Qwen2/Qwen3 sliding-window fields of ``cfg`` (inverse of
    :func:`max_window_layers`; ``layer_types``, written too, says which layers slide)."""
    window = sliding_window(cfg)
    return {
        "use_sliding_window": window is not None,
        "max_window_layers": 0,
        "sliding_window": window,
    }


def sliding_window(cfg: ModelConfig) -> int | None:
    """The window of ``cfg``'s sliding layers (``None`` when no layer slides)."""
    return next((a.sliding_window for a in cfg.attention.values() if a.sliding_window), None)


def decoder_config(
    c: Mapping[str, Any],
    base: Mapping[str, Any],
    attn: Mapping[str, Any],
    *,
    rope: RopeConfig,
    layer_types: tuple[str, ...],
    window: int | None,
    qk_norm: bool = False,
    sinks: bool = False,
    moe: MoEConfig | None = None,
    activation: str = "silu",
) -> ModelConfig:
    """The config of a Llama-like decoder (every family but Gemma 4): one attention
    config per layer type, differing only in the window; a dense SwiGLU MLP or ``moe``."""
    attention = {
        t: AttentionConfig(
            **attn,
            rope=rope,
            qk_norm=qk_norm,
            sinks=sinks,
            sliding_window=window if t == "sliding" else None,
        )
        for t in set(layer_types)
    }
    return ModelConfig(
        **base,
        layer_types=layer_types,
        attention=attention,
        d_ff=0 if moe is not None else c["intermediate_size"],
        activation=activation,
        swiglu_limit=float(c.get("swiglu_limit", ModelConfig.swiglu_limit)),
        mlp_bias=bool(c.get("mlp_bias", False)),
        moe=moe,
    )


def decoder_fields(cfg: ModelConfig) -> dict[str, Any]:
    """The HF fields of a Llama-like decoder that :mod:`posttrain.conversion.hf_config`
    does not write."""
    moe = cfg.moe
    out: dict[str, Any] = {
        "rope_parameters": rope_dict(cfg.attention[min(cfg.layer_types)].rope),
        "hidden_act": "silu",
        "intermediate_size": cfg.d_ff or (moe.moe_d_ff if moe else 0),
    }
    if moe is not None:
        out.update(num_experts_per_tok=moe.top_k, router_aux_loss_coef=moe.aux_loss_weight)
    return out
