"""HF ``config.json`` <-> :class:`~posttrain.config.ModelConfig`: the fields every family shares.

``hidden_size`` -> ``d_model``, ``num_attention_heads`` -> ``num_heads``,
``num_key_value_heads`` -> ``num_kv_heads``, ``rms_norm_eps`` -> ``norm_eps`` and so on
are read here; what differs between families (experts, sliding layers, RoPE defaults,
Gemma 4's per-layer-type attention) is read by the family's ``from_hf`` hook
(:mod:`posttrain.families`) with the shared readers of
:mod:`posttrain.hf_schema.hf_fields`. A feature the native model does not have is rejected
with a one-line :class:`ConversionError` naming the field; a field of the wrong JSON type,
before any arithmetic on it.

Reference: the ``configuration_*.py`` files of transformers 5.12.1 (defaults are theirs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from posttrain import families
from posttrain.config import MAX_NUM_LAYERS, ModelConfig
from posttrain.conversion.errors import ConversionError
from posttrain.hf_schema.hf_fields import HF_LAYER_TYPES, fail, reject

_DTYPES = ("float32", "bfloat16", "float16")


def family_of(config: Mapping[str, Any]) -> str:
    """The native family of an HF config (by ``architectures[0]``, else ``model_type``)."""
    arch = (config.get("architectures") or [None])[0]
    if arch is not None:
        family = families.by_architecture(arch)
        if family is None:
            fail(
                "architectures",
                f"unknown architecture {arch!r}; supported: {', '.join(families.architectures())}",
            )
        return family.name
    model_type = config.get("model_type")
    family = families.by_model_type(model_type) if isinstance(model_type, str) else None
    if family is None:
        fail(
            "model_type",
            f"unknown model_type {model_type!r} (and no architectures); "
            f"supported: {', '.join(families.model_types())}",
        )
    return family.name


def text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The text model's config: ``text_config`` of a multimodal wrapper, else the config."""
    text = dict(config.get("text_config") or config)
    if "text_config" in config and "tie_word_embeddings" in config:
        text["tie_word_embeddings"] = config["tie_word_embeddings"]
    return text


_INT_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "num_global_key_value_heads",
    "head_dim",
    "global_head_dim",
    "intermediate_size",
    "moe_intermediate_size",
    "vocab_size",
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "top_k_experts",
    "max_position_embeddings",
    "max_window_layers",
)
_FLOAT_FIELDS = (
    "rms_norm_eps",
    "rope_theta",
    "router_aux_loss_coef",
    "swiglu_limit",
    "final_logit_softcapping",
)
_BOOL_FIELDS = (
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "norm_topk_prob",
    "attention_k_eq_v",
    "enable_moe_block",
    "use_sliding_window",
)


def _check_field_types(config) -> None:
    """Raises :class:`ConversionError` naming the first field whose JSON type is wrong
    (``"hidden_size": "64"``), before any arithmetic on it fails without a name."""
    if not isinstance(config, Mapping):
        raise ConversionError(f"config.json: expected a JSON object, got {type(config).__name__}")

    def wrong(field: str, value, expected: str):
        raise ConversionError(
            f"config.json {field}: {value!r} is a {type(value).__name__}, expected {expected}"
        )

    for field in _INT_FIELDS:
        value = config.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            wrong(field, value, "an integer")
    for field in _FLOAT_FIELDS:
        value = config.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            wrong(field, value, "a number")
    for field in _BOOL_FIELDS:
        value = config.get(field)
        if value is not None and not isinstance(value, bool):
            wrong(field, value, "true or false")
    sliding = config.get("sliding_window")
    if sliding is not None and (isinstance(sliding, bool) or not isinstance(sliding, int)):
        wrong("sliding_window", sliding, "an integer or null")
    for field in ("rope_parameters", "rope_scaling"):
        value = config.get(field)
        if value is not None and not isinstance(value, Mapping):
            wrong(field, value, "an object")
    types = config.get("layer_types")
    if types is not None and not (
        isinstance(types, list) and all(isinstance(t, str) for t in types)
    ):
        wrong("layer_types", types, "a list of strings")


def from_hf_config(config: Mapping[str, Any], *, vision: bool = False, **overrides) -> ModelConfig:
    """The :class:`ModelConfig` of an HF ``config.json`` dict.

    Args:
      config: the parsed ``config.json`` (a multimodal Gemma 4 wrapper is read
        through its ``text_config``).
      vision: read the wrapper's vision tower too (``ModelConfig.vision``); by default
        a multimodal checkpoint reads as its text model, the towers skipped.
      overrides: native-only fields (``scan_layers``, ``remat``, ``dtype`` ...)
        applied with ``ModelConfig.replace``.

    Raises:
      ConversionError: unknown architecture, or a field with a value the native
        model does not support (the message names the field).
    """
    _check_field_types(text_config(config) if isinstance(config, Mapping) else config)
    try:
        cfg = _from_hf_config(config, vision)
    except KeyError as error:
        raise ConversionError(f"config.json {error.args[0]}: missing") from None
    except ConversionError:
        raise
    except (TypeError, ValueError) as error:
        raise ConversionError(f"config.json: {error}") from None
    return cfg.replace(**overrides) if overrides else cfg


def _from_hf_config(config: Mapping[str, Any], vision: bool) -> ModelConfig:
    family = families.get(family_of(config))
    if config.get("quantization_config") is not None:
        method = config["quantization_config"].get("quant_method", "?")
        fail(
            "quantization_config",
            f"quant_method={method!r} (e.g. GPT-OSS MXFP4 experts) "
            "is not supported; dequantise to bf16/fp32 first",
        )
    c = text_config(config)
    reject(c, "num_kv_shared_layers", (0, None), "KV sharing between layers")
    reject(c, "hidden_size_per_layer_input", (0, None), "per-layer input embeddings")
    # "vision": bidirectional within an image's tokens (VisionConfig.bidirectional); a text
    # model never sees image tokens without their images, so reading it as text is exact
    reject(c, "use_bidirectional_attention", (None, "vision"), "bidirectional attention")
    reject(c, "mlp_only_layers", ([], None), "dense layers between MoE layers")
    reject(c, "decoder_sparse_step", (1, None), "dense layers between MoE layers")
    reject(c, "hidden_act", ("silu",), "silu only")
    reject(c, "hidden_activation", ("gelu_pytorch_tanh",), "gelu_pytorch_tanh only")
    dtype = str(c.get("dtype") or c.get("torch_dtype") or "float32").replace("torch.", "")
    if dtype not in _DTYPES:
        fail("dtype", f"{dtype!r} must be one of {', '.join(_DTYPES)}")
    layers = c["num_hidden_layers"]
    if not (isinstance(layers, int) and 1 <= layers <= MAX_NUM_LAYERS):  # before a family
        # builds a table per layer; null passes the type check (absent fields may be null)
        fail("num_hidden_layers", f"{layers!r}, expected 1 to {MAX_NUM_LAYERS}")
    heads = c["num_attention_heads"]
    base = dict(
        family=family.name,
        vocab_size=c["vocab_size"],
        d_model=c["hidden_size"],
        num_layers=c["num_hidden_layers"],
        norm_eps=c.get("rms_norm_eps", family.default_norm_eps),
        tie_word_embeddings=c.get("tie_word_embeddings", family.default_tied),
        dtype=dtype,
        param_dtype=dtype,
    )
    attn = dict(
        num_heads=heads,
        num_kv_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        bias=bool(c.get("attention_bias", family.default_attention_bias)),
    )
    cfg = family.from_hf(c, base, attn, c.get("max_position_embeddings"))
    if vision:
        if family.vision_from_hf is None or config.get("vision_config") is None:
            fail("vision_config", f"a {family.name} checkpoint without a vision tower")
        cfg = cfg.replace(vision=family.vision_from_hf(config))
    return cfg


NATIVE_ONLY = ("scan_layers", "remat", "attention_kernel")
#: What :func:`to_hf_config` writes as ``max_position_embeddings`` (a native config has
#: no such field); also the limit :mod:`posttrain.limits` assumes where none is recorded.
DEFAULT_MAX_POSITIONS = 4096


def hf_view(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` with native-only choices (scan, remat, attention kernel, MoE algorithm,
    capacity) reset: two configs with the same HF checkpoint have equal views."""
    moe = cfg.moe
    if moe is not None:
        moe = dataclasses.replace(
            moe, algorithm="sorted", block_size=None, capacity_factor=None, fuse_expert_scales=False
        )
    return cfg.replace(
        scan_layers=False, remat="none", attention_kernel="xla", moe=moe, dtype=cfg.param_dtype
    )


def to_hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """An HF ``config.json`` dict for ``cfg`` (``<Family>ForCausalLM``): the fields every
    family writes, then the family's own (:attr:`posttrain.families.Family.to_hf`). A
    vision tower is not part of it: the multimodal wrapper writes it (``Family.wrap_hf``).

    Raises:
      ConversionError: ``cfg``'s family has no HF conversion, or ``cfg`` uses a feature
        its HF family cannot express (checked by reading the result back with
        :func:`from_hf_config`).
    """
    if cfg.family not in families.FAMILIES:
        raise ConversionError(
            f"family {cfg.family!r} has no HF conversion; "
            f"supported: {', '.join(sorted(families.NAMES))}"
        )
    family = families.get(cfg.family)
    first = cfg.attention[min(cfg.layer_types)]
    out: dict[str, Any] = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "dtype": cfg.param_dtype,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": first.num_heads,
        "num_key_value_heads": first.num_kv_heads,
        "head_dim": first.head_dim,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": first.bias,
        "max_position_embeddings": DEFAULT_MAX_POSITIONS,
    }
    if family.writes_layer_types:
        out["layer_types"] = [HF_LAYER_TYPES[t] for t in cfg.layer_types]
    out.update(family.to_hf(cfg))
    back = from_hf_config(out)
    cfg = cfg.replace(vision=None)  # the tower is the wrapper's (Family.wrap_hf)
    if hf_view(back) != hf_view(cfg):
        diff = [
            f.name
            for f in dataclasses.fields(cfg)
            if getattr(hf_view(back), f.name) != getattr(hf_view(cfg), f.name)
        ]
        raise ConversionError(
            f"native config of family {cfg.family!r} cannot be written as an "
            f"HF config: fields {diff} have no HF equivalent"
        )
    return out
