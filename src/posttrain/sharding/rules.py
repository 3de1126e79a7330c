"""Mesh axes, the logical-axis rules, their resolution to ``PartitionSpec``s, and mesh creation.

The only module that names physical mesh axes (its package's helpers,
:mod:`.activations` and :mod:`.params`, resolve through it). Resolution
(:func:`logical_to_spec`) maps each dimension's logical name to the mesh axes its
rule lists, skipping axes of size 1 and axes an earlier dimension of the same array
already took (MaxText's convention, ``maxtext/layers``), and raises ``ValueError``
naming the dimension, its size and the axes when the size does not divide by the
product of those axes.

Mesh axes are always the full set :data:`MESH_AXES`; unused axes have size 1.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from posttrain import _compat

MESH_AXES: tuple[str, ...] = (
    "data",
    "fsdp",
    "fsdp_transpose",
    "expert",
    "tensor",
    "tensor_sequence",
    "context",
)
"""Every mesh this package builds has exactly these axes, in this order."""

BATCH_AXES: tuple[str, ...] = ("data", "fsdp", "fsdp_transpose", "expert")
"""Axes that shard the activation batch dimension under :data:`DEFAULT_RULES`."""

SEQUENCE_AXES: tuple[str, ...] = ("tensor_sequence", "context")
"""Axes that shard the activation sequence dimension under :data:`DEFAULT_RULES`."""

LogicalAxes = tuple[str | None, ...]

ACTIVATION_AXES: LogicalAxes = ("activation_batch", "activation_length", "activation_embed")
"""The logical axes of the residual stream ``[batch, length, d_model]``."""

ACTIVATION_AXIS_NAMES: tuple[str, ...] = (
    "activation_batch",
    "activation_length",
    "activation_embed",
    "activation_heads",
    "activation_kv_heads",
    "activation_mlp",
    "activation_exp",
    "activation_vocab",
)
"""The logical axes an activation may name; :func:`constrain` refuses others."""
Rules = tuple[tuple[str, tuple[str, ...]], ...]

DEFAULT_RULES: Rules = (
    # activations
    ("activation_batch", BATCH_AXES),
    ("activation_length", SEQUENCE_AXES),
    ("activation_embed", ()),
    ("activation_heads", ("tensor",)),
    ("activation_kv_heads", ("tensor",)),
    ("activation_mlp", ("tensor",)),
    ("activation_exp", ("expert",)),
    ("activation_vocab", ("tensor",)),
    # parameters
    ("vocab", ("tensor",)),
    ("embed", ("fsdp",)),
    ("heads", ("tensor",)),
    ("kv_heads", ("tensor",)),
    ("head_dim", ()),
    ("mlp", ("fsdp_transpose", "tensor")),
    ("exp", ("expert",)),
    ("layers", ()),
    ("norm", ()),
)
"""Logical name -> mesh axes. Read top to bottom; an absent name is replicated."""

PARAM_AXES: tuple[str, ...] = (
    "vocab",
    "embed",
    "heads",
    "kv_heads",
    "head_dim",
    "mlp",
    "exp",
    "layers",
    "norm",
)
"""The logical axes a parameter may name (STYLE.md's vocabulary); :func:`param` refuses others."""


def rules_dict(rules: Rules = DEFAULT_RULES) -> dict[str, tuple[str, ...]]:
    """Returns ``rules`` as a dict, checking each mesh axis name is known.

    Raises:
      ValueError: a rule names an axis outside :data:`MESH_AXES`.
    """
    out: dict[str, tuple[str, ...]] = {}
    for name, axes in rules:
        for axis in axes:
            if axis not in MESH_AXES:
                raise ValueError(
                    f"rule {name!r} names mesh axis {axis!r}; expected one of {MESH_AXES}"
                )
        out[name] = tuple(axes)
    return out


def axis_product(mesh_shape: Mapping[str, int], axes: Sequence[str]) -> int:
    """Product of the sizes of ``axes`` in ``mesh_shape`` (absent axes count 1)."""
    return math.prod(int(mesh_shape.get(a, 1)) for a in axes)


def data_parallel_size(mesh: Mesh | Mapping[str, int], rules: Rules = DEFAULT_RULES) -> int:
    """Number of shards of the activation batch: ``data x fsdp x fsdp_transpose x expert``.

    Derived from the rule for ``activation_batch`` (not a fixed axis list), so a
    new axis added to that rule is counted here too. A global batch must be a
    multiple of this number.
    """
    shape = mesh.shape if isinstance(mesh, Mesh) else mesh
    return axis_product(shape, rules_dict(rules).get("activation_batch", ()))


def batch_spec(mesh: Mesh | Mapping[str, int], rules: Rules = DEFAULT_RULES) -> PartitionSpec:
    """The ``PartitionSpec`` of a ``[batch, ...]`` array: its leading dimension over the
    mesh axes of the ``activation_batch`` rule that ``mesh`` has (``PartitionSpec()``,
    replicated, when it has none); the other dimensions replicated."""
    shape = mesh.shape if isinstance(mesh, Mesh) else mesh
    return logical_to_spec(("activation_batch",), None, dict(shape), rules)


def batch_sharding(mesh: Mesh, rules: Rules = DEFAULT_RULES) -> NamedSharding:
    """:func:`batch_spec` on ``mesh``: where the trainer puts each batch."""
    return NamedSharding(mesh, batch_spec(mesh, rules))


def sequence_parallel_size(mesh: Mesh | Mapping[str, int], rules: Rules = DEFAULT_RULES) -> int:
    """Number of shards of the activation sequence: ``tensor_sequence x context``.

    Derived from the rule for ``activation_length``; sequence lengths fed to the
    model must be multiples of it.
    """
    shape = mesh.shape if isinstance(mesh, Mesh) else mesh
    return axis_product(shape, rules_dict(rules).get("activation_length", ()))


def parse_mesh_spec(spec: str) -> dict[str, int]:
    """Parses ``"data=2,fsdp=4"`` into ``{"data": 2, "fsdp": 4}``.

    Raises:
      ValueError: no entry, one not ``axis=INT``, an unknown axis, twice, a size < 1.
    """
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, size = (x.strip() for x in part.partition("="))
        if sep and re.fullmatch(r"[-+]?[0-9]+", size) and int(size) < 1:
            raise ValueError(f"mesh axis {name}={int(size)}: expected a size >= 1")
        if not sep or not re.fullmatch(r"[0-9]+", size):  # "²".isdigit() is True
            raise ValueError(f"mesh entry {part!r} must look like axis=INT, e.g. fsdp=4")
        if name not in MESH_AXES or name in out:
            known = (
                f"is given twice ({name}={out[name]}, {part})"
                if name in out
                else (f"is unknown; expected one of {MESH_AXES}")
            )
            raise ValueError(f"mesh axis {name!r} {known}")
        out[name] = int(size)
    if not out:
        raise ValueError("names no axis; expected axis=INT entries, e.g. fsdp=4 (or no flag)")
    return out


def make_mesh(
    axis_sizes: Mapping[str, int] | None = None,
    *,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """Builds a mesh over all of :data:`MESH_AXES` from the sizes of any subset.

    Args:
      axis_sizes: sizes by axis name; absent axes get 1. ``None`` puts every
        device on ``fsdp``.
      devices: devices to use; defaults to ``jax.devices()``.

    Returns:
      A ``Mesh`` with axes :data:`MESH_AXES` in that order, each of
      ``AxisType.Auto`` where the installed JAX has axis types.

    Raises:
      ValueError: an unknown axis name, a size < 1, or a product of sizes that
        differs from the device count (the message names both).
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = dict(axis_sizes or {"fsdp": len(devices)})
    for name, size in sizes.items():
        if name not in MESH_AXES:
            raise ValueError(f"mesh axis {name!r} is unknown; expected one of {MESH_AXES}")
        if int(size) < 1:
            raise ValueError(f"mesh axis {name}={size} must be >= 1")
    shape = tuple(int(sizes.get(a, 1)) for a in MESH_AXES)
    if math.prod(shape) != len(devices):
        described = ", ".join(f"{a}={s}" for a, s in zip(MESH_AXES, shape, strict=True) if s > 1)
        raise ValueError(
            f"mesh {{{described or 'all axes 1'}}} has {math.prod(shape)} devices "
            f"but {len(devices)} devices are available; the product must equal the device count"
        )
    return _compat.make_mesh(shape, MESH_AXES, devices)


def logical_to_spec(
    logical_axes: LogicalAxes,
    shape: Sequence[int] | None,
    mesh_shape: Mapping[str, int],
    rules: Rules = DEFAULT_RULES,
) -> PartitionSpec:
    """Resolves logical axes of one array to a ``PartitionSpec`` on a mesh.

    Args:
      logical_axes: one logical name (or ``None``) per dimension.
      shape: the array shape, checked for divisibility; ``None`` skips the check.
      mesh_shape: mesh axis name -> size.
      rules: logical name -> mesh axes.

    Raises:
      ValueError: ``shape`` and ``logical_axes`` differ in length, or a dimension
        does not divide by the product of the mesh axes that shard it.
    """
    table = rules_dict(rules)
    if shape is not None and len(shape) != len(logical_axes):
        raise ValueError(
            f"logical axes {logical_axes} have {len(logical_axes)} names "
            f"but the array has shape {tuple(shape)}"
        )
    used: set[str] = set()
    entries: list[str | tuple[str, ...] | None] = []
    for dim, name in enumerate(logical_axes):
        axes = tuple(
            a
            for a in (table.get(name, ()) if name else ())
            if a not in used and mesh_shape.get(a, 1) > 1
        )
        used.update(axes)
        if shape is not None and axes:
            n = axis_product(mesh_shape, axes)
            if shape[dim] % n:
                raise ValueError(
                    f"dimension {dim} ({name}) of size {shape[dim]} is not divisible by "
                    f"mesh axes {'x'.join(axes)}={n}"
                )
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)
