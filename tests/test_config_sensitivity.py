"""Every numeric or switch field of the model configs does what it claims: perturbing it
changes the logits or the training objective.

A field that a layer forgets to read (or reads under another name, with a default) is
otherwise invisible: the model still builds and trains, with the field silently ignored.
Each field of ``ModelConfig``, ``AttentionConfig``, ``RopeConfig`` and ``MoEConfig`` whose
type is int, float or bool (or optional) is either perturbed here, on a tiny preset where
its code path is live, or listed in ``METADATA`` with the reason it has no effect of its own.

How a perturbation is judged: both models get the same parameter values, drawn from the
parameter's dotted path (so every parameter the two share is equal); a field that changes
the shape of a shared parameter affects the model by construction; otherwise the logits or
the objective (mean NLL + ``aux_loss_weight`` x the load-balancing loss) must differ.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain import _compat
from posttrain.config import AttentionConfig, ModelConfig, MoEConfig, RopeConfig
from posttrain.conversion.native import abstract_params
from posttrain.models import get_config
from posttrain.training.loss import token_nll
from posttrain.tree import path_name
from tests.path_params import is_variable, model_with_path_values

# The fixture: 2 rows of 24 tokens, longer than the tiny presets' sliding window (8).
BATCH, SEQ = 2, 24
# An effect is a logit change above float32 noise of the same program.
MIN_LOGIT_CHANGE = 1e-4

METADATA = {
    ("ModelConfig", "scan_layers"): "layout only: scanned == unscanned logits (test_models)",
    ("MoEConfig", "fuse_expert_scales"): "where the scale is applied: fused == unfused (test_moe)",
    (
        "MoEConfig",
        "block_size",
    ): "rows per block of the sorted algorithm: sorted == dense (test_moe)",
}


class Perturbation(NamedTuple):
    preset: str
    change: Callable[[ModelConfig], ModelConfig]


def top(**changes) -> Callable[[ModelConfig], ModelConfig]:
    return lambda cfg: cfg.replace(**changes)


def moe(**changes) -> Callable[[ModelConfig], ModelConfig]:
    return lambda cfg: cfg.replace(moe=dataclasses.replace(cfg.moe, **changes))


def attention(field: str, new: Callable) -> Callable[[ModelConfig], ModelConfig]:
    """``field`` of every layer type's attention config -> ``new(old value)``."""

    def change(cfg):
        return cfg.replace(
            attention={
                t: dataclasses.replace(a, **{field: new(getattr(a, field))})
                for t, a in cfg.attention.items()
            }
        )

    return change


def rope(field: str, value) -> Callable[[ModelConfig], ModelConfig]:
    """``field`` of the RoPE config of every layer type -> ``value``."""

    def change(cfg):
        return cfg.replace(
            attention={
                t: dataclasses.replace(a, rope=dataclasses.replace(a.rope, **{field: value}))
                for t, a in cfg.attention.items()
            }
        )

    return change


PERTURBATIONS: dict[tuple[str, str], Perturbation] = {
    # ModelConfig
    ("ModelConfig", "vocab_size"): Perturbation("qwen3-tiny", top(vocab_size=296)),
    ("ModelConfig", "d_model"): Perturbation("qwen3-tiny", top(d_model=64)),
    ("ModelConfig", "num_layers"): Perturbation("qwen3-tiny", top(num_layers=3, layer_types=())),
    ("ModelConfig", "d_ff"): Perturbation("qwen3-tiny", top(d_ff=40)),
    ("ModelConfig", "swiglu_alpha"): Perturbation("gpt_oss-tiny", top(swiglu_alpha=0.5)),
    # a limit the activations of the fixture reach
    ("ModelConfig", "swiglu_limit"): Perturbation("gpt_oss-tiny", top(swiglu_limit=0.05)),
    ("ModelConfig", "mlp_bias"): Perturbation("qwen3-tiny", top(mlp_bias=True)),
    ("ModelConfig", "dense_mlp_with_moe"): Perturbation(
        "gemma4-tiny", top(dense_mlp_with_moe=False)
    ),
    ("ModelConfig", "norm_eps"): Perturbation("qwen3-tiny", top(norm_eps=1.0)),
    ("ModelConfig", "sandwich_norm"): Perturbation("gemma4-tiny", top(sandwich_norm=False)),
    ("ModelConfig", "layer_scalar"): Perturbation("gemma4-tiny", top(layer_scalar=False)),
    ("ModelConfig", "embed_scale"): Perturbation("gemma4-tiny", top(embed_scale=False)),
    ("ModelConfig", "final_logit_softcap"): Perturbation(
        "gemma4-tiny", top(final_logit_softcap=1.5)
    ),
    ("ModelConfig", "tie_word_embeddings"): Perturbation(
        "qwen3-tiny", lambda cfg: cfg.replace(tie_word_embeddings=not cfg.tie_word_embeddings)
    ),
    # AttentionConfig
    ("AttentionConfig", "num_heads"): Perturbation(
        "qwen3-tiny", attention("num_heads", lambda n: n // 2)
    ),
    ("AttentionConfig", "num_kv_heads"): Perturbation(
        "qwen3-tiny", attention("num_kv_heads", lambda k: k // 2)
    ),
    ("AttentionConfig", "head_dim"): Perturbation(
        "qwen3-tiny", attention("head_dim", lambda h: h + 2)
    ),
    ("AttentionConfig", "sliding_window"): Perturbation(
        "gpt_oss-tiny", attention("sliding_window", lambda w: w and 3)
    ),
    ("AttentionConfig", "qk_norm"): Perturbation(
        "qwen3-tiny", attention("qk_norm", lambda on: not on)
    ),
    ("AttentionConfig", "v_norm"): Perturbation(
        "gemma4-tiny", attention("v_norm", lambda on: not on)
    ),
    ("AttentionConfig", "k_eq_v"): Perturbation(
        "gemma4-tiny", attention("k_eq_v", lambda on: False)
    ),
    ("AttentionConfig", "bias"): Perturbation("gpt_oss-tiny", attention("bias", lambda on: not on)),
    ("AttentionConfig", "sinks"): Perturbation(
        "gpt_oss-tiny", attention("sinks", lambda on: not on)
    ),
    ("AttentionConfig", "scale"): Perturbation("qwen3-tiny", attention("scale", lambda s: 0.05)),
    # RopeConfig, each on a preset of its kind
    ("RopeConfig", "theta"): Perturbation("qwen3-tiny", rope("theta", 50.0)),
    ("RopeConfig", "factor"): Perturbation("llama3-tiny", rope("factor", 2.0)),
    ("RopeConfig", "low_freq_factor"): Perturbation("llama3-tiny", rope("low_freq_factor", 2.0)),
    ("RopeConfig", "high_freq_factor"): Perturbation("llama3-tiny", rope("high_freq_factor", 8.0)),
    ("RopeConfig", "original_max_position_embeddings"): Perturbation(
        "llama3-tiny", rope("original_max_position_embeddings", 64)
    ),
    ("RopeConfig", "beta_fast"): Perturbation("gpt_oss-tiny", rope("beta_fast", 8.0)),
    ("RopeConfig", "beta_slow"): Perturbation("gpt_oss-tiny", rope("beta_slow", 4.0)),
    ("RopeConfig", "truncate"): Perturbation("gpt_oss-tiny", rope("truncate", True)),
    ("RopeConfig", "partial_rotary_factor"): Perturbation(
        "gemma4-tiny",
        lambda cfg: cfg.replace(
            attention={
                **cfg.attention,
                "full": dataclasses.replace(
                    cfg.attention["full"],
                    rope=dataclasses.replace(cfg.attention["full"].rope, partial_rotary_factor=0.5),
                ),
            }
        ),
    ),
    # MoEConfig
    ("MoEConfig", "num_experts"): Perturbation("qwen3_moe-tiny", moe(num_experts=4)),
    ("MoEConfig", "top_k"): Perturbation("qwen3_moe-tiny", moe(top_k=3)),
    ("MoEConfig", "moe_d_ff"): Perturbation("qwen3_moe-tiny", moe(moe_d_ff=40)),
    ("MoEConfig", "renormalize"): Perturbation("qwen3_moe-tiny", moe(renormalize=False)),
    ("MoEConfig", "router_bias"): Perturbation("qwen3_moe-tiny", moe(router_bias=True)),
    ("MoEConfig", "router_input_norm"): Perturbation("qwen3_moe-tiny", moe(router_input_norm=True)),
    ("MoEConfig", "per_expert_scale"): Perturbation("qwen3_moe-tiny", moe(per_expert_scale=True)),
    ("MoEConfig", "expert_bias"): Perturbation("qwen3_moe-tiny", moe(expert_bias=True)),
    # 48 assignments over 8 experts: capacity 3 drops most of them
    ("MoEConfig", "capacity_factor"): Perturbation("qwen3_moe-tiny", moe(capacity_factor=0.5)),
    ("MoEConfig", "shared_expert_d_ff"): Perturbation("qwen3_moe-tiny", moe(shared_expert_d_ff=24)),
    ("MoEConfig", "aux_loss_weight"): Perturbation("qwen3_moe-tiny", moe(aux_loss_weight=1.0)),
}

CONFIG_CLASSES = (ModelConfig, AttentionConfig, RopeConfig, MoEConfig)
_NUMERIC = {"int", "float", "bool", "None"}


def numeric_fields() -> list[tuple[str, str]]:
    """``(class, field)`` for each field typed int, float or bool (optional included)."""
    out = []
    for cls in CONFIG_CLASSES:
        for f in dataclasses.fields(cls):
            parts = {p.strip() for p in str(f.type).split("|")}
            if parts <= _NUMERIC and parts != {"None"}:
                out.append((cls.__name__, f.name))
    return out


def test_every_numeric_field_is_perturbed_or_declared_metadata():
    fields = set(numeric_fields())
    assert ("MoEConfig", "aux_loss_weight") in fields and ("RopeConfig", "truncate") in fields
    missing = sorted(fields - set(PERTURBATIONS) - set(METADATA))
    assert not missing, f"fields with neither a perturbation nor a metadata reason: {missing}"
    stale = sorted((set(PERTURBATIONS) | set(METADATA)) - fields)
    assert not stale, f"entries for fields that do not exist: {stale}"
    assert not set(PERTURBATIONS) & set(METADATA)


def outputs(cfg: ModelConfig, model=None) -> tuple[np.ndarray, float]:
    """``(logits [batch, seq, vocab], objective)`` of ``cfg`` (or of ``model``, built
    from it by :func:`model_with_path_values`) on the fixture."""
    model = model_with_path_values(cfg) if model is None else model
    ids = tokens() % cfg.vocab_size
    # eager: every case's forward is a program of its own under jit (56 programs, 37 s of
    # compiles on a v5e, reports/compile-tpu-v5e.jsonl); op by op, the cases share the
    # small programs of their operations (all tiny presets: d_model 72, 264 tokens)
    logits, aux = model.forward(ids)
    targets = jnp.ones((BATCH, SEQ - 1), bool)
    nll = token_nll(logits, ids, targets) / targets.sum()
    weight = 0.0 if cfg.moe is None else cfg.moe.aux_loss_weight
    return np.asarray(logits), float(nll + weight * aux["moe_aux_loss"])


@functools.cache
def tokens() -> jax.Array:
    return jax.random.randint(jax.random.key(7), (BATCH, SEQ), 0, 264, dtype=jnp.int32)


@functools.cache
def base_outputs(preset: str):
    return outputs(get_config(preset))


@pytest.mark.parametrize("field", sorted(PERTURBATIONS), ids=lambda f: f"{f[0]}.{f[1]}")
@pytest.mark.wiring
def test_perturbing_the_field_changes_the_logits_or_the_objective(field):
    preset, change = PERTURBATIONS[field]
    base = get_config(preset)
    changed = change(base)
    owner, name = field
    assert changed != base, f"the perturbation of {owner}.{name} changed nothing in the config"
    shapes0 = {k: v.shape for k, v in abstract_params(base).items()}
    model = model_with_path_values(changed)  # one abstract build serves shapes and values
    state = nnx.state(model, nnx.Param)
    leaves = jax.tree_util.tree_leaves_with_path(state, is_leaf=is_variable)
    shapes1 = {path_name(p): _compat.variable_value(v).shape for p, v in leaves}
    assert "model.norm.scale" in shapes0.keys() & shapes1.keys()  # one naming for both
    if any(shapes0[k] != shapes1[k] for k in shapes0.keys() & shapes1.keys()):
        return  # a shared parameter changed shape: the field shapes the model
    logits0, objective0 = base_outputs(preset)
    logits1, objective1 = outputs(changed, model)
    assert logits0.shape == logits1.shape
    logit_change = float(np.abs(logits1 - logits0).max())
    assert logit_change > MIN_LOGIT_CHANGE or abs(objective1 - objective0) > 1e-6, (
        f"{owner}.{name}: perturbing it on {preset} changed the logits by only "
        f"{logit_change:.2e} and the objective by {abs(objective1 - objective0):.2e}"
    )
