"""``apply_lora``: Qwix LoRA / QLoRA on a placed model, on any mesh the model allows.

Steps (qwix 0.1.8):

1. Check the LoRA config against the model and the mesh (:mod:`.checks`: routed experts
   need the ``dense`` algorithm; QLoRA needs ``dtype == param_dtype``; the mesh must
   divide the model; the target must match a module).
2. Trace Qwix's initialisation pass abstractly (``nnx.eval_shape``: no FLOPs, no
   compile) under :func:`posttrain.sharding.use_mesh`, on dummy tokens
   ``[batch, seq]`` with batch = :func:`~posttrain.sharding.data_parallel_size`
   and seq = :func:`~posttrain.sharding.sequence_parallel_size`, both read from
   the logical-axis rules: the activation constraints apply as in training, and a
   dummy batch the batch axes do not divide fails (DESIGN.md regression 3). The
   decoder runs its layers unrolled, a scanned block as its first layer only
   (:func:`posttrain.models.decoder.unrolled_layers`) so that the params Qwix adds
   stay in the model. The model is closed over, not traced, and keys come from
   ``_compat.tracing_rngs``: a tracer's ``.sharding`` (which Qwix reads per adapted
   weight) walks the whole trace, which made the pass quadratic in the layer count.
   QLoRA first runs Qwix's PTQ pass the same way and materialises the quantised
   kernels (step 3), then the LoRA pass on that concrete quantised model: traced in
   the same pass, the quantised kernels were tracers again (qwen3-0.6b int8: 196
   reads; ``apply_lora`` 35-39 s before, 10.8 s now, ``benchmarks/lora_apply.py``).
   Two Qwix passes, not one provider for both: in one pass a scanned layer gets no
   adapters (once the quantised kernel is swapped in, qwix's ``find_param`` follows
   the layer slice back to the stacked array).
   Qwix intercepts ``CausalLM.forward``, which ``__call__`` (Tunix) calls too.
3. Materialise: base variables from the model; adapters A (Qwix's initialiser)
   and B (zeros) shaped after the unquantised weights, and the quantised kernels
   computed by one jit per kernel shape, straight into shardings derived from the base
   weight's logical axes.
4. Verify (:mod:`.checks`): adapters exist; only ``Param`` / ``LoRAParam`` variables remain, so
   ``nnx.split``/``merge``, jit and grad see plain state.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import qwix
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from posttrain import _compat, sharding
from posttrain.layers.mlp import qwix_pass
from posttrain.lora import checks, layout
from posttrain.lora.config import LoraConfig
from posttrain.models.decoder import unrolled_layers
from posttrain.tree import path_name

_QARRAY_LEAVES = ("qvalue", "scale", "zero_point")


def dummy_batch_shape(
    mesh: Mesh, rules: sharding.Rules = sharding.DEFAULT_RULES
) -> tuple[int, int]:
    """``(batch, seq)`` of the tokens Qwix's initialisation pass is traced on.

    batch is the product of the mesh axes that shard ``activation_batch``
    (data x fsdp x fsdp_transpose x expert under the default rules), seq the
    product of those that shard ``activation_length`` (tensor_sequence x context):
    the smallest shapes every activation constraint accepts.
    """
    return sharding.data_parallel_size(mesh, rules), sharding.sequence_parallel_size(mesh, rules)


def module_paths(model: nnx.Module) -> list[str]:
    """Qwix module paths of ``model`` (``model/layers/0/self_attn/q_proj`` ...), in graph order."""
    return ["/".join(map(str, path)) for path, _ in _compat.iter_modules(model) if path]


def lora_params(model: nnx.Module) -> dict[str, jax.Array]:
    """Every ``nnx.LoRAParam`` of ``model`` by dotted path (``...q_proj.kernel_lora_a``)."""
    state = nnx.state(model, nnx.LoRAParam)
    return {path_name(p): _compat.variable_value(v) for p, v in nnx.to_flat_state(state)}


def _qwix_rngs(lora_config: LoraConfig) -> dict:
    """``{"rngs": ...}`` where Qwix's passes take them (qwix >= 0.1.5), else ``{}``."""
    if not _compat.qwix_takes_rngs(qwix.apply_lora_to_model):
        return {}
    return {"rngs": _compat.tracing_rngs(lora_config.seed)}


def _qwix_rule(lora_config: LoraConfig) -> dict:
    return dict(
        module_path=lora_config.target_regex,
        weight_qtype=lora_config.weight_qtype,
        tile_size=lora_config.tile_size,
    )


def _ptq_pass(model, tokens, lora_config: LoraConfig):
    """Qwix's PTQ pass (QLoRA's quantised base weights); run under ``nnx.eval_shape``."""
    with unrolled_layers(), qwix_pass():
        provider = qwix.PtqProvider([qwix.QuantizationRule(**_qwix_rule(lora_config))])
        return qwix.quantize_model(
            model,
            provider,
            tokens,
            methods=("forward",),
            **_qwix_rngs(lora_config),
        )


def _lora_pass(model, tokens, lora_config: LoraConfig):
    """Qwix's LoRA initialisation pass on ``model``; run under ``nnx.eval_shape``."""
    rule = qwix.LoraRule(
        rank=lora_config.rank,
        alpha=lora_config.alpha,
        dropout=lora_config.dropout,
        **_qwix_rule(lora_config),
    )
    with unrolled_layers(), qwix_pass():
        return qwix.apply_lora_to_model(
            model,
            qwix.LoraProvider([rule]),
            tokens,
            methods=("forward",),
            **_qwix_rngs(lora_config),
        )


def _placed(axes, shape, mesh: Mesh, rules) -> NamedSharding:
    spec = jax.sharding.PartitionSpec()
    if axes is not None:
        spec = sharding.logical_to_spec(axes, shape, dict(mesh.shape), rules)
    return NamedSharding(mesh, spec)


def _derived_axes(weight_axes, weight_shape, shape):
    """Axes of a quantised leaf: the weight's where the dim is unchanged, else None."""
    if weight_axes is None or len(shape) != len(weight_shape):
        return None
    return tuple(
        a if s == w else None for a, s, w in zip(weight_axes, shape, weight_shape, strict=True)
    )


def _adapter_values(specs, seed: int, mesh, rules) -> dict:
    """A (he-uniform, Qwix's default) and B (zeros) for each spec, placed in their shardings.

    Drawn on the host with numpy: an XLA random-init program for a few dozen
    shapes takes seconds to compile on CPU, and adapters are small. A's fan-in is
    the product of its per-layer dims but the rank (all of them meet the input).
    """
    rng = np.random.default_rng(seed)
    out = {}
    for path, (kind, shape, dtype, axes, stacked) in specs.items():
        if kind == "b":
            value = np.zeros(shape, dtype)
        else:
            bound = np.sqrt(6.0 / np.prod(shape[stacked:-1]))
            value = rng.uniform(-bound, bound, shape).astype(dtype)
        out[path] = jax.device_put(value, _placed(axes, shape, mesh, rules))
    return out


def _quantised_values(abstract, base_flat, kernels, mesh, rules) -> dict:
    """The quantised leaves (qvalue, scale ...) of each kernel Qwix quantised, placed."""
    hows, inputs, out_specs = {}, {}, {}
    for kernel_path, leaves in kernels.items():
        base = base_flat[kernel_path]
        stacked = layout.is_stacked(sharding.variable_logical_axes(base))
        hows[kernel_path] = (layout.walk(abstract, kernel_path).how, stacked)
        inputs[kernel_path] = _compat.variable_value(base)
        for path, var in leaves.items():
            axes = _derived_axes(
                sharding.variable_logical_axes(base), inputs[kernel_path].shape, var.shape
            )
            out_specs[path] = (axes, _placed(axes, var.shape, mesh, rules))

    # One jit per distinct (how, layout, shardings), called for every kernel that shares
    # it: a model's kernels come in a few shapes (qwen3-0.6b: 196 kernels, 7 shapes), and
    # compiling one program for all of them cost more than it saved (qwen3-0.6b int8 on
    # 8 fake CPU devices: 9.0 s for the one program, 4.8 s for the seven, both compiled).
    quantisers, values = {}, {}
    for kernel_path, leaves in kernels.items():
        how, stacked = hows[kernel_path]
        names = tuple(path[-1] for path in leaves)
        outs = tuple(out_specs[path][1] for path in leaves)
        key = (repr(how), stacked, names, outs)
        if key not in quantisers:

            def quantise(w, how=how, stacked=stacked, names=names):
                def one(x):
                    return _compat.qwix_quantize(x, how)

                q = jax.vmap(one)(w) if stacked else one(w)  # per layer, as in the scan body
                return tuple(getattr(q, name) for name in names)

            quantisers[key] = jax.jit(quantise, out_shardings=outs)
        # Waited for one by one: programs with collectives in flight together can stall
        # XLA:CPU's rendezvous on fake devices (all-reduce "only 6 of 8 arrived", abort).
        quantised = jax.block_until_ready(quantisers[key](inputs[kernel_path]))
        for path, value in zip(leaves, quantised, strict=True):
            values[path] = (value, out_specs[path][0])
    return values


def _adapter_specs(adapters, base_flat, abstract) -> dict:
    """``path -> (kind 'a'/'b', shape, dtype, logical axes, stacked)`` of each new adapter."""
    specs = {}
    for path, var in adapters.items():
        weight, kind = path[-1].rsplit("_lora_", 1)
        w_var = base_flat[(*path[:-1], weight)]
        w_axes = sharding.variable_logical_axes(w_var)
        stacked = layout.is_stacked(w_axes)
        w_shape = np.shape(_compat.variable_value(w_var))
        a_shape = adapters[(*path[:-1], weight + layout.LORA_A)].shape
        b_shape = adapters[(*path[:-1], weight + layout.LORA_B)].shape
        a_dims = layout.adapter_dims(
            layout.walk(abstract, path[:-1]),
            weight,
            w_shape[stacked:],
            a_shape[stacked:-1],
            b_shape[stacked + 1 :],
        )
        axes = layout.adapter_axes(w_axes, a_dims, stacked)[kind == "b"]
        specs[path] = (kind, tuple(var.shape), var.dtype, axes, stacked)
    return specs


def _materialise(model, abstract, lora_config: LoraConfig, mesh, rules, *, weights=None):
    """``abstract``'s graph with ``model``'s values, new adapters and quantised kernels.

    ``weights``: the model whose (unquantised) weights give each adapter its shape and
    logical axes, when ``model`` holds them quantised (QLoRA); default ``model``.
    """
    graphdef, abs_state = nnx.split(abstract)
    base_flat = dict(nnx.to_flat_state(nnx.state(model)))
    weight_flat = base_flat if weights is None else dict(nnx.to_flat_state(nnx.state(weights)))
    flat, adapters, kernels = {}, {}, {}
    for path, var in nnx.to_flat_state(abs_state):
        if path in base_flat and type(var) is type(base_flat[path]):
            flat[path] = base_flat[path].replace(_compat.variable_value(base_flat[path]))
        elif isinstance(var, nnx.LoRAParam):
            adapters[path] = var
        elif (
            len(path) > 2
            and path[-2] == "array"
            and path[-1] in _QARRAY_LEAVES
            and path[:-2] in base_flat
        ):
            kernels.setdefault(path[:-2], {})[path] = var
        else:
            raise ValueError(
                f"Qwix added {path_name(path)} ({type(var).__name__}), which "
                f"apply_lora does not know how to place"
            )
    specs = _adapter_specs(adapters, weight_flat, abstract)
    for path, value in _adapter_values(specs, lora_config.seed, mesh, rules).items():
        flat[path] = adapters[path].replace(value, logical_axes=specs[path][3])
    if kernels:
        for path, (value, axes) in _quantised_values(
            abstract, base_flat, kernels, mesh, rules
        ).items():
            flat[path] = kernels[path[:-2]][path].replace(value, logical_axes=axes)
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def apply_lora(
    model: nnx.Module,
    mesh: Mesh,
    lora_config: LoraConfig,
    rules: sharding.Rules = sharding.DEFAULT_RULES,
    *,
    dummy_shape: tuple[int, int] | None = None,
) -> nnx.Module:
    """Adds Qwix LoRA (QLoRA with ``weight_qtype``) adapters to a placed ``CausalLM``.

    Args:
      model: a base model placed on ``mesh`` (``posttrain.models.build_model``);
        left unchanged.
      mesh: the mesh the model is placed on.
      lora_config: rank, alpha, targets, QLoRA type.
      rules: the logical-axis rules the model was placed with.
      dummy_shape: ``(batch, seq)`` of the traced tokens; default
        :func:`dummy_batch_shape` (tests pass others to show what a wrong one does).

    Returns:
      A new model (Qwix's subclass of the model's class, whose ``forward`` and so
      ``__call__`` add the adapters) with ``nnx.LoRAParam`` adapters placed on
      ``mesh``, B = 0 (so its logits equal the base model's), and
      ``lora_config`` as an attribute. Train ``nnx.LoRAParam`` only.

    Raises:
      ValueError: the mesh does not divide the model; the target matches no
        module (the message lists module paths) or matched modules got no
        adapters (it lists them); experts targeted without the dense algorithm;
        QLoRA with dtype != param_dtype; the model already has adapters; a dummy
        shape the mesh axes do not divide (from the activation constraints); a rank
        above min(d_in, d_out) of an adapted weight (naming it).
      NotImplementedError: ``dropout > 0``.
    """
    if nnx.state(model, nnx.LoRAParam):
        raise ValueError("model already has LoRA params; apply_lora takes a base model")
    lora_config = lora_config.for_model(model.config)
    target = lora_config.target_regex
    paths = module_paths(model)
    matched = [p for p in paths if re.fullmatch(target, p)]
    if not matched:
        raise ValueError(
            f"LoRA target {target!r} matches no module path of {model.config.family}; "
            f"paths look like: {checks.example_paths(paths)}"
        )
    checks.check_config(model, lora_config, mesh, rules, matched)
    batch, seq = dummy_shape or dummy_batch_shape(mesh, rules)
    tokens = jnp.zeros((batch, seq), jnp.int32)
    # Models are closed over, not arguments: their params stay concrete arrays, so Qwix
    # reads their NamedSharding (``_get_or_create_lora_params``) instead of asking a
    # tracer, whose AttributeError message walks the whole trace so far (quadratic).
    base = model
    if lora_config.weight_qtype:
        # QLoRA: quantise for real first, so that the LoRA pass reads concrete quantised
        # kernels (traced in the same pass, each read walked the PTQ trace).
        with sharding.use_mesh(mesh, rules):
            quantised = nnx.eval_shape(lambda: _ptq_pass(model, tokens, lora_config))
        base = _materialise(model, quantised, lora_config, mesh, rules)
    with sharding.use_mesh(mesh, rules):
        abstract = nnx.eval_shape(lambda: _lora_pass(base, tokens, lora_config))
    if not nnx.state(abstract, nnx.LoRAParam):
        raise ValueError(
            f"LoRA target {target!r} matched {len(matched)} modules ({', '.join(matched[:8])}"
            f"{' ...' if len(matched) > 8 else ''}) but Qwix created no nnx.LoRAParam: none of "
            f"them multiplies a parameter in an einsum or dot_general Qwix intercepts"
        )
    checks.check_rank(abstract, lora_config.rank)
    lora_model = _materialise(base, abstract, lora_config, mesh, rules, weights=model)
    lora_model.lora_config = lora_config
    checks.verify_state(lora_model)
    return lora_model
