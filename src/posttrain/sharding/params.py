"""Parameters and their placement: :func:`param`, the one helper that creates parameters,
records each one's logical axes; :func:`state_shardings` and :func:`shard_model` place a
model's variables on a mesh by them."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from posttrain import _compat
from posttrain.sharding.rules import DEFAULT_RULES, PARAM_AXES, LogicalAxes, Rules, logical_to_spec
from posttrain.tree import path_name

Initializer = Callable[[jax.Array, Sequence[int], jax.typing.DTypeLike], jax.Array]


def param(
    rngs: nnx.Rngs,
    init: Initializer,
    shape: Sequence[int],
    logical_axes: LogicalAxes,
    dtype: jax.typing.DTypeLike = np.float32,
) -> nnx.Param:
    """Creates a parameter and records its logical axes (metadata ``logical_axes``).

    Raises:
      ValueError: ``logical_axes`` does not have one name per dimension of ``shape``, or
        names an axis outside :data:`PARAM_AXES` (``None`` replicates a dimension).
    """
    if len(shape) != len(logical_axes):
        raise ValueError(f"param of shape {tuple(shape)} got logical axes {logical_axes}")
    unknown = [a for a in logical_axes if a is not None and a not in PARAM_AXES]
    if unknown:  # a misspelt name would silently replicate the parameter
        raise ValueError(f"param logical axis {unknown[0]!r} is not one of {PARAM_AXES}")
    key = _compat.next_rng_key(rngs.params)
    return nnx.Param(init(key, tuple(shape), dtype), logical_axes=tuple(logical_axes))


def variable_logical_axes(variable: nnx.Variable) -> LogicalAxes | None:
    """The ``logical_axes`` metadata of a variable, or ``None`` when it has none."""
    return variable.get_metadata().get("logical_axes")


def state_shardings(state: nnx.State, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> nnx.State:
    """Maps each variable of ``state`` to its ``NamedSharding`` on ``mesh``.

    The result has the structure of ``state`` (each variable holding a
    ``NamedSharding``), so it can be passed to ``jax.device_put`` or as jit
    ``out_shardings``.

    Variables without ``logical_axes`` metadata are replicated.

    Raises:
      ValueError: a parameter dimension does not divide by its mesh axes; the
        message starts with the parameter path.
    """
    mesh_shape = dict(mesh.shape)

    def one(path, variable):
        if not isinstance(variable, nnx.Variable):
            return NamedSharding(mesh, PartitionSpec())
        axes = variable_logical_axes(variable)
        spec = PartitionSpec()
        if axes is not None:
            try:
                shape = np.shape(_compat.variable_value(variable))
                spec = logical_to_spec(axes, shape, mesh_shape, rules)
            except ValueError as e:
                raise ValueError(f"{path_name(path)}: {e}") from None
        return variable.replace(NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(
        one, state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )


def shard_model(model: nnx.Module, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> nnx.Module:
    """Places every variable of ``model`` on ``mesh`` per its logical axes, in place.

    Returns the same model for chaining.

    Raises:
      ValueError: as :func:`state_shardings`.
    """
    state = nnx.state(model)
    shardings = state_shardings(state, mesh, rules)
    nnx.update(model, jax.device_put(state, shardings))
    return model
