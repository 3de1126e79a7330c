"""The closed registry of tensor transforms between HF and native layouts.

Each :class:`Transform` maps a fixed number of HF tensors to a fixed number of
native tensors and back, and states the number of dimensions of both sides.
Every call checks those dimensions, so the 3-D expert transforms cannot be
applied to a 2-D router kernel (or a 2-D transpose to a 3-D expert tensor): the
plan fails with a :class:`ConversionError` before a byte is written.

Conventions (hf-reference.md section 3): HF linear weights are ``[out, in]``,
native kernels ``[in, out]``; HF expert tensors are ``[E, out, in]`` except
GPT-OSS (``[E, in, out]``, gate/up interleaved); native experts are
``[E, in, out]`` with the expert axis first. Layer stacking for scanned models
(``stack_layers`` in :mod:`posttrain.models.decoder`) is done by the engine,
which writes each layer into its slice of the stacked tensor.

Dimension legend: D d_model, N heads, H head_dim, E num_experts, F (expert) FFN width.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from posttrain.hf_schema.errors import ConversionError

Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Transform:
    """One HF <-> native transform and its inverse.

    Attributes:
      name: registry name (shown in errors and in the table docs).
      hf_ndim: ndim of every HF tensor (``None``: any, equal to the native one).
      native_ndim: ndim of every native tensor (``None``: any).
      num_native: native tensors produced (2 for the fused gate/up splits).
      per_expert: the HF side is one 2-D tensor per expert (template has ``{j}``).
      to_native_fn: ``(hf arrays, native shapes) -> native arrays``.
      to_hf_fn: ``native arrays -> hf arrays``.
      hf_shapes_fn: ``native shapes -> hf shapes`` (the plan checks files against it).
      expert_fn: per-expert transforms only: one expert's HF array <-> its slice of the
        native tensor (its own inverse), so the engine streams one expert at a time.
    """

    name: str
    hf_ndim: int | None
    native_ndim: int | None
    num_native: int
    per_expert: bool
    to_native_fn: Callable[[Sequence[np.ndarray], Sequence[Shape]], list[np.ndarray]]
    to_hf_fn: Callable[[Sequence[np.ndarray]], list[np.ndarray]]
    hf_shapes_fn: Callable[[Sequence[Shape]], list[Shape]]
    expert_fn: Callable[[np.ndarray], np.ndarray] | None = None

    def _check(self, side: str, want: int | None, shapes: Sequence[Shape], names) -> None:
        for shape, name in zip(shapes, names, strict=True):
            if want is not None and len(shape) != want:
                raise ConversionError(
                    f"transform {self.name} needs {want}-D {side} tensors; "
                    f"{name} is {len(shape)}-D {list(shape)}"
                )

    def hf_shapes(
        self,
        native_shapes: Sequence[Shape],
        native_names: Sequence[str],
        num_experts: int | None = None,
    ) -> list[Shape]:
        """HF shapes implied by native shapes; checks both ndims."""
        if len(native_shapes) != self.num_native:
            raise ConversionError(
                f"transform {self.name} takes {self.num_native} native "
                f"tensors, got {list(native_names)}"
            )
        self._check("native", self.native_ndim, native_shapes, native_names)
        shapes = self.hf_shapes_fn([tuple(s) for s in native_shapes])
        if self.per_expert and num_experts is not None and len(shapes) != num_experts:
            raise ConversionError(
                f"transform {self.name}: {list(native_names)} has "
                f"{len(shapes)} experts, expected {num_experts}"
            )
        self._check("HF", self.hf_ndim, shapes, [f"HF tensor for {native_names[0]}"] * len(shapes))
        return shapes

    def to_native(
        self, arrays: Sequence[np.ndarray], native_shapes: Sequence[Shape], hf_names: Sequence[str]
    ) -> list[np.ndarray]:
        self._check("HF", self.hf_ndim, [a.shape for a in arrays], hf_names)
        out = self.to_native_fn(arrays, native_shapes)
        self._check("native", self.native_ndim, [a.shape for a in out], ["output"] * len(out))
        return out

    def to_hf(self, arrays: Sequence[np.ndarray], native_names: Sequence[str]) -> list[np.ndarray]:
        self._check("native", self.native_ndim, [a.shape for a in arrays], native_names)
        return self.to_hf_fn(arrays)

    def expert(self, array: np.ndarray, name: str) -> np.ndarray:
        """One expert: HF ``[out, in]`` <-> native slice ``[in, out]`` (either direction)."""
        if self.expert_fn is None:
            raise ConversionError(f"transform {self.name} is not per-expert ({name})")
        self._check("per-expert", self.hf_ndim, [array.shape], [name])
        return self.expert_fn(array)


def _t(x: np.ndarray) -> np.ndarray:
    return np.swapaxes(x, -1, -2)  # [..., a, b] -> [..., b, a]


def _split_half(x: np.ndarray) -> list[np.ndarray]:
    f = x.shape[-1] // 2
    return [x[..., :f], x[..., f:]]


IDENTITY = Transform(
    "identity",
    None,
    None,
    1,
    False,
    to_native_fn=lambda a, s: [a[0]],
    to_hf_fn=lambda a: [a[0]],
    hf_shapes_fn=lambda s: [s[0]],
)
"""Embeddings ``[V, D]``, norm scales, biases of ``[D]``, sinks, per-expert scales, and
GPT-OSS expert tensors already stored ``[E, in, out]``."""

TRANSPOSE = Transform(
    "transpose",
    2,
    2,
    1,
    False,
    to_native_fn=lambda a, s: [a[0].T],  # [out, in] -> [in, out]
    to_hf_fn=lambda a: [a[0].T],
    hf_shapes_fn=lambda s: [s[0][::-1]],
)
"""2-D linear weight ``[out, in]`` <-> kernel ``[in, out]`` (dense MLP, router, lm_head)."""

HEADS_IN = Transform(
    "heads_in",
    2,
    3,
    1,
    False,
    to_native_fn=lambda a, s: [a[0].T.reshape(s[0])],  # [N*H, D] -> [D, N*H] -> [D, N, H]
    to_hf_fn=lambda a: [a[0].reshape(a[0].shape[0], -1).T],  # [D, N, H] -> [N*H, D]
    hf_shapes_fn=lambda s: [(s[0][1] * s[0][2], s[0][0])],
)
"""q/k/v projection ``[N*H, D]`` <-> kernel ``[D, N, H]`` (head-major rows, HF ``view(-1, H)``)."""

HEADS_OUT = Transform(
    "heads_out",
    2,
    3,
    1,
    False,
    to_native_fn=lambda a, s: [a[0].T.reshape(s[0])],  # [D, N*H] -> [N*H, D] -> [N, H, D]
    to_hf_fn=lambda a: [a[0].reshape(-1, a[0].shape[-1]).T],  # [N, H, D] -> [D, N*H]
    hf_shapes_fn=lambda s: [(s[0][2], s[0][0] * s[0][1])],
)
"""o projection ``[D, N*H]`` <-> kernel ``[N, H, D]``."""

HEAD_BIAS = Transform(
    "head_bias",
    1,
    2,
    1,
    False,
    to_native_fn=lambda a, s: [a[0].reshape(s[0])],  # [N*H] -> [N, H]
    to_hf_fn=lambda a: [a[0].reshape(-1)],
    hf_shapes_fn=lambda s: [(s[0][0] * s[0][1],)],
)
"""q/k/v bias ``[N*H]`` <-> ``[N, H]``."""

EXPERTS_T = Transform(
    "experts_transpose",
    3,
    3,
    1,
    False,
    to_native_fn=lambda a, s: [_t(a[0])],  # [E, out, in] -> [E, in, out]
    to_hf_fn=lambda a: [_t(a[0])],
    hf_shapes_fn=lambda s: [(s[0][0], s[0][2], s[0][1])],
)
"""Fused expert tensor ``[E, out, in]`` <-> ``[E, in, out]``, expert axis kept first."""

EXPERTS_STACK_T = Transform(
    "experts_stack_transpose",
    2,
    3,
    1,
    True,
    to_native_fn=lambda a, s: [_t(np.stack(a))],  # E x [out, in] -> [E, out, in] -> [E, in, out]
    to_hf_fn=lambda a: list(_t(a[0])),  # [E, in, out] -> E x [out, in]
    hf_shapes_fn=lambda s: [(s[0][2], s[0][1])] * s[0][0],
    expert_fn=lambda a: a.T,  # [out, in] <-> [in, out]
)
"""Per-expert 2-D weights ``experts.{j}.*`` (hub layout), j = 0..E-1 in numeric order,
<-> ``[E, in, out]``."""

GATE_UP_CONCAT_T = Transform(
    "gate_up_concat_transpose",
    3,
    3,
    2,
    False,
    to_native_fn=lambda a, s: _split_half(_t(a[0])),  # [E, 2F, D] -> [E, D, 2F] -> 2 x [E, D, F]
    to_hf_fn=lambda a: [_t(np.concatenate(a, axis=-1))],  # 2 x [E, D, F] -> [E, 2F, D]
    hf_shapes_fn=lambda s: [(s[0][0], 2 * s[0][2], s[0][1])],
)
"""Fused ``gate_up_proj`` ``[E, 2F, D]``, gate rows then up rows (Mixtral, Qwen3-MoE,
Gemma 4) <-> gate, up ``[E, D, F]``."""

GATE_UP_INTERLEAVED = Transform(
    "gate_up_interleaved",
    3,
    3,
    2,
    False,
    to_native_fn=lambda a, s: [a[0][..., 0::2], a[0][..., 1::2]],  # [E, D, 2F] -> 2 x [E, D, F]
    to_hf_fn=lambda a: [np.stack(a, axis=-1).reshape(*a[0].shape[:-1], -1)],  # g0 u0 g1 u1 ...
    hf_shapes_fn=lambda s: [(*s[0][:-1], 2 * s[0][-1])],
)
"""GPT-OSS ``gate_up_proj`` ``[E, D, 2F]`` (already ``[E, in, out]``), gate in even and
up in odd columns <-> gate, up ``[E, D, F]``."""

GATE_UP_INTERLEAVED_BIAS = dataclasses.replace(
    GATE_UP_INTERLEAVED, name="gate_up_interleaved_bias", hf_ndim=2, native_ndim=2
)
"""GPT-OSS ``gate_up_proj_bias`` ``[E, 2F]`` interleaved <-> gate, up biases ``[E, F]``."""

REGISTRY: dict[str, Transform] = {
    t.name: t
    for t in (
        IDENTITY,
        TRANSPOSE,
        HEADS_IN,
        HEADS_OUT,
        HEAD_BIAS,
        EXPERTS_T,
        EXPERTS_STACK_T,
        GATE_UP_CONCAT_T,
        GATE_UP_INTERLEAVED,
        GATE_UP_INTERLEAVED_BIAS,
    )
}
"""Every transform a table row may name."""
