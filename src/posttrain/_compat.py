"""Every upstream-version shim of the library, detected by feature.

Each entry names the upstream version where the behaviour changed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax._src import compilation_cache, monitoring
from jax.sharding import Mesh


def make_mesh(shape: Sequence[int], axis_names: Sequence[str], devices) -> Mesh:
    """A mesh with ``AxisType.Auto`` axes where JAX has axis types (jax >= 0.5)."""
    device_array = np.asarray(devices, dtype=object).reshape(tuple(shape))
    axis_type = getattr(jax.sharding, "AxisType", None)
    if axis_type is not None:
        try:
            return Mesh(device_array, tuple(axis_names), axis_types=(axis_type.Auto,) * len(shape))
        except TypeError:  # jax < 0.5: Mesh takes no axis_types
            pass
    return Mesh(device_array, tuple(axis_names))


def set_mesh(mesh: Mesh):
    """Context manager making ``mesh`` JAX's current mesh.

    ``jax.set_mesh`` appeared in jax 0.7; before it, ``with mesh:``.
    """
    if hasattr(jax, "set_mesh"):
        return jax.set_mesh(mesh)
    if hasattr(jax.sharding, "use_mesh"):  # jax 0.5-0.6
        return jax.sharding.use_mesh(mesh)
    return mesh if isinstance(mesh, contextlib.AbstractContextManager) else contextlib.nullcontext()


def on_one_device(device):
    """Context manager making ``device`` the only device of JAX's current mesh, if one is set.

    Inside ``jax.set_mesh(mesh)`` a jitted function refuses arguments committed to a device
    outside ``mesh`` ("incompatible devices for jitted computation"), so a computation
    moved to the host's CPU under a TPU mesh needs a mesh of that CPU: the current mesh's
    axis names, each of size 1, on ``device``. No current mesh (or jax < 0.5, without
    ``jax.sharding.get_abstract_mesh``): nothing to replace.
    """
    get_abstract_mesh = getattr(jax.sharding, "get_abstract_mesh", None)
    names = tuple(get_abstract_mesh().axis_names) if get_abstract_mesh is not None else ()
    if not names:
        return contextlib.nullcontext()
    return set_mesh(make_mesh((1,) * len(names), names, [device]))


def module_list(modules):
    """A list of modules stored as graph data: ``nnx.List`` (flax >= 0.12), else a list."""
    return nnx.List(modules) if hasattr(nnx, "List") else list(modules)


def variable_value(variable: nnx.Variable):
    """The raw value of a variable (also abstract ones).

    flax 0.12.8 deprecates ``Variable.value`` in favour of ``get_value()``;
    older releases only have ``.value``.
    """
    getter = getattr(variable, "get_value", None)
    return getter() if getter is not None else variable.value


def set_variable_value(variable: nnx.Variable, value) -> None:
    """Sets a variable's value: ``set_value`` (flax >= 0.12.1), else ``.value =``
    (the setter flax 0.12.8 deprecates)."""
    setter = getattr(variable, "set_value", None)
    if setter is not None:
        setter(value)
    else:
        variable.value = value


def next_rng_key(stream) -> jax.Array:
    """The next key of an ``nnx.RngStream`` (``rngs.params``): the key ``stream()`` returns.

    Same key and counter update as ``stream()``, without its cost under tracing from
    flax 0.12.1 (not in 0.11.2 or 0.12.0): there ``count[...] += 1`` runs
    ``Variable.set_value(index=...)``, which compares ``getattr(value, 'sharding', None)``;
    on a tracer that raises an AttributeError whose message (jax
    ``DynamicJaxprTracer._origin_msg``) walks every equation traced so far, so building
    a model cost time quadratic in its parameter count (llama3-8b ``eval_shape``: 3.5 s
    against 0.5 s, ``benchmarks/model_init.py``). ``set_value`` without an index does no
    comparison. Without ``set_value`` (flax 0.11): ``RngStream.__call__``.
    """
    count = stream.count
    if not hasattr(count, "set_value"):
        return nnx.RngStream.__call__(stream)  # the base class's: _TracingStream calls here
    check = getattr(count, "_check_can_update", None)  # what stream() checks first
    if check is not None:
        check()
    value = count.get_value()
    key = jax.random.fold_in(stream.key.get_value(), value)
    count.set_value(value + 1)
    return key


class _TracingStream(nnx.RngStream):
    """An ``nnx.RngStream`` whose call is :func:`next_rng_key`: the same keys."""

    def __call__(self) -> jax.Array:
        return next_rng_key(self)


def tracing_rngs(seed: int) -> nnx.Rngs:
    """``nnx.Rngs(seed)`` for code we do not own that draws keys while tracing (Qwix's
    ``module.qwix_rngs.params()`` per LoRA param): same keys, each stream drawing through
    :func:`next_rng_key`, so flax >= 0.12.1's per-draw walk over the trace so far does not
    make the draws quadratic (the Qwix pass of apply_lora, ``benchmarks/lora_apply.py``).
    """
    rngs = nnx.Rngs(seed)
    for name, stream in list(vars(rngs).items()):
        if type(stream) is nnx.RngStream:
            setattr(rngs, name, _TracingStream(variable_value(stream.key), tag=stream.tag))
    return rngs


def scalar_listeners() -> list:
    """The callbacks registered with ``jax.monitoring.register_scalar_listener``.

    jax exports no getter; ``jax._src.monitoring.get_scalar_listeners`` is in every
    release we support (0.7.2-0.10.2).
    """
    return list(monitoring.get_scalar_listeners())


def unregister_scalar_listener(listener) -> None:
    """``jax.monitoring.unregister_scalar_listener`` (jax >= 0.8); before, removed from
    ``jax._src.monitoring``'s list. Nothing when ``listener`` is not registered."""
    if not any(listener is known for known in scalar_listeners()):
        return
    unregister = getattr(jax.monitoring, "unregister_scalar_listener", None)
    if unregister is not None:
        unregister(listener)
    else:
        monitoring._scalar_listeners.remove(listener)


_single_replica = {"lock": threading.Lock(), "depth": 0, "before": None}


@contextlib.contextmanager
def single_replica_array_saves():
    """While active, Orbax saves every replicated ``jax.Array`` from one replica.

    Orbax's ``ArrayHandler`` (orbax-checkpoint 0.11-0.12) is replica-parallel by default
    (not when ``JAX_PLATFORMS`` names gpu/cuda): it splits each replicated array between
    its replicas along an axis of the shard that the replica count divides, so that
    several *hosts* write it together, with one eager ``jax.lax.slice_in_dim`` per
    replica per array, each a separate XLA dispatch (and compile, per new shape). In one
    process there is no other host to share the writes with, and on CPU the slices are
    pure overhead: a llama3-tiny + Adam save on 8 fake devices (``data=2``) takes 0.70 s
    replica-parallel against 0.45 s (``benchmarks/checkpoint_save.py``). The bytes
    written are the same either way, so restores do not care which mode saved.

    Switches the registered handler's ``_use_replica_parallel`` (a private attribute in
    every orbax-checkpoint 0.11.25-0.12.8 we pin; pinned by ``contracts/``) off and, when
    the last overlapping user leaves (any thread), back to what it was. Process-global
    while active, like Orbax's registry. A handler without the attribute is left alone.
    """
    import orbax.checkpoint as ocp

    handler = ocp.type_handlers.get_type_handler(jax.Array)
    if getattr(handler, "_use_replica_parallel", None) is None:
        yield
        return
    state = _single_replica
    with state["lock"]:
        if state["depth"] == 0:
            state["before"] = handler._use_replica_parallel
            handler._use_replica_parallel = False
        state["depth"] += 1
    try:
        yield
    finally:
        with state["lock"]:
            state["depth"] -= 1
            if state["depth"] == 0:
                handler._use_replica_parallel = state["before"]


def iter_modules(module: nnx.Module):
    """``(path, module)`` pairs of every module in ``module``'s graph.

    ``nnx.iter_modules`` from flax 0.12.x; before, the ``Module.iter_modules``
    method (deprecated in flax 0.12.8).
    """
    fn = getattr(nnx, "iter_modules", None)
    return fn(module) if fn is not None else module.iter_modules()


def qwix_takes_rngs(apply_lora_to_model) -> bool:
    """Whether Qwix's ``apply_lora_to_model`` / ``quantize_model`` accept ``rngs=``.

    Before qwix 0.1.5 ``apply_lora_to_model`` is a plain alias of
    ``quantize_model`` (its ``__name__`` says so) and ``rngs=`` is passed on to
    the model call (TypeError); from 0.1.5 both pop it and set the modules'
    ``qwix_rngs``. Takes the function so this module does not import Qwix.
    """
    return getattr(apply_lora_to_model, "__name__", "") != "quantize_model"


def global_norm(tree) -> jax.Array:
    """L2 norm over all leaves: ``optax.tree.norm`` (optax >= 0.2.5), else ``optax.global_norm``.

    optax 0.2.8 deprecates ``global_norm`` with a DeprecationWarning.
    """
    tree_api = getattr(optax, "tree", None)
    if tree_api is not None and hasattr(tree_api, "norm"):
        return tree_api.norm(tree)
    return optax.global_norm(tree)


def multisteps_window_gradient(opt_state, grads):
    """The gradient ``optax.MultiSteps`` applies if this micro-step ends its window.

    ``MultiSteps`` (use_grad_mean, its default and Tunix's) keeps the running mean of
    the window's micro-gradients in ``acc_grads``, ``mini_step`` of them so far, and
    when the window closes it hands the inner optimizer
    ``acc + (grads - acc) / (mini_step + 1)``: the mean of all of them. This returns
    that mean (the same pytree structure as ``grads``), or ``None`` when ``opt_state``
    is not a ``MultiStepsState`` (optax 0.1.5+; fields ``mini_step`` and
    ``acc_grads`` through optax 0.2.8). ``nnx.Optimizer`` keeps the state's arrays in
    ``OptArray`` variables (flax >= 0.11); their values are read here.

    Reference: ``optax.MultiSteps.update`` (``optax/transforms/_accumulation.py``, 0.2.8).
    """
    if not isinstance(opt_state, optax.MultiStepsState):
        return None

    def value(x):
        return variable_value(x) if isinstance(x, nnx.Variable) else x

    def is_var(x):
        return isinstance(x, nnx.Variable)

    n = value(opt_state.mini_step).astype(np.float32)
    acc = [value(a) for a in jax.tree.leaves(opt_state.acc_grads, is_leaf=is_var)]
    leaves, treedef = jax.tree.flatten(grads, is_leaf=is_var)
    if len(acc) != len(leaves):
        raise ValueError(
            f"MultiSteps accumulates {len(acc)} arrays but the step has {len(leaves)} gradients"
        )
    mean = [a + (value(g).astype(a.dtype) - a) / (n + 1) for g, a in zip(leaves, acc, strict=True)]
    return jax.tree.unflatten(treedef, mean)


def module_dtypes(cfg) -> tuple[type, type]:
    """``(compute dtype, param dtype)`` of ``cfg`` (a ``ModelConfig``) as
    :func:`module_dtype` scalar types, what every module of the model is built with."""
    return module_dtype(cfg.dtype), module_dtype(cfg.param_dtype)


def module_dtype(name) -> type:
    """The JAX scalar type (``jnp.float32``, ``jnp.bfloat16``, ...) for a dtype name or dtype.

    Modules keep their compute/param dtypes as these scalar types, as Flax's own
    layers do, never as ``numpy.dtype`` instances: Qwix <= 0.1.4's
    ``flax_util.find_param`` takes every module attribute with a ``shape`` as a
    param and reads its ``.value``; a ``numpy.dtype`` has ``shape == ()``, so
    LoRA's einsum interception raised ``AttributeError: 'numpy.dtypes.Float32DType'
    object has no attribute 'value'`` (found by the matrix, tunix-0.1.4-era).

    Raises:
        TypeError: ``name`` is not a dtype JAX knows.
    """
    dtype = jnp.dtype(name)
    scalar = getattr(jnp, dtype.name, None)
    if scalar is None:
        raise TypeError(f"dtype {name!r} has no jax.numpy scalar type")
    return scalar


def qwix_quantize(x: jax.Array, how):
    """Quantises ``x`` per Qwix's ``HowToQuantize`` ``how`` into a ``QArray``.

    ``qwix.quantize`` is public from qwix 0.1.4 (``qarray.quantize_api``); before,
    only the internal ``qwix._src.core.qarray.quantize(array, how)`` exists
    (qwix 0.1.0-0.1.3, the era pins of Tunix 0.1.0-0.1.3).
    """
    import qwix

    if hasattr(qwix, "quantize"):
        return qwix.quantize(
            x,
            how.qtype,
            channelwise_axes=how.channelwise_axes,
            tiled_axes=how.tiled_axes,
            calibration_method=how.calibration_method,
        )
    from qwix._src.core import qarray

    return qarray.quantize(x, how)


def qwix_dequantize(q) -> jax.Array:
    """``qwix.dequantize`` (qwix >= 0.1.4), else ``qwix._src.core.qarray.dequantize``."""
    import qwix

    if hasattr(qwix, "dequantize"):
        return qwix.dequantize(q)
    from qwix._src.core import qarray

    return qarray.dequantize(q)


def quantised_weight(weight):
    """A QLoRA weight (Qwix ``WithAux`` over a ``QArray`` of ``nnx.Param``) for an einsum.

    qwix <= 0.1.5's ``core.einsum`` hands a ``QArray``'s qvalue to ``jnp.einsum`` and
    finds it again by ``id`` in its ``dot_general``; with the qvalue still an
    ``nnx.Param`` (flax >= 0.12), ``jnp.einsum`` converts it to a new array and Qwix
    fails with "All qvalues should be consumed". There the leaves are unboxed into a
    new wrapper. qwix >= 0.1.6 (opt_einsum contraction) takes the wrapper as is and
    needs it to be the module's own object (it finds the weight by identity).
    """
    from qwix._src.core import einsum as qwix_einsum

    if not hasattr(qwix_einsum, "opt_einsum"):  # qwix <= 0.1.5
        return jax.tree.map(
            lambda v: variable_value(v) if isinstance(v, nnx.Variable) else v,
            weight,
            is_leaf=lambda v: isinstance(v, nnx.Variable),
        )
    return weight


def checkpoint_due(manager, step: int, force: bool = False) -> bool:
    """Whether Tunix's ``CheckpointManager.save(step, ..., force=force)`` will write a
    checkpoint: it has an Orbax manager (``_checkpoint_manager``, every release; None
    without a checkpoint directory) and ``force`` or Orbax's ``should_save(step)``."""
    orbax = getattr(manager, "_checkpoint_manager", None)
    if orbax is None:
        return False
    return bool(force) or bool(orbax.should_save(step))


def interval_checkpoint_options(save_every: int, **options):
    """Orbax ``CheckpointManagerOptions`` that save every ``save_every`` steps (and on
    preemption), with ``options`` (``max_to_keep``, ``enable_async_checkpointing``).

    Orbax's default decision adds an ``InitialSavePolicy``: a fresh run checkpoints its
    first step whatever the interval (1.7 s of a 6 s tiny SFT run here; minutes and a
    full copy of the weights on a large model). Where the option and the policies
    exist the decision is the interval and preemption only; an older Orbax keeps its
    default. Tunix's own final save is forced, so the last step is saved either way.
    The policies come from ``checkpoint_managers.save_decision_policy``: 0.11.25 (the
    matrix's older eras) exports ``PreemptionCheckpointingPolicy`` only there.
    """
    import orbax.checkpoint as ocp

    fields = {f.name for f in dataclasses.fields(ocp.CheckpointManagerOptions)}
    policies = getattr(getattr(ocp, "checkpoint_managers", None), "save_decision_policy", None)
    names = ("AnySavePolicy", "FixedIntervalPolicy", "PreemptionCheckpointingPolicy")
    if "save_decision_policy" in fields and all(hasattr(policies, n) for n in names):
        options["save_decision_policy"] = policies.AnySavePolicy(
            [policies.FixedIntervalPolicy(save_every), policies.PreemptionCheckpointingPolicy()]
        )
    return ocp.CheckpointManagerOptions(save_interval_steps=save_every, **options)


@contextlib.contextmanager
def no_persistent_compilation_cache():
    """JAX's persistent compilation cache off inside (deviceless TPU compiles: a
    compile-only client cannot load a cached executable, jax 0.10.2: "PjRtCompiler must be
    constructed with a Client to call DeserializeLoadedExecutable").

    JAX decides once per process whether the cache is used (``is_cache_used`` caches it),
    so the flag alone does nothing after the first compile: the decision is reset on the
    way in and out (``jax._src.compilation_cache.reset_cache``, jax 0.4.31+), and the next
    compile outside decides again under the restored flag.
    """
    was = jax.config.jax_enable_compilation_cache
    compilation_cache.reset_cache()
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
        compilation_cache.reset_cache()
