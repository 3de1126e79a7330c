"""Where the adapters live in a LoRA model, and how A and B factor each base weight.

Qwix LoRA on ``einsum(lhs, W)`` creates ``{W}_lora_a`` (W's dims that meet the
input, then the rank) and ``{W}_lora_b`` (the rank, then W's other dims), in W's
dim order (qwix 0.1.8 ``lora._parse_einsum_str_for_lora``). Which dims meet the
input is fixed by each layer's einsum, listed in :data:`A_DIMS`; shapes are
checked against it, so a layer whose einsum changes fails loudly here.

Scanned models hold the adapters of a block stacked like its weights: a leading
``layers`` axis on W, A and B.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from flax import nnx

from posttrain import _compat, sharding
from posttrain.tree import path_name

LORA_A, LORA_B = "_lora_a", "_lora_b"

A_DIMS: dict[tuple[str, str], tuple[int, ...]] = {
    ("HeadProjection", "kernel"): (0,),  # btd,dnh->btnh: A [D, r], B [r, N, H]
    ("OutProjection", "kernel"): (0, 1),  # btnh,nhd->btd: A [N, H, r], B [r, D]
    ("Linear", "kernel"): (0,),  # ...i,io->...o: A [I, r], B [r, O]
    ("Router", "kernel"): (0,),  # td,de->te
    ("Experts", "gate_proj"): (1,),  # td,edf->tef: A [D, r] shared, B [r, E, F]
    ("Experts", "up_proj"): (1,),
    ("Experts", "down_proj"): (0, 1),  # tef,efd->td: A [E, F, r], B [r, D]
}
"""(module class, weight name) -> the weight's dims (per layer) that adapter A covers."""


def walk(node, path):
    """The attribute / list item of ``node`` at ``path``."""
    for key in path:
        node = node[key] if isinstance(key, int) else getattr(node, key)
    return node


@dataclasses.dataclass(frozen=True)
class Adapter:
    """One adapted weight of a LoRA model.

    Attributes:
      module: path of the module holding the weight.
      weight: the weight's attribute name (``kernel``, ``gate_proj`` ...).
      a, b: the adapter values ``[(layers,) *a_dims, rank]``, ``[(layers,) rank, *b_dims]``.
      weight_shape: the base weight's shape (with the leading layers axis when stacked).
      stacked: the weight is a scanned block's (leading ``layers`` axis).
      a_dims: per-layer weight dims covered by A (in order); the others are B's.
    """

    module: tuple
    weight: str
    a: jax.Array
    b: jax.Array
    weight_shape: tuple[int, ...]
    stacked: bool
    a_dims: tuple[int, ...]

    @property
    def key(self) -> str:
        """Dotted path of the base weight, e.g. ``model.layers.0.self_attn.q_proj.kernel``."""
        return path_name((*self.module, self.weight))

    def delta(self, scale: float) -> jax.Array:
        """``scale * A.B`` in the base weight's layout (float32)."""
        return weight_delta(
            self.a, self.b, self.a_dims, len(self.weight_shape) - self.stacked, self.stacked, scale
        )


def weight_delta(a, b, a_dims, ndim: int, stacked: bool, scale: float) -> jax.Array:
    """``scale * A.B`` laid out like the weight (per-layer ndim ``ndim``), float32."""
    letters = "ijklmnopq"[:ndim]
    a_sub = "".join(letters[d] for d in a_dims)
    b_sub = "".join(c for d, c in enumerate(letters) if d not in a_dims)
    lead = "y" if stacked else ""
    spec = f"{lead}{a_sub}z,{lead}z{b_sub}->{lead}{letters}"
    out = jnp.einsum(spec, a.astype(jnp.float32), b.astype(jnp.float32))  # weight layout
    return out * jnp.float32(scale)


def adapter_dims(
    module: nnx.Module, weight: str, weight_shape, a_shape, b_shape
) -> tuple[int, ...]:
    """The per-layer weight dims that A covers, from :data:`A_DIMS`, checked against the shapes.

    ``weight_shape`` is per layer; ``a_shape`` / ``b_shape`` are per layer without
    the rank. An unlisted weight falls back to the unique dims split that fits
    the shapes.

    Raises:
      ValueError: the listed split does not fit the shapes, or (unlisted) no split
        or several fit.
    """
    ndim = len(weight_shape)

    def fits(dims):
        rest = [d for d in range(ndim) if d not in dims]
        return tuple(weight_shape[d] for d in dims) == tuple(a_shape) and tuple(
            weight_shape[d] for d in rest
        ) == tuple(b_shape)

    name = (type(module).__name__, weight)
    listed = A_DIMS.get(name)
    if listed is not None:
        if not fits(listed):
            raise ValueError(
                f"{name[0]}.{weight} {list(weight_shape)}: adapter A "
                f"{list(a_shape)} / B {list(b_shape)} do not match dims {listed} of "
                f"lora.layout.A_DIMS; did the layer's einsum change?"
            )
        return listed
    found = [
        dims
        for k in range(1, ndim)
        for dims in itertools.combinations(range(ndim), k)
        if fits(dims)
    ]
    if len(found) != 1:
        raise ValueError(
            f"{name[0]}.{weight} {list(weight_shape)} is not in lora.layout.A_DIMS "
            f"and its adapters A {list(a_shape)} / B {list(b_shape)} fit "
            f"{len(found)} dim splits; add it to A_DIMS"
        )
    return found[0]


def adapter_axes(weight_axes, a_dims, stacked: bool):
    """Logical axes of (A, B) derived from the weight's (``None``: replicated)."""
    if weight_axes is None:
        return None, None
    lead, per_layer = (weight_axes[:1], weight_axes[1:]) if stacked else ((), weight_axes)
    a = (*lead, *(per_layer[d] for d in a_dims), None)
    b = (*lead, None, *(ax for d, ax in enumerate(per_layer) if d not in a_dims))
    return a, b


def is_stacked(weight_axes) -> bool:
    return bool(weight_axes) and weight_axes[0] == "layers"


def weight_shape_of(value) -> tuple[int, ...]:
    """Shape of a weight: an array, or a Qwix quantised ``WithAux`` (its ``shape``)."""
    return tuple(value.shape)


def iter_adapters(model: nnx.Module) -> Iterator[Adapter]:
    """Every adapted weight of ``model``, in module order."""
    for path, module in _compat.iter_modules(model):
        names = vars(module)
        for name, a_var in names.items():
            # str check: list-like modules (nnx.List in flax 0.12.0) have int attribute keys.
            if not (
                isinstance(name, str) and name.endswith(LORA_A) and isinstance(a_var, nnx.LoRAParam)
            ):
                continue
            weight = name[: -len(LORA_A)]
            b_var, w = names[weight + LORA_B], names[weight]
            w_axes = sharding.variable_logical_axes(w) if isinstance(w, nnx.Variable) else None
            if w_axes is None and not isinstance(w, nnx.Variable):  # quantised: read qvalue's
                w_axes = sharding.variable_logical_axes(w.array.qvalue)
            a, b = _compat.variable_value(a_var), _compat.variable_value(b_var)
            stacked = is_stacked(w_axes)
            shape = weight_shape_of(w)
            a_dims = adapter_dims(
                module, weight, shape[stacked:], a.shape[stacked:-1], b.shape[stacked + 1 :]
            )
            yield Adapter(tuple(path), weight, a, b, shape, stacked, a_dims)
