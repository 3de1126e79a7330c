"""Mesh axes, logical-axis rules, mesh creation, and the two sharding helpers.

This is the only package that names physical mesh axes. Layers speak logical axis
names (the vocabulary in STYLE.md: ``activation_batch``, ``embed``, ``mlp``,
``exp`` ...) through exactly two helpers:

* :func:`param` creates every parameter and records its logical axes in the
  ``logical_axes`` metadata of the ``nnx.Param``;
* :func:`constrain` puts a sharding constraint on an activation, resolved against
  the mesh and rules made current by :func:`use_mesh` (a no-op when none is).

Resolution (:func:`logical_to_spec`) maps each dimension's logical name to the
mesh axes its rule lists, skipping axes of size 1 and axes an earlier dimension of
the same array already took (MaxText's convention, ``maxtext/layers``), and
raises ``ValueError`` naming the dimension, its size and the axes when the size
does not divide by the product of those axes.

Mesh axes are always the full set :data:`MESH_AXES`; unused axes have size 1.

Modules (every name is read from here, ``sharding.X``, by some 70 call sites):

* :mod:`.rules`: the mesh axes, the logical-axis vocabulary and rules, their
  resolution (:func:`logical_to_spec`, :func:`batch_spec` ...), :func:`make_mesh`.
* :mod:`.activations`: :func:`use_mesh`, :func:`current`, :func:`constrain`.
* :mod:`.params`: :func:`param`, :func:`state_shardings`, :func:`shard_model`.
"""

from posttrain.sharding.activations import (
    MeshContext,
    constrain,
    current,
    sequence_sharded,
    use_mesh,
)
from posttrain.sharding.params import (
    Initializer,
    param,
    shard_model,
    state_shardings,
    variable_logical_axes,
)
from posttrain.sharding.rules import (
    ACTIVATION_AXES,
    ACTIVATION_AXIS_NAMES,
    BATCH_AXES,
    DEFAULT_RULES,
    MESH_AXES,
    PARAM_AXES,
    SEQUENCE_AXES,
    LogicalAxes,
    Rules,
    axis_product,
    batch_sharding,
    batch_spec,
    data_parallel_size,
    logical_to_spec,
    make_mesh,
    parse_mesh_spec,
    rules_dict,
    sequence_parallel_size,
)

__all__ = [
    "ACTIVATION_AXES",
    "ACTIVATION_AXIS_NAMES",
    "BATCH_AXES",
    "DEFAULT_RULES",
    "MESH_AXES",
    "PARAM_AXES",
    "SEQUENCE_AXES",
    "Initializer",
    "LogicalAxes",
    "MeshContext",
    "Rules",
    "axis_product",
    "batch_sharding",
    "batch_spec",
    "constrain",
    "current",
    "data_parallel_size",
    "logical_to_spec",
    "make_mesh",
    "param",
    "parse_mesh_spec",
    "rules_dict",
    "sequence_parallel_size",
    "sequence_sharded",
    "shard_model",
    "state_shardings",
    "use_mesh",
    "variable_logical_axes",
]
