"""Fold adapters into the base weights and take them out again.

``merge_lora`` returns a plain model (no Qwix, no adapters) whose adapted
weights are ``W + (alpha / rank) A.B``; QLoRA base weights are dequantised
first. ``unmerge_lora`` subtracts the same deltas, computed by the same
program, so ``unmerge_lora(merge_lora(m), m)`` gives back the base weights to
float32 rounding.
"""

from __future__ import annotations

import functools

import jax
from flax import nnx

from posttrain import _compat
from posttrain.lora import layout
from posttrain.lora.config import lora_config_of
from posttrain.models.causal_lm import CausalLM
from posttrain.tree import path_name


def _scale(model: nnx.Module) -> float:
    return lora_config_of(model).scale


@functools.partial(jax.jit, static_argnames=("specs", "scale", "sign"))
def _shifted(weights, factors, *, specs, scale, sign):
    """``weights[k] + sign * scale * A.B`` for each adapter ``k`` (one program for all)."""
    out = {}
    for key, (a_dims, ndim, stacked) in specs:
        a, b = factors[key]
        delta = layout.weight_delta(a, b, a_dims, ndim, stacked, scale)  # [(L,) weight dims]
        w = weights[key]
        out[key] = (w.astype(delta.dtype) + sign * delta).astype(w.dtype)
    return out


def _adapters(model) -> dict[str, layout.Adapter]:
    return {ad.key: ad for ad in layout.iter_adapters(model)}


def lora_deltas(model: nnx.Module) -> dict[str, jax.Array]:
    """``(alpha / rank) A.B`` of every adapted weight, float32, by the weight's dotted path.

    Raises:
      ValueError: ``model`` has no ``lora_config`` (not built by ``apply_lora``).
    """
    scale = _scale(model)
    return {key: ad.delta(scale) for key, ad in _adapters(model).items()}


def base_weights(model: nnx.Module) -> dict[tuple, jax.Array]:
    """The base model's parameters of a LoRA model by path; QLoRA weights dequantised."""
    out, quantised = {}, set()
    for path, var in nnx.to_flat_state(nnx.state(model)):
        if type(var) is nnx.Param and len(path) > 2 and path[-2] == "array":
            quantised.add(path[:-2])
        elif type(var) is nnx.Param:
            out[path] = _compat.variable_value(var)
    for path in sorted(quantised, key=str):
        qarray = layout.walk(model, path).array
        values = jax.tree.map(
            _compat.variable_value, qarray, is_leaf=lambda x: isinstance(x, nnx.Variable)
        )
        out[path] = _compat.qwix_dequantize(values)
    return out


def _plain_model(cfg, values: dict[tuple, jax.Array]) -> CausalLM:
    """A ``CausalLM`` of ``cfg`` holding ``values`` (no parameters initialised)."""
    abstract = nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    flat = [(path, var.replace(values[path])) for path, var in nnx.to_flat_state(state)]
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _shift(
    weights: dict[tuple, jax.Array], adapters: dict[str, layout.Adapter], scale: float, sign: int
) -> dict[tuple, jax.Array]:
    by_key = {path_name(path): path for path in weights}
    missing = sorted(set(adapters) - set(by_key))
    if missing:
        raise ValueError(f"adapted weights {missing[:4]} are not in the model")
    specs = tuple(
        (key, (ad.a_dims, len(ad.weight_shape) - ad.stacked, ad.stacked))
        for key, ad in adapters.items()
    )
    shifted = _shifted(
        {k: weights[by_key[k]] for k in adapters},
        {k: (ad.a, ad.b) for k, ad in adapters.items()},
        specs=specs,
        scale=scale,
        sign=sign,
    )
    return {**weights, **{by_key[k]: v for k, v in shifted.items()}}


def merge_lora(model: nnx.Module) -> CausalLM:
    """A plain ``CausalLM`` whose adapted weights include their adapters.

    Its logits equal the LoRA model's (up to rounding, and to the quantisation
    of QLoRA base weights, which are dequantised here).
    """
    weights = _shift(base_weights(model), _adapters(model), _scale(model), +1)
    return _plain_model(model.config, weights)


def unmerge_lora(merged: CausalLM, lora_model: nnx.Module) -> CausalLM:
    """A plain ``CausalLM``: ``merged`` with ``lora_model``'s adapters taken out again.

    Args:
      merged: a plain model, e.g. from :func:`merge_lora`.
      lora_model: the LoRA model whose adapters to subtract.
    """
    weights = {
        path: _compat.variable_value(var)
        for path, var in nnx.to_flat_state(nnx.state(merged, nnx.Param))
    }
    weights = _shift(weights, _adapters(lora_model), _scale(lora_model), -1)
    return _plain_model(merged.config, weights)
