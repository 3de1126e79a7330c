"""The current mesh and rules, and :func:`constrain`, the one helper that shards activations.

:func:`use_mesh` makes a mesh and its rules current while a function is traced;
:func:`constrain` puts a sharding constraint on an activation, resolved against them
(:func:`~posttrain.sharding.rules.logical_to_spec`), and is a no-op outside one.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

import jax
from jax.sharding import Mesh, NamedSharding

from posttrain import _compat
from posttrain.sharding.rules import (
    ACTIVATION_AXIS_NAMES,
    DEFAULT_RULES,
    LogicalAxes,
    Rules,
    logical_to_spec,
    sequence_parallel_size,
)


@dataclasses.dataclass(frozen=True)
class MeshContext:
    mesh: Mesh
    rules: Rules


_CURRENT: contextvars.ContextVar[MeshContext | None] = contextvars.ContextVar(
    "posttrain_mesh", default=None
)


@contextlib.contextmanager
def use_mesh(
    mesh: Mesh, rules: Rules = DEFAULT_RULES, *, jax_context: bool = True
) -> Iterator[Mesh]:
    """Makes ``mesh`` and ``rules`` current for :func:`constrain` (and JAX's mesh context).

    The context is read when a function is traced, so trace (first call of a
    jitted function) inside it. ``jax_context=False`` leaves JAX's own mesh
    context alone (:func:`constrain` names the mesh explicitly): under
    ``jax.set_mesh``, jax 0.7-0.8 rejects the eager single-device ops Orbax runs
    while saving sharded arrays.
    """
    token = _CURRENT.set(MeshContext(mesh, rules))
    try:
        with _compat.set_mesh(mesh) if jax_context else contextlib.nullcontext():
            yield mesh
    finally:
        _CURRENT.reset(token)


def current() -> MeshContext | None:
    """The :class:`MeshContext` set by :func:`use_mesh`, or ``None``."""
    return _CURRENT.get()


def sequence_sharded() -> bool:
    """Whether the current mesh (:func:`use_mesh`) splits the activation sequence
    (:func:`sequence_parallel_size` > 1); ``False`` outside one."""
    ctx = _CURRENT.get()
    return ctx is not None and sequence_parallel_size(ctx.mesh, ctx.rules) > 1


def constrain(x: jax.Array, logical_axes: LogicalAxes) -> jax.Array:
    """Constrains activation ``x`` to the sharding its logical axes resolve to.

    Returns ``x`` unchanged outside :func:`use_mesh` (the names are checked there too).

    Raises:
      ValueError: ``logical_axes`` names an axis outside :data:`ACTIVATION_AXIS_NAMES`
        (``None`` replicates a dimension), or (from :func:`logical_to_spec`) a dimension
        does not divide by its mesh axes.
    """
    unknown = [a for a in logical_axes if a is not None and a not in ACTIVATION_AXIS_NAMES]
    if unknown:  # a misspelt name would silently replicate the activation
        raise ValueError(
            f"activation logical axis {unknown[0]!r} is not one of {ACTIVATION_AXIS_NAMES}"
        )
    ctx = _CURRENT.get()
    if ctx is None:
        return x
    spec = logical_to_spec(logical_axes, x.shape, dict(ctx.mesh.shape), ctx.rules)
    return jax.lax.with_sharding_constraint(x, NamedSharding(ctx.mesh, spec))
