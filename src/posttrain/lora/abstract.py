"""``abstract_lora``: Qwix LoRA / QLoRA on an abstract model, nothing allocated.

:func:`posttrain.lora.apply_lora` needs a placed, concrete model: Qwix reads each
adapted weight's ``NamedSharding``, and the adapters are drawn as real arrays.
Planning a slice that is not there (:mod:`posttrain.plan`) cannot afford either:
a 70B model does not fit in this machine's memory. The abstract route (qwix 0.1.8):

1. The same checks as ``apply_lora`` (mesh divides the model, experts need the
   dense algorithm, QLoRA needs ``dtype == param_dtype``, a matching target).
2. Qwix's passes are traced with the abstract model as an *argument* of
   ``nnx.eval_shape`` (its ``jax.ShapeDtypeStruct`` values become tracers; a closed-over
   model would feed ShapeDtypeStructs to ``jnp``). Qwix asks a tracer for its sharding,
   gets ``None`` and creates the adapters unplaced, which is fine: nothing is placed here.
   QLoRA runs the PTQ pass first and the LoRA pass on its abstract result, as
   ``apply_lora`` does with concrete values.
3. Qwix copies the weight's metadata onto its adapters, so an adapter claims the
   weight's ``logical_axes`` (``[D, N, H]`` for an ``[D, r]`` A). They are replaced
   by the axes ``apply_lora`` gives the real adapters (:func:`posttrain.lora.layout.adapter_axes`
   through ``apply._adapter_specs``), and each quantised leaf gets the weight's axes where
   its dim is unchanged, so that :func:`posttrain.sharding.state_shardings` places the
   abstract model exactly as ``apply_lora`` places the real one.
"""

from __future__ import annotations

import re

import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from posttrain import sharding
from posttrain.lora import apply, checks
from posttrain.lora.config import LoraConfig


def abstract_lora(
    model: nnx.Module,
    mesh: Mesh,
    lora_config: LoraConfig,
    rules: sharding.Rules = sharding.DEFAULT_RULES,
    *,
    dummy_shape: tuple[int, int] | None = None,
) -> nnx.Module:
    """The LoRA (QLoRA with ``weight_qtype``) model of an abstract ``model``, abstract too.

    Args:
      model: a ``CausalLM`` whose variables hold ``jax.ShapeDtypeStruct`` values with
        ``logical_axes`` metadata (``nnx.eval_shape`` of its constructor).
      mesh: the mesh it will be planned on (only its axis sizes are read: the dummy
        batch and the divisibility checks); its devices need not exist here.
      lora_config: rank, alpha, targets, QLoRA type.
      rules: the logical-axis rules.
      dummy_shape: ``(batch, seq)`` of the traced tokens; default
        :func:`posttrain.lora.dummy_batch_shape` (tests pass others, e.g. the seed's old
        ``(1, 1)``, to show what a wrong one does on a large slice).

    Returns:
      Qwix's LoRA model, abstract: ``nnx.LoRAParam`` adapters and (QLoRA) quantised
      kernels as ``jax.ShapeDtypeStruct`` with the ``logical_axes`` ``apply_lora``
      would give them.

    Raises:
      ValueError, NotImplementedError: as :func:`posttrain.lora.apply_lora`.
    """
    lora_config = lora_config.for_model(model.config)
    target = lora_config.target_regex
    matched = [p for p in apply.module_paths(model) if re.fullmatch(target, p)]
    if not matched:
        raise ValueError(f"LoRA target {target!r} matches no module path of {model.config.family}")
    checks.check_config(model, lora_config, mesh, rules, matched)
    tokens = jnp.zeros(dummy_shape or apply.dummy_batch_shape(mesh, rules), jnp.int32)
    base = model
    with sharding.use_mesh(mesh, rules, jax_context=False):
        if lora_config.weight_qtype:
            base = nnx.eval_shape(lambda m: apply._ptq_pass(m, tokens, lora_config), model)
        lora_model = nnx.eval_shape(lambda m: apply._lora_pass(m, tokens, lora_config), base)
    if not nnx.state(lora_model, nnx.LoRAParam):
        raise ValueError(f"LoRA target {target!r} matched {matched[:4]} but Qwix added no adapters")
    checks.check_rank(lora_model, lora_config.rank)
    _set_axes(lora_model, model)
    lora_model.lora_config = lora_config
    return lora_model


def _set_axes(lora_model: nnx.Module, weights: nnx.Module) -> None:
    """Gives each adapter and quantised leaf of ``lora_model`` its own logical axes (in
    place); ``weights`` is the unquantised abstract model the adapters were shaped after."""
    weight_flat = dict(nnx.to_flat_state(nnx.state(weights)))
    flat = nnx.to_flat_state(nnx.state(lora_model))
    adapters = {p: v for p, v in flat if isinstance(v, nnx.LoRAParam)}
    specs = apply._adapter_specs(adapters, weight_flat, lora_model)
    for path, var in flat:
        if path in specs:
            var.set_metadata("logical_axes", specs[path][3])
        elif len(path) > 2 and path[-2] == "array" and path[:-2] in weight_flat:
            base = weight_flat[path[:-2]]
            axes = apply._derived_axes(
                sharding.variable_logical_axes(base), base.get_value().shape, var.get_value().shape
            )
            var.set_metadata("logical_axes", axes)
