"""The ``sorted`` algorithm's grouped matmul: each expert's weights read once, its rows
multiplied in chunks, and a backward written out by hand.

The rows come sorted by expert with each expert's rows padded to whole blocks of S rows
(:func:`posttrain.layers.moe.dispatch.block_layout`), so expert e owns the blocks
``[block_ends[e - 1], block_ends[e])``. A loop over the experts slices expert e's weights
once, then multiplies its blocks in chunks of ``k`` blocks for each ``k`` of ``chunks``,
largest first, the last one block (``while`` loops with data-dependent trip counts: a
chunk size runs while at least that many of the expert's blocks are left). With
power-of-two chunks that is the binary decomposition of the expert's block count: most
rows go through a few large matmuls, and the padding stays under one small block per
expert.

Why by hand: JAX differentiates a ``while`` loop of data-dependent length in forward mode
only. The backward (:func:`_grouped_bwd`) runs the same loops, recomputes each chunk's
activation from the saved gate and up projections, and accumulates each expert's weight
gradients in float32 across its chunks, written once per expert. Against the scan over
fixed blocks it replaced (a ``cond`` per block to skip the unused ones, each block's
weight slices taken again in its backward), the Qwen3-MoE step of
``benchmarks/model_ab.py --form grouped`` takes 0.79-0.81x the time, its forward 0.82x.

Dimension legend (STYLE.md): D d_model, F moe_d_ff, E num_experts, S block size (rows),
NB blocks, P = NB * S padded rows, C chunk rows.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from posttrain.config import ActivationConfig
from posttrain.layers.mlp import gated_activation

KERNELS = ("gate_proj", "up_proj", "down_proj")  # [E, D, F], [E, D, F], [E, F, D]
BIASES = ("gate_proj_bias", "up_proj_bias", "down_proj_bias")  # [E, F], [E, F], [E, D]
Params = dict[str, jax.Array | None]  # KERNELS and BIASES (None where absent)


def _each_chunk(
    block_ends: jax.Array,
    expert: jax.Array,
    chunks: tuple[int, ...],
    block_size: int,
    body: Callable,
    carry,
):
    """``carry = body(first row, rows, carry)`` over expert ``expert``'s chunks: each
    chunk size of ``chunks`` (blocks, largest first, the last 1) while that many of its
    blocks are left. ``rows`` is static, the first row traced.

    Raises:
      ValueError: ``chunks`` does not end in 1 (the expert's last blocks would be skipped).
    """
    if chunks[-1:] != (1,):
        raise ValueError(f"chunks={chunks} must end in 1 (block), largest first")
    start = jnp.where(expert == 0, 0, block_ends[jnp.maximum(expert - 1, 0)])
    end = block_ends[expert]
    position = start
    for blocks in chunks:

        def more(state, blocks=blocks):
            return state[0] + blocks <= end

        def step(state, blocks=blocks):
            at, inner = state
            return at + blocks, body(at * block_size, blocks * block_size, inner)

        position, carry = jax.lax.while_loop(more, step, (position, carry))
    return carry


def _rows(array: jax.Array, first: jax.Array, count: int) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(array, first, count)  # [C, ...]


def _put(array: jax.Array, update: jax.Array, first: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(array, update.astype(array.dtype), first, 0)


def _times_transposed(a: jax.Array, kernel: jax.Array) -> jax.Array:
    """``a @ kernel.T`` (its dtype): ``[C, K] x [N, K] -> [C, N]``, one dot over both
    operands' minor dims, so that XLA reads the kernel as it lies. The backward took
    ``kernel.T`` once per expert before its chunk loops, a transposed copy of each kernel
    that XLA cannot fold into the dots inside the loops; without those copies the
    Qwen3-MoE step of ``benchmarks/model_step.py`` takes 0.96-0.97x the time (an A/B of
    the two backwards in one process)."""
    return jax.lax.dot_general(a, kernel, (((1,), (1,)), ((), ())))


def _expert(params: Params, expert: jax.Array) -> Params:
    """Expert ``expert``'s weights and biases: ``[D, F]``, ``[F, D]``, ``[F]``, ``[D]``."""
    return {name: None if v is None else v[expert] for name, v in params.items()}


def _forward_loops(rows, block_ends, params, activation, block_size, chunks, keep):
    """``(out [P, D], gate [P, F], up [P, F])``; gate and up are ``[0, F]`` unless
    ``keep`` (the backward's residuals)."""
    padded, d_model = rows.shape
    kept = padded if keep else 0
    d_ff = params["gate_proj"].shape[-1]

    def expert(e, carry):
        w = _expert(params, e)

        def chunk(first, count, carry):
            out, gate_all, up_all = carry
            x = _rows(rows, first, count)  # [C, D]
            gate, up = x @ w["gate_proj"], x @ w["up_proj"]  # [C, F]
            if w["gate_proj_bias"] is not None:
                gate, up = gate + w["gate_proj_bias"], up + w["up_proj_bias"]
            y = gated_activation(gate, up, activation) @ w["down_proj"]  # [C, D]
            if w["down_proj_bias"] is not None:
                y = y + w["down_proj_bias"]
            if keep:
                gate_all, up_all = _put(gate_all, gate, first), _put(up_all, up, first)
            return _put(out, y, first), gate_all, up_all

        return _each_chunk(block_ends, e, chunks, block_size, chunk, carry)

    init = (
        jnp.zeros((padded, d_model), rows.dtype),
        jnp.zeros((kept, d_ff), rows.dtype),
        jnp.zeros((kept, d_ff), rows.dtype),
    )
    return jax.lax.fori_loop(0, params["gate_proj"].shape[0], expert, init)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def grouped_mlp(
    rows: jax.Array,
    block_ends: jax.Array,
    params: Params,
    activation: ActivationConfig,
    block_size: int,
    chunks: tuple[int, ...],
) -> jax.Array:
    """Each expert's gated MLP on its own rows.

    Args:
      rows: ``[P, D]`` sorted by expert, expert e's rows in blocks
        ``[block_ends[e - 1], block_ends[e])`` of ``block_size`` rows (padding rows
        included; their outputs are computed and must not be read).
      block_ends: ``[E]`` int32, cumulative blocks per expert.
      params: ``gate_proj``, ``up_proj`` ``[E, D, F]``, ``down_proj`` ``[E, F, D]``,
        ``gate_proj_bias``, ``up_proj_bias`` ``[E, F]`` and ``down_proj_bias`` ``[E, D]``
        or ``None``, all in the rows' dtype.
      activation: the gated nonlinearity (:func:`posttrain.layers.mlp.gated_activation`).
      block_size: S.
      chunks: chunk sizes in blocks, largest first, ending in 1
        (:func:`posttrain.layers.moe.dispatch.chunk_blocks`).

    Returns:
      ``[P, D]`` in the rows' dtype; rows past ``block_ends[-1] * S`` are zero.
    """
    return _forward_loops(rows, block_ends, params, activation, block_size, chunks, False)[0]


def _grouped_fwd(rows, block_ends, params, activation, block_size, chunks):
    out, gate, up = _forward_loops(rows, block_ends, params, activation, block_size, chunks, True)
    return out, (rows, block_ends, params, gate, up)


def _grouped_bwd(activation, block_size, chunks, residuals, d_out):
    """Cotangents of ``rows`` and ``params`` from ``d_out`` ``[P, D]``. Per chunk, with
    ``h = act(gate, up)``: ``d_down += h^T d_out``, ``d_h = d_out down^T``, ``(d_gate,
    d_up)`` from the activation's VJP, ``d_gate_proj += x^T d_gate`` (up alike), and
    ``d_x = d_gate gate_proj^T + d_up up_proj^T``; bias gradients are the column sums.
    Padding rows have a zero ``d_out`` (nothing reads them), so they add nothing."""
    rows, block_ends, params, gate_all, up_all = residuals

    def act(gate, up):
        return gated_activation(gate, up, activation)

    def expert(d_rows, e):
        w = _expert(params, e)
        grads = {
            name: jnp.zeros(w[name].shape, jnp.float32)
            for name in KERNELS + BIASES
            if w[name] is not None
        }  # float32 accumulators over the expert's chunks

        def chunk(first, count, carry):
            d_rows, grads = carry
            x, gate, up = (_rows(a, first, count) for a in (rows, gate_all, up_all))
            d_y = _rows(d_out, first, count)  # [C, D]
            hidden, act_vjp = jax.vjp(act, gate, up)  # [C, F]
            d_gate, d_up = act_vjp(_times_transposed(d_y, w["down_proj"]))  # [C, F] each
            update = {
                "down_proj": jnp.dot(hidden.T, d_y, preferred_element_type=jnp.float32),
                "gate_proj": jnp.dot(x.T, d_gate, preferred_element_type=jnp.float32),
                "up_proj": jnp.dot(x.T, d_up, preferred_element_type=jnp.float32),
                "down_proj_bias": jnp.sum(d_y, axis=0, dtype=jnp.float32),
                "gate_proj_bias": jnp.sum(d_gate, axis=0, dtype=jnp.float32),
                "up_proj_bias": jnp.sum(d_up, axis=0, dtype=jnp.float32),
            }
            grads = {name: g + update[name] for name, g in grads.items()}
            d_x = _times_transposed(d_gate, w["gate_proj"])  # [C, D]
            d_x = d_x + _times_transposed(d_up, w["up_proj"])
            return _put(d_rows, d_x, first), grads

        d_rows, grads = _each_chunk(block_ends, e, chunks, block_size, chunk, (d_rows, grads))
        return d_rows, {name: g.astype(params[name].dtype) for name, g in grads.items()}

    experts = jnp.arange(params["gate_proj"].shape[0])  # [E]
    d_rows, d_params = jax.lax.scan(expert, jnp.zeros_like(rows), experts)  # [E, ...] each
    return d_rows, None, {name: d_params.get(name) for name in params}


grouped_mlp.defvjp(_grouped_fwd, _grouped_bwd)
