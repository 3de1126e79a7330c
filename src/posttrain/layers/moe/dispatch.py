"""Stage 2 of the MoE block: capacity, sorting assignments by expert, gather and combine.

An *assignment* is one (token, slot) pair of the router's ``[tokens, top_k]``
choice; there are A = T * R of them, numbered ``t * R + r`` (token order, then
slot). Every layout here has static shapes computed from T, R, E and the block
size, so the stages jit once per input shape.

Dimension legend (STYLE.md): T tokens, D d_model, E num_experts, R top_k,
A = T*R assignments, NB blocks, S block_size.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

_MIN_BLOCK, _MAX_BLOCK = 8, 512


def expert_capacity(num_assignments: int, num_experts: int, capacity_factor: float) -> int:
    """Assignments each expert keeps: ``ceil(capacity_factor * T * R / E)``.

    Reference: Fedus et al. 2021, "Switch Transformers", section 2.2 (expert capacity).
    """
    return math.ceil(capacity_factor * num_assignments / num_experts)


def capacity_mask(
    expert_ids: jax.Array, num_experts: int, capacity_factor: float | None
) -> jax.Array:
    """Which assignments an expert with limited capacity keeps.

    Each expert keeps its first :func:`expert_capacity` assignments in token
    order, then slot order (priority by token index, then slot); later ones are
    dropped.

    Args:
      expert_ids: ``[tokens, top_k]`` int expert of each assignment.
      num_experts: E.
      capacity_factor: ``None`` keeps everything (dropless).

    Returns:
      ``[tokens, top_k]`` bool, true where the assignment is kept.
    """
    if capacity_factor is None:
        return jnp.ones(expert_ids.shape, bool)
    cap = expert_capacity(expert_ids.size, num_experts, capacity_factor)
    rank = sort_by_expert(expert_ids, num_experts).rank  # [T, R]
    return rank < cap


class SortedAssignments(NamedTuple):
    """Assignments sorted by expert (stable, so token order within an expert).

    Attributes:
      order: ``[A]`` int32, flat assignment index at each sorted position.
      sorted_ids: ``[A]`` int32, expert at each sorted position (non-decreasing).
      group_sizes: ``[E]`` int32, assignments per expert.
      group_starts: ``[E]`` int32, first sorted position of each expert.
      rank: ``[tokens, top_k]`` int32, position of each assignment within its expert.
      position: ``[tokens, top_k]`` int32, sorted position of each assignment.
    """

    order: jax.Array
    sorted_ids: jax.Array
    group_sizes: jax.Array
    group_starts: jax.Array
    rank: jax.Array
    position: jax.Array


def sort_by_expert(expert_ids: jax.Array, num_experts: int) -> SortedAssignments:
    """Sorts the ``[tokens, top_k]`` assignments by expert, keeping token order.

    Args:
      expert_ids: ``[tokens, top_k]`` int expert of each assignment.
      num_experts: E.
    """
    shape = expert_ids.shape
    flat = expert_ids.reshape(-1).astype(jnp.int32)  # [A]
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)  # [A] sorted by expert
    sorted_ids = flat[order]  # [A]
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)  # [E]
    group_starts = jnp.cumsum(group_sizes) - group_sizes  # [E]
    arange = jnp.arange(flat.size, dtype=jnp.int32)  # [A]
    position = jnp.zeros_like(arange).at[order].set(arange, unique_indices=True)  # [A]
    rank = position - group_starts[flat]  # [A]
    rank, position = rank.reshape(shape), position.reshape(shape)  # [T, R]
    return SortedAssignments(order, sorted_ids, group_sizes, group_starts, rank, position)


def default_block_size(num_assignments: int, num_experts: int) -> int:
    """Rows per block of the ``sorted`` algorithm when ``MoEConfig.block_size`` is None.

    The power of two at or below an eighth of the mean assignments per expert, A / (8E),
    clamped to [8, 512]. Each expert pads its rows to whole blocks (under one block of
    padding per expert), and the grouped matmul multiplies its blocks in chunks of up to
    the mean (:func:`chunk_blocks`), so small blocks cost little. In
    ``benchmarks/model_step.py --family qwen3_moe``'s step (E = 16, top-2, A / E = 256) on
    a 2-core CPU, blocks of 32 rows (this rule) beat 16, 64 and 128 by 1.6, 3.5 and 6.4 %
    (medians of 9 interleaved rounds). The clamp keeps tiny inputs from making 1-row
    blocks. Static: it depends only on shapes.
    """
    mean = max(num_assignments / (8 * num_experts), 1.0)
    size = 2 ** int(math.floor(math.log2(mean)))
    return int(min(max(size, _MIN_BLOCK), _MAX_BLOCK))


def chunk_blocks(num_assignments: int, num_experts: int, block_size: int) -> tuple[int, ...]:
    """Chunk sizes, in blocks, of the grouped matmul (:mod:`.grouped`), largest first.

    The powers of two from 1 up to the largest whose rows stay within both the mean
    assignments per expert, A / E, and 512 rows: an expert with the mean count goes
    through one or two large matmuls, and no chunk is mostly the padding of a cold
    expert. ``(1,)`` when a block already holds the mean. Static: shapes only.
    """
    reach = min(max(num_assignments / num_experts, block_size), max(_MAX_BLOCK, block_size))
    top = int(math.floor(math.log2(reach / block_size)))  # >= 0
    return tuple(2**j for j in range(top, -1, -1))


def num_blocks_bound(num_assignments: int, num_experts: int, block_size: int) -> int:
    """Static upper bound on the blocks of the sorted layout.

    sum_e ceil(c_e / S) <= floor((A + n (S - 1)) / S) with n = min(E, A) the most
    experts that can be non-empty; this is at most ``ceil(A / S) + E``.
    """
    busy = min(num_experts, num_assignments)
    return (num_assignments + busy * (block_size - 1)) // block_size


class BlockLayout(NamedTuple):
    """Assignments sorted by expert with each expert's rows padded to whole blocks.

    Attributes:
      row_token: ``[NB * S]`` int32, token feeding each padded row (0 for padding
        rows, whose outputs are never read).
      block_ends: ``[E]`` int32, cumulative blocks per expert: expert e owns the blocks
        ``[block_ends[e - 1], block_ends[e])``; blocks from ``block_ends[-1]`` to NB are
        unused.
      assignment_row: ``[tokens, top_k]`` int32, padded row of each assignment.
      block_size: S.
    """

    row_token: jax.Array
    block_ends: jax.Array
    assignment_row: jax.Array
    block_size: int


def block_layout(expert_ids: jax.Array, num_experts: int, block_size: int) -> BlockLayout:
    """Builds the block-sorted layout of the ``[tokens, top_k]`` assignments.

    Expert e's rows start at a multiple of ``block_size`` and occupy
    ``ceil(count_e / block_size)`` whole blocks, so every block belongs to one
    expert. The number of blocks is the static :func:`num_blocks_bound`.

    Args:
      expert_ids: ``[tokens, top_k]`` int expert of each assignment.
      num_experts: E.
      block_size: S, rows per block.

    Reference: the block-sparse layout of MegaBlocks (Gale et al. 2022), with
    dense per-block matmuls instead of block-sparse kernels.
    """
    num_tokens, top_k = expert_ids.shape
    s = sort_by_expert(expert_ids, num_experts)
    num_blocks = num_blocks_bound(expert_ids.size, num_experts, block_size)
    blocks_per_expert = (s.group_sizes + block_size - 1) // block_size  # [E]
    block_ends = jnp.cumsum(blocks_per_expert)  # [E]
    padded_starts = (block_ends - blocks_per_expert) * block_size  # [E]
    flat_ids = expert_ids.reshape(-1)  # [A]
    assignment_row = padded_starts[flat_ids] + s.rank.reshape(-1)  # [A]
    tokens = jnp.arange(expert_ids.size, dtype=jnp.int32) // top_k  # [A]
    row_token = (
        jnp.zeros((num_blocks * block_size,), jnp.int32)
        .at[assignment_row]
        .set(tokens, unique_indices=True)
    )  # [NB * S]
    return BlockLayout(
        row_token,
        block_ends.astype(jnp.int32),
        assignment_row.reshape(num_tokens, top_k),
        block_size,
    )


def combine_rows(rows: jax.Array, assignment_row: jax.Array, weights: jax.Array) -> jax.Array:
    """Weighted sum, per token, of the expert output rows of its assignments.

    A gather (each token reads its R rows) rather than a scatter-add of rows
    into tokens, so the float32 sum has a fixed order: deterministic.

    Args:
      rows: ``[rows, d_model]`` expert outputs, any float dtype.
      assignment_row: ``[tokens, top_k]`` int, row of each assignment.
      weights: ``[tokens, top_k]`` float32 routing weights (0 for dropped ones).

    Returns:
      ``[tokens, d_model]`` float32.
    """
    picked = rows[assignment_row].astype(jnp.float32)  # [T, R, D]
    return jnp.einsum("trd,tr->td", picked, weights.astype(jnp.float32))  # [T, D]
