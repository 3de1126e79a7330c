"""Stage 3 of the MoE block: the routed experts, computed by one of three algorithms.

All three compute ``sum_r weights[t, r] * expert_{ids[t, r]}(x[t])`` with
``expert_e(x) = down_e(act(gate_e(x), up_e(x)))`` and agree to float32 rounding:

* ``dense``: every expert on every token, einsums directly on the module
  parameters, combined with a ``[tokens, num_experts]`` weight matrix. E / R
  times the useful FLOPs, but the only path Qwix LoRA can adapt: Qwix intercepts
  einsums whose operand is a parameter, so the parameter must reach the einsum
  unchanged (``param_dtype == dtype``; a fused per-expert scale makes
  ``down_proj`` a product, which LoRA then cannot see). With qwix 0.1.8,
  ``apply_lora_to_model`` gives ``dense`` LoRA on all three projections, gives
  ``sorted`` none (silently), and fails on ``ragged`` (``TraceContextError``).
* ``sorted``: assignments sorted by expert into blocks of ``block_size`` rows
  that each belong to one expert; a loop over the experts reads each expert's
  weights once and multiplies its blocks in large chunks, with a hand-written
  backward (:mod:`.grouped`). Near the useful FLOPs on any backend
  (``benchmarks/moe.py``).
* ``ragged``: ``jax.lax.ragged_dot`` over the assignments sorted by expert, for
  accelerators with ragged-matmul kernels (on CPU it is slower than ``dense``).
  :func:`ragged_dot` steers around two XLA:TPU failures (libtpu 0.0.42, found on a
  v5e, reproduced by a deviceless compile in ``tests/test_moe_tpu_compile.py``).

The algorithm is ``MoEConfig.algorithm``, never chosen by platform.

Dimension legend (STYLE.md): T tokens, D d_model, F moe_d_ff, E num_experts,
R top_k, A = T*R assignments, NB blocks, S block_size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from posttrain import sharding
from posttrain.config import ActivationConfig, MoEConfig
from posttrain.layers.mlp import gated_activation, kernel_value
from posttrain.layers.moe import dispatch, grouped


def ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``jax.lax.ragged_dot(lhs, rhs, group_sizes)``, compilable for TPU.

    Args: ``lhs`` [A, K] rows sorted by group, ``rhs`` [G, K, N] one matrix per group,
    ``group_sizes`` [G] int32 summing to A. Returns [A, N] in the operands' dtype.

    Two XLA:TPU compile failures (libtpu 0.0.42; the kernel is Mosaic's):

    * one group (``num_experts == 1``): the group sizes fold to a constant and the
      compiler fails a RET_CHECK in ``mask_aggregator.cc`` ("memory_space() ==
      kHbm"). One group is every row times ``rhs[0]``: a plain dot, exactly.
    * operands narrower than float32 under ``jax.default_matmul_precision("highest")``:
      the kernel is asked for float32 contraction on bfloat16 vectors and refuses
      ("Bad lhs type"). A bfloat16 product is exact in one pass, so the precision is
      pinned to ``DEFAULT`` for them; float32 operands keep the caller's precision.
    """
    precision = None if lhs.dtype == jnp.float32 else jax.lax.Precision.DEFAULT
    if rhs.shape[0] == 1:
        return jnp.dot(lhs, rhs[0], precision=precision)
    return jax.lax.ragged_dot(lhs, rhs, group_sizes, precision=precision)


# lecun_normal per expert: fan_in is the input axis only, not E * in.
_KERNEL_INIT = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
_PARAM_NAMES = grouped.KERNELS + grouped.BIASES  # the parameter attributes


class Experts(nnx.Module):
    """E gated MLPs ``[d_model] -> [moe_d_ff] -> [d_model]`` stacked on a leading axis.

    Parameters: ``gate_proj``, ``up_proj`` ``[E, d_model, moe_d_ff]`` (exp, embed,
    mlp); ``down_proj`` ``[E, moe_d_ff, d_model]`` (exp, mlp, embed); when
    ``moe.expert_bias`` (GPT-OSS) also ``gate_proj_bias``, ``up_proj_bias``
    ``[E, moe_d_ff]`` (exp, mlp) and ``down_proj_bias`` ``[E, d_model]`` (exp, embed).

    Args:
      d_model: D.
      moe: the MoE config (``num_experts``, ``moe_d_ff``, ``expert_bias``,
        ``algorithm``, ``block_size``).
      activation: the nonlinearity (:func:`posttrain.layers.mlp.gated_activation`).
      rngs: parameter RNGs.
      dtype: compute dtype; param_dtype: parameter dtype.
    """

    def __init__(
        self,
        d_model: int,
        moe: MoEConfig,
        activation: ActivationConfig,
        *,
        rngs: nnx.Rngs,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
    ):
        e, f = moe.num_experts, moe.moe_d_ff
        self.moe, self.activation = moe, activation
        self.dtype = dtype

        def kernel(shape, axes):
            return sharding.param(rngs, _KERNEL_INIT, shape, axes, param_dtype)

        def bias(shape, axes):
            if not moe.expert_bias:
                return None
            return sharding.param(rngs, nnx.initializers.zeros, shape, axes, param_dtype)

        self.gate_proj = kernel((e, d_model, f), ("exp", "embed", "mlp"))
        self.up_proj = kernel((e, d_model, f), ("exp", "embed", "mlp"))
        self.down_proj = kernel((e, f, d_model), ("exp", "mlp", "embed"))
        self.gate_proj_bias = bias((e, f), ("exp", "mlp"))
        self.up_proj_bias = bias((e, f), ("exp", "mlp"))
        self.down_proj_bias = bias((e, d_model), ("exp", "embed"))

    def __call__(
        self,
        x: jax.Array,
        weights: jax.Array,
        expert_ids: jax.Array,
        *,
        down_scale: jax.Array | None = None,
    ) -> jax.Array:
        """Weighted sum of the selected experts' outputs.

        Args:
          x: ``[tokens, d_model]`` expert input, any float dtype (cast to ``dtype``).
          weights: ``[tokens, top_k]`` float32 routing weights (0 drops an assignment).
          expert_ids: ``[tokens, top_k]`` int selected experts.
          down_scale: ``[num_experts]`` or ``None``; multiplies ``down_proj`` and
            ``down_proj_bias`` of expert e (the fused per-expert scale).

        Returns:
          ``[tokens, d_model]`` float32.
        """
        p = self._params(down_scale)
        x = x.astype(self.dtype)
        if self.moe.algorithm == "dense":
            return self._dense(x, weights, expert_ids, p)
        if self.moe.algorithm == "sorted":
            return self._sorted(x, weights, expert_ids, p)
        return self._ragged(x, weights, expert_ids, p)

    def _params(self, down_scale: jax.Array | None) -> dict[str, jax.Array | None]:
        def value(v):
            return None if v is None else kernel_value(v, self.dtype)

        p = {name: value(getattr(self, name)) for name in _PARAM_NAMES}
        if down_scale is not None:  # fused per-expert scale: the only place it is applied
            scale = down_scale.astype(self.dtype)
            p["down_proj"] = p["down_proj"] * scale[:, None, None]  # [E, F, D]
            if p["down_proj_bias"] is not None:
                p["down_proj_bias"] = p["down_proj_bias"] * scale[:, None]  # [E, D]
        return p

    def _act(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        return gated_activation(gate, up, self.activation)

    def _dense(self, x, weights, expert_ids, p) -> jax.Array:
        num_tokens = x.shape[0]
        combine = jnp.zeros((num_tokens, self.moe.num_experts), jnp.float32)
        combine = combine.at[jnp.arange(num_tokens)[:, None], expert_ids].add(weights)  # [T, E]
        gate = jnp.einsum("td,edf->tef", x, p["gate_proj"])  # [T, E, F]
        up = jnp.einsum("td,edf->tef", x, p["up_proj"])  # [T, E, F]
        if p["gate_proj_bias"] is not None:
            gate, up = gate + p["gate_proj_bias"], up + p["up_proj_bias"]
        hidden = self._act(gate, up) * combine[:, :, None].astype(self.dtype)  # [T, E, F]
        out = jnp.einsum(
            "tef,efd->td", hidden, p["down_proj"], preferred_element_type=jnp.float32
        )  # [T, D]
        if p["down_proj_bias"] is not None:
            # A product and sum, not an einsum: Qwix would treat the bias as a weight
            # (LoRA adapters and QLoRA quantisation on a bias).
            bias = p["down_proj_bias"].astype(jnp.float32)  # [E, D]
            out = out + jnp.sum(combine[:, :, None] * bias[None], axis=1)  # [T, D]
        return out

    def _sorted(self, x, weights, expert_ids, p) -> jax.Array:
        num_assignments, num_experts = expert_ids.size, self.moe.num_experts
        size = self.moe.block_size or dispatch.default_block_size(num_assignments, num_experts)
        layout = dispatch.block_layout(expert_ids, num_experts, size)
        rows = x[layout.row_token]  # [NB * S, D]
        chunks = dispatch.chunk_blocks(num_assignments, num_experts, size)
        out = grouped.grouped_mlp(
            rows, layout.block_ends, p, self.activation, size, chunks
        )  # [NB*S, D]
        return dispatch.combine_rows(out, layout.assignment_row, weights)

    def _ragged(self, x, weights, expert_ids, p) -> jax.Array:
        top_k = expert_ids.shape[1]
        s = dispatch.sort_by_expert(expert_ids, self.moe.num_experts)
        rows = x[s.order // top_k]  # [A, D] sorted by expert
        gate = ragged_dot(rows, p["gate_proj"], s.group_sizes)  # [A, F]
        up = ragged_dot(rows, p["up_proj"], s.group_sizes)  # [A, F]
        if p["gate_proj_bias"] is not None:
            gate = gate + p["gate_proj_bias"][s.sorted_ids]
            up = up + p["up_proj_bias"][s.sorted_ids]
        hidden = self._act(gate, up)  # [A, F]
        out = ragged_dot(hidden, p["down_proj"], s.group_sizes)  # [A, D]
        if p["down_proj_bias"] is not None:
            out = out + p["down_proj_bias"][s.sorted_ids]
        return dispatch.combine_rows(out, s.position, weights)
