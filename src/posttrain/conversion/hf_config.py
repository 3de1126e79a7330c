"""HF ``config.json`` <-> :class:`~posttrain.config.ModelConfig`: the one place HF names are read.

``hidden_size`` -> ``d_model``, ``intermediate_size`` -> ``d_ff`` (Mixtral, GPT-OSS:
``moe_d_ff``), ``num_local_experts`` / ``num_experts`` -> ``num_experts``,
``num_experts_per_tok`` / ``top_k_experts`` -> ``top_k``, ``norm_topk_prob`` ->
``renormalize``, ``rms_norm_eps`` -> ``norm_eps`` and so on. RoPE is read from
``rope_parameters`` (transformers >= 5) or from the older top-level
``rope_theta`` + ``rope_scaling``. A feature the native model does not have is
rejected with a one-line :class:`ConversionError` naming the field.

Reference: the ``configuration_*.py`` and ``modeling_rope_utils.py`` files of
transformers 5.12.1 (defaults below are theirs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from posttrain.config import AttentionConfig, ModelConfig, MoEConfig, RopeConfig
from posttrain.conversion.errors import ConversionError

ARCHITECTURES = {
    "LlamaForCausalLM": "llama3",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Gemma4ForCausalLM": "gemma4",
    "Gemma4ForConditionalGeneration": "gemma4",
    "GptOssForCausalLM": "gpt_oss",
}
MODEL_TYPES = {
    "llama": "llama3",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "mixtral": "mixtral",
    "gemma4_text": "gemma4",
    "gemma4": "gemma4",
    "gpt_oss": "gpt_oss",
}
_HF_MODEL_TYPE = {
    "llama3": "llama",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "mixtral": "mixtral",
    "gemma4": "gemma4_text",
    "gpt_oss": "gpt_oss",
}
_DEFAULT_THETA = {
    "llama3": 10_000.0,
    "qwen3": 10_000.0,
    "qwen3_moe": 10_000.0,
    "mixtral": 1_000_000.0,
    "gpt_oss": 150_000.0,
}
_DEFAULT_EPS = {
    "llama3": 1e-6,
    "qwen3": 1e-6,
    "qwen3_moe": 1e-6,
    "mixtral": 1e-5,
    "gemma4": 1e-6,
    "gpt_oss": 1e-5,
}
_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}
_DTYPES = ("float32", "bfloat16", "float16")


def _fail(field: str, message: str) -> None:
    raise ConversionError(f"config.json {field}: {message}")


def hf_model_type(family: str) -> str:
    """The HF ``model_type`` of a native family's ``<Family>ForCausalLM``."""
    return _HF_MODEL_TYPE[family]


def family_of(config: Mapping[str, Any]) -> str:
    """The native family of an HF config (by ``architectures[0]``, else ``model_type``)."""
    arch = (config.get("architectures") or [None])[0]
    if arch is not None:
        if arch not in ARCHITECTURES:
            _fail(
                "architectures",
                f"unknown architecture {arch!r}; supported: {', '.join(sorted(ARCHITECTURES))}",
            )
        return ARCHITECTURES[arch]
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        _fail(
            "model_type",
            f"unknown model_type {model_type!r} (and no architectures); "
            f"supported: {', '.join(sorted(MODEL_TYPES))}",
        )
    return MODEL_TYPES[model_type]


def text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The text model's config: ``text_config`` of a multimodal wrapper, else the config."""
    text = dict(config.get("text_config") or config)
    if "text_config" in config and "tie_word_embeddings" in config:
        text["tie_word_embeddings"] = config["tie_word_embeddings"]
    return text


def _rope(params: Mapping[str, Any], theta: float, max_pos: int | None, field: str) -> RopeConfig:
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", theta))
    partial = float(params.get("partial_rotary_factor", 1.0))
    if kind != "proportional" and partial != 1.0:
        _fail(
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
                _fail(
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
    _fail(
        f"{field}.rope_type",
        f"{kind!r} is not supported; supported: default, llama3, yarn, proportional",
    )
    raise AssertionError  # unreachable


def rope_parameters(c: Mapping[str, Any], family: str) -> dict[str, Any]:
    """``rope_parameters``, or the legacy top-level ``rope_theta`` + ``rope_scaling`` folded in."""
    params = c.get("rope_parameters")
    if params is None:
        params = dict(c.get("rope_scaling") or {})
        if family == "gpt_oss" and not params:
            params = {
                "rope_type": "yarn",
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 4096,
            }
    params = dict(params)
    if "rope_theta" in c:
        params.setdefault("rope_theta", c["rope_theta"])
    return params


def _reject(c: Mapping[str, Any], field: str, allowed, why: str) -> None:
    if field in c and c[field] not in allowed:
        _fail(field, f"{c[field]!r} is not supported ({why})")


def _layer_types(c: Mapping[str, Any], default: list[str]) -> tuple[str, ...]:
    hf_types = c.get("layer_types") or default
    for t in hf_types:
        if t not in _LAYER_TYPES:
            _fail(
                "layer_types",
                f"layer type {t!r} is not supported; supported: {', '.join(_LAYER_TYPES)}",
            )
    if len(hf_types) != c["num_hidden_layers"]:
        _fail(
            "layer_types", f"{len(hf_types)} entries but num_hidden_layers={c['num_hidden_layers']}"
        )
    return tuple(_LAYER_TYPES[t] for t in hf_types)


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


def from_hf_config(config: Mapping[str, Any], **overrides) -> ModelConfig:
    """The :class:`ModelConfig` of an HF ``config.json`` dict.

    Args:
      config: the parsed ``config.json`` (a multimodal Gemma 4 wrapper is read
        through its ``text_config``).
      overrides: native-only fields (``scan_layers``, ``remat``, ``dtype`` ...)
        applied with ``ModelConfig.replace``.

    Raises:
      ConversionError: unknown architecture, or a field with a value the native
        model does not support (the message names the field).
    """
    _check_field_types(text_config(config) if isinstance(config, Mapping) else config)
    try:
        cfg = _from_hf_config(config)
    except KeyError as error:
        raise ConversionError(f"config.json {error.args[0]}: missing") from None
    except ConversionError:
        raise
    except (TypeError, ValueError) as error:
        raise ConversionError(f"config.json: {error}") from None
    return cfg.replace(**overrides) if overrides else cfg


def _from_hf_config(config: Mapping[str, Any]) -> ModelConfig:
    family = family_of(config)
    if config.get("quantization_config") is not None:
        method = config["quantization_config"].get("quant_method", "?")
        _fail(
            "quantization_config",
            f"quant_method={method!r} (e.g. GPT-OSS MXFP4 experts) "
            "is not supported; dequantise to bf16/fp32 first",
        )
    c = text_config(config)
    _reject(c, "num_kv_shared_layers", (0, None), "KV sharing between layers")
    _reject(c, "hidden_size_per_layer_input", (0, None), "per-layer input embeddings")
    _reject(c, "use_bidirectional_attention", (None,), "bidirectional attention")
    _reject(c, "mlp_only_layers", ([], None), "dense layers between MoE layers")
    _reject(c, "decoder_sparse_step", (1, None), "dense layers between MoE layers")
    _reject(c, "hidden_act", ("silu",), "silu only")
    _reject(c, "hidden_activation", ("gelu_pytorch_tanh",), "gelu_pytorch_tanh only")
    dtype = str(c.get("dtype") or c.get("torch_dtype") or "float32").replace("torch.", "")
    if dtype not in _DTYPES:
        _fail("dtype", f"{dtype!r} must be one of {', '.join(_DTYPES)}")
    heads = c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    max_pos = c.get("max_position_embeddings")
    base = dict(
        family=family,
        vocab_size=c["vocab_size"],
        d_model=c["hidden_size"],
        num_layers=c["num_hidden_layers"],
        norm_eps=c.get("rms_norm_eps", _DEFAULT_EPS[family]),
        tie_word_embeddings=c.get("tie_word_embeddings", family == "gemma4"),
        dtype=dtype,
        param_dtype=dtype,
    )
    attn = dict(
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        bias=bool(c.get("attention_bias", family == "gpt_oss")),
    )
    if family == "gemma4":
        return _gemma4(c, base, attn, max_pos)
    rope = _rope(rope_parameters(c, family), _DEFAULT_THETA[family], max_pos, "rope_parameters")
    return _decoder(c, family, base, dict(attn, rope=rope))


def _sliding(c: Mapping[str, Any], family: str) -> tuple[tuple[str, ...], int | None]:
    """Layer types and window of the Llama-like families (HF ``__post_init__`` rules)."""
    n = c["num_hidden_layers"]
    if family in ("llama3",):
        return ("full",) * n, None
    window = c.get("sliding_window")
    if family in ("qwen3", "qwen3_moe") and not c.get("use_sliding_window", False):
        window = None
    if family == "gpt_oss":
        default = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
        return _layer_types(c, default), window
    if family == "qwen3":
        start = c.get("max_window_layers", 28)
        default = [
            "sliding_attention" if window is not None and i >= start else "full_attention"
            for i in range(n)
        ]
        types = _layer_types(c, default)
        return types, (window if "sliding" in types else None)
    # qwen3_moe, mixtral: every layer slides when a window is set
    return ("sliding" if window is not None else "full",) * n, window


def _decoder(c, family: str, base: dict, attn: dict) -> ModelConfig:
    layer_types, window = _sliding(c, family)
    qk_norm = family in ("qwen3", "qwen3_moe")
    gpt_oss = family == "gpt_oss"
    attention = {
        t: AttentionConfig(
            **attn,
            qk_norm=qk_norm,
            sinks=gpt_oss,
            sliding_window=window if t == "sliding" else None,
        )
        for t in set(layer_types)
    }
    moe = None
    if family == "qwen3_moe":
        moe = MoEConfig(
            num_experts=c.get("num_experts") or c["num_local_experts"],
            top_k=c["num_experts_per_tok"],
            moe_d_ff=c["moe_intermediate_size"],
            renormalize=bool(c.get("norm_topk_prob", False)),
            aux_loss_weight=float(c.get("router_aux_loss_coef", 0.001)),
        )
    elif family == "mixtral":
        moe = MoEConfig(
            num_experts=c["num_local_experts"],
            top_k=c["num_experts_per_tok"],
            moe_d_ff=c["intermediate_size"],
            renormalize=True,
            aux_loss_weight=float(c.get("router_aux_loss_coef", 0.001)),
        )
    elif gpt_oss:
        moe = MoEConfig(
            num_experts=c["num_local_experts"],
            top_k=c["num_experts_per_tok"],
            moe_d_ff=c["intermediate_size"],
            score_order="topk_then_score",
            renormalize=False,
            router_bias=True,
            expert_bias=True,
            aux_loss_weight=float(c.get("router_aux_loss_coef", 0.001)),
        )
    return ModelConfig(
        **base,
        layer_types=layer_types,
        attention=attention,
        d_ff=0 if moe is not None else c["intermediate_size"],
        activation="clamped_swiglu" if gpt_oss else "silu",
        swiglu_limit=float(c.get("swiglu_limit", 7.0)),
        mlp_bias=bool(c.get("mlp_bias", False)),
        moe=moe,
    )


def _gemma4_layer_dims(c, layer_types) -> dict[str, tuple[int, int]]:
    """(head_dim, kv heads) per layer type: ``per_layer_config`` (transformers >= 5.2x
    config.json), else ``global_head_dim`` / ``num_global_key_value_heads`` for full layers."""
    k_eq_v = bool(c.get("attention_k_eq_v", False))
    kv, hd = c.get("num_key_value_heads") or c["num_attention_heads"], c.get("head_dim", 256)
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
            _fail(
                "per_layer_config",
                f"{t} layers with different (head_dim, kv heads) "
                f"{sorted(values)} are not supported",
            )
        dims[t] = values.pop()
    return dims


def _gemma4(c, base: dict, attn: dict, max_pos) -> ModelConfig:
    n = c["num_hidden_layers"]
    default = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]
    default[-1] = "full_attention"
    layer_types = _layer_types(c, default)
    ropes = c.get("rope_parameters") or {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {
            "rope_type": "proportional",
            "partial_rotary_factor": 0.25,
            "rope_theta": 1_000_000.0,
        },
    }
    dims = _gemma4_layer_dims(c, layer_types)
    attention = {}
    for t in set(layer_types):
        hf_t = {v: k for k, v in _LAYER_TYPES.items()}[t]
        head_dim, kv = dims[t]
        attention[t] = AttentionConfig(
            num_heads=attn["num_heads"],
            num_kv_heads=kv,
            head_dim=head_dim,
            bias=attn["bias"],
            rope=_rope(ropes[hf_t], 10_000.0, max_pos, f"rope_parameters.{hf_t}"),
            sliding_window=c.get("sliding_window", 512) if t == "sliding" else None,
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


NATIVE_ONLY = ("scan_layers", "remat")


def hf_view(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` with native-only choices (scan, remat, MoE algorithm, capacity) reset:
    two configs with the same HF checkpoint have equal views."""
    moe = cfg.moe
    if moe is not None:
        moe = dataclasses.replace(
            moe, algorithm="sorted", block_size=None, capacity_factor=None, fuse_expert_scales=False
        )
    return cfg.replace(scan_layers=False, remat="none", moe=moe, dtype=cfg.param_dtype)


def _rope_dict(rope: RopeConfig) -> dict[str, Any]:
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


def to_hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """An HF ``config.json`` dict for ``cfg`` (``<Family>ForCausalLM``).

    Raises:
      ConversionError: ``cfg`` uses a feature its HF family cannot express (checked
        by reading the result back with :func:`from_hf_config`).
    """
    from posttrain.conversion.tables import TABLES

    family = cfg.family
    if family not in TABLES:
        raise ConversionError(
            f"family {family!r} has no HF conversion; supported: {', '.join(sorted(TABLES))}"
        )
    types = sorted(set(cfg.layer_types))
    first = cfg.attention[types[0]]
    hf_types = {"full": "full_attention", "sliding": "sliding_attention"}
    out: dict[str, Any] = {
        "architectures": [TABLES[family].architecture],
        "model_type": _HF_MODEL_TYPE[family],
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
        "max_position_embeddings": 4096,
    }
    if family in ("qwen3", "gemma4", "gpt_oss"):
        out["layer_types"] = [hf_types[t] for t in cfg.layer_types]
    window = next((a.sliding_window for a in cfg.attention.values() if a.sliding_window), None)
    moe = cfg.moe
    if family == "gemma4":
        sliding = cfg.attention.get("sliding", first)
        full = cfg.attention.get("full", first)
        out.update(
            head_dim=sliding.head_dim,
            num_key_value_heads=sliding.num_kv_heads,
            global_head_dim=full.head_dim,
            attention_k_eq_v=full.k_eq_v,
            num_global_key_value_heads=full.num_kv_heads if full.k_eq_v else None,
            sliding_window=window or 512,
            intermediate_size=cfg.d_ff,
            hidden_activation="gelu_pytorch_tanh",
            hidden_size_per_layer_input=0,
            num_kv_shared_layers=0,
            final_logit_softcapping=cfg.final_logit_softcap,
            rope_parameters={hf_types[t]: _rope_dict(cfg.attention[t].rope) for t in types},
            enable_moe_block=moe is not None,
        )
        if moe is not None:
            out.update(
                num_experts=moe.num_experts,
                top_k_experts=moe.top_k,
                moe_intermediate_size=moe.moe_d_ff,
            )
    else:
        out.update(
            rope_parameters=_rope_dict(first.rope),
            hidden_act="silu",
            intermediate_size=cfg.d_ff or (moe.moe_d_ff if moe else 0),
        )
        if family in ("qwen3", "qwen3_moe"):
            out.update(use_sliding_window=window is not None, max_window_layers=0)
        if family in ("qwen3", "qwen3_moe", "mixtral", "gpt_oss"):
            out["sliding_window"] = window
        if family == "llama3":
            out["mlp_bias"] = cfg.mlp_bias
        if moe is not None:
            out.update(num_experts_per_tok=moe.top_k, router_aux_loss_coef=moe.aux_loss_weight)
            if family == "qwen3_moe":
                out.update(
                    num_experts=moe.num_experts,
                    moe_intermediate_size=moe.moe_d_ff,
                    norm_topk_prob=moe.renormalize,
                    decoder_sparse_step=1,
                    mlp_only_layers=[],
                )
            else:
                out["num_local_experts"] = moe.num_experts
        if family == "gpt_oss":
            out["swiglu_limit"] = cfg.swiglu_limit
    back = from_hf_config(out)
    if hf_view(back) != hf_view(cfg):
        diff = [
            f.name
            for f in dataclasses.fields(cfg)
            if getattr(hf_view(back), f.name) != getattr(hf_view(cfg), f.name)
        ]
        raise ConversionError(
            f"native config of family {family!r} cannot be written as an "
            f"HF config: fields {diff} have no HF equivalent"
        )
    return out
