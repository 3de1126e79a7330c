"""Flat views of a model's parameters (dotted path -> array), and building a placed model.

Paths are the attribute paths of the NNX module tree, e.g.
``model.layers.0.self_attn.q_proj.kernel`` (unscanned) or
``model.blocks.0.self_attn.q_proj.kernel`` (scanned, leading ``layers`` axis).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from posttrain import _compat, sharding
from posttrain.config import ModelConfig
from posttrain.distributed import host_array
from posttrain.models.causal_lm import CausalLM
from posttrain.tree import path_name


def flat_params(model: nnx.Module) -> dict[str, np.ndarray]:
    """Every ``nnx.Param`` of ``model`` as a host numpy array, by dotted path.

    Across processes, parameters sharded over several processes are gathered
    (:func:`posttrain.distributed.host_array`): every process must call this.
    """
    state = nnx.state(model, nnx.Param)
    out = {}
    for path, variable in jax.tree_util.tree_leaves_with_path(
        state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    ):
        out[path_name(path)] = host_array(_compat.variable_value(variable))
    return out


def load_flat_params(model: nnx.Module, params: Mapping[str, np.ndarray]) -> nnx.Module:
    """Replaces the values of ``model``'s params from a flat dict, in place.

    Each value keeps the sharding of the parameter it replaces.

    Raises:
      ValueError: a path is missing from or unknown to the model, or a shape or
        dtype differs (the message names the path and both values).
    """
    state = nnx.state(model, nnx.Param)
    wanted = set(params)
    seen = set()

    def one(path, variable):
        name = path_name(path)
        if name not in params:
            raise ValueError(f"parameter {name} is missing from the given params")
        new = np.asarray(params[name])
        old = _compat.variable_value(variable)
        if new.shape != old.shape or new.dtype != old.dtype:
            raise ValueError(
                f"parameter {name}: got {new.dtype}{list(new.shape)}, "
                f"expected {old.dtype}{list(old.shape)}"
            )
        seen.add(name)
        return variable.replace(jax.device_put(new, getattr(old, "sharding", None)))

    new_state = jax.tree_util.tree_map_with_path(
        one, state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    extra = sorted(wanted - seen)
    if extra:
        raise ValueError(f"params {extra[:5]} (of {len(extra)}) are not in the model")
    nnx.update(model, new_state)
    return model


_INITIALIZERS: dict[str, object] = {}


def _initializer(cfg: ModelConfig):
    """One compiled initialiser per config (cached by ``repr(cfg)``).

    Compiling the whole init once beats one eager dispatch and compile per
    parameter (about 24 s for a tiny model on 2 CPU cores), and the ``rbg`` key
    compiles about 5x faster than threefry on XLA:CPU; values differ from a
    threefry init but the distributions are the same.
    """
    key = repr(cfg)
    if key not in _INITIALIZERS:
        _INITIALIZERS[key] = nnx.jit(lambda rng: CausalLM(cfg, rngs=nnx.Rngs(rng)))
    return _INITIALIZERS[key]


#: models whose parameters take at most this many bytes are initialised on the host's CPU
#: backend when the default backend is an accelerator, then placed (:func:`init_on_host`)
HOST_INIT_BYTES = 256 * 2**20


def init_on_host(cfg: ModelConfig, backend: str | None = None) -> bool:
    """Whether :func:`build_model` initialises ``cfg`` on the host's CPU backend.

    On a TPU, compiling the jitted initialiser of even a tiny model takes 5 to 11 s
    (qwen3-tiny 4.7 s, gemma4-tiny 7.1 s: deviceless v5e compiles through libtpu, which
    matched the chip), against well under a second on XLA:CPU; copying a small model's
    parameters to the chip afterwards takes milliseconds. Large models keep the
    accelerator's own init (sharded, never whole on the host). False on the CPU, and when
    the CPU backend is not available (``JAX_PLATFORMS`` without ``cpu``).

    The values are then the CPU's: the ``rbg`` key draws from XLA's RngBitGenerator, whose
    stream is the backend's own (a v5e gives other values for every parameter), so a
    small model starts from the same parameters on a chip as on the CPU tier, and a
    large one from the accelerator's.

    Args:
      backend: the backend the model is for (default: JAX's default backend).
    """
    if (backend or jax.default_backend()) == "cpu":
        return False
    abstract = nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)))
    size = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(abstract)))
    if size > HOST_INIT_BYTES:
        return False
    try:
        jax.devices("cpu")
    except RuntimeError:
        return False
    return True


def build_model(
    cfg: ModelConfig,
    mesh: Mesh | None = None,
    *,
    seed: int = 0,
    rules: sharding.Rules = sharding.DEFAULT_RULES,
    host_init: bool | None = None,
) -> CausalLM:
    """Creates a :class:`CausalLM` and places it on ``mesh`` per its logical axes (without
    a mesh, on the default device).

    Args:
      host_init: initialise on the host's CPU backend and then place the parameters;
        ``None`` decides by :func:`init_on_host` (small models on an accelerator).

    The mesh is checked against the config first, so an unusable mesh fails
    with a one-line ``ValueError`` (e.g. "num_kv_heads=4 is not divisible by
    mesh axes tensor=8") before JAX sees it.
    """
    if mesh is not None:
        cfg.check_mesh(dict(mesh.shape), rules)
    if host_init is None:
        host_init = init_on_host(cfg)
    if not host_init:
        model = _initializer(cfg)(jax.random.key(seed, impl="rbg"))
    else:
        cpu = jax.devices("cpu")[0]
        # The key committed to the CPU: the init runs there, also under an accelerator's
        # mesh (the CLI builds inside ``sharding.use_mesh``), which then holds the CPU.
        with jax.default_device(cpu), _compat.on_one_device(cpu):
            model = _initializer(cfg)(jax.device_put(jax.random.key(seed, impl="rbg"), cpu))
        if mesh is None:
            nnx.update(model, jax.device_put(nnx.state(model), jax.devices()[0]))
    if mesh is not None:
        sharding.shard_model(model, mesh, rules)
    return model
