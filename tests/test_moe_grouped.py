"""posttrain.layers.moe.grouped: the chunks each expert's blocks go through, what its
forward keeps for the backward, and the backward's float32 sums. Its values and gradients
against the dense algorithm: tests/test_moe.py (every_algorithm_*)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.config import ActivationConfig
from posttrain.layers.moe.grouped import _each_chunk, grouped_mlp
from tests.jaxprs import equations

SILU = ActivationConfig("silu", 1.702, 7.0)
# E experts of D -> F -> D; blocks of S rows; chunk rows (8, 4, 2) distinct from D and F
E, D, F, S, CHUNKS = 5, 5, 7, 2, (4, 2, 1)
BLOCKS_PER_EXPERT = (9, 0, 4, 1, 6)  # twice the largest chunk, none, exactly one, ...
NB = 24  # 20 used, 4 unused at the end
P = NB * S


def block_ends() -> jax.Array:
    return jnp.asarray(np.cumsum(BLOCKS_PER_EXPERT), jnp.int32)  # [E]


@jax.jit
def _chunk_counts(ends):
    """Per expert, the calls of each chunk size, and how often each block was covered."""
    sizes = {blocks * S: i for i, blocks in enumerate(CHUNKS)}

    def body(first, rows, carry):
        calls, covered = carry
        calls = calls.at[sizes[rows]].add(1)
        block = first // S
        seen = jax.lax.dynamic_slice_in_dim(covered, block, rows // S) + 1
        return calls, jax.lax.dynamic_update_slice_in_dim(covered, seen, block, 0)

    def expert(e):
        start = (jnp.zeros(len(CHUNKS), jnp.int32), jnp.zeros(NB, jnp.int32))
        return _each_chunk(ends, e, CHUNKS, S, body, start)

    return jax.vmap(expert)(jnp.arange(E))  # [E, len(CHUNKS)], [E, NB]


def test_each_expert_goes_through_the_binary_decomposition_of_its_blocks():
    """Each chunk size runs while that many of the expert's blocks are left, largest
    first: 9 blocks as 4 + 4 + 1, 4 as one 4, 6 as 4 + 2; every used block is covered
    once, by its own expert, and the unused ones never."""
    calls, covered = _chunk_counts(block_ends())
    want = [[2, 0, 1], [0, 0, 0], [1, 0, 0], [0, 0, 1], [1, 1, 0]]
    np.testing.assert_array_equal(np.asarray(calls), want)
    owner = np.repeat(np.arange(E), BLOCKS_PER_EXPERT)  # [20] expert of each used block
    expected = np.zeros((E, NB), np.int32)
    expected[owner, np.arange(owner.size)] = 1
    np.testing.assert_array_equal(np.asarray(covered), expected)


def test_chunks_must_end_in_one_block():
    """Chunk sizes that cannot reach every block (no 1 at the end) are refused when traced:
    the expert's last blocks would be left out without a word."""
    with pytest.raises(ValueError, match=r"^chunks=\(4, 2\) must end in 1"):
        _each_chunk(block_ends(), jnp.int32(0), (4, 2), S, lambda f, r, c: c, 0)


def _inputs(dtype):
    keys = iter(jax.random.split(jax.random.key(0), 8))

    def draw(*shape):
        return jax.random.normal(next(keys), shape, jnp.float32).astype(dtype)

    params = {
        "gate_proj": draw(E, D, F),
        "up_proj": draw(E, D, F),
        "down_proj": draw(E, F, D),
        "gate_proj_bias": draw(E, F),
        "up_proj_bias": draw(E, F),
        "down_proj_bias": draw(E, D),
    }
    return draw(P, D), params


def _shapes(jaxpr) -> set[tuple[int, ...]]:
    return {tuple(v.aval.shape) for eqn in equations(jaxpr) for v in eqn.outvars}


def test_only_the_differentiated_forward_keeps_the_projections():
    """The forward alone writes no ``[P, F]`` buffer; under ``jax.grad`` it keeps the gate
    and up projections of every row for the backward."""
    rows, params = _inputs(jnp.float32)

    def out(rows):
        return grouped_mlp(rows, block_ends(), params, SILU, S, CHUNKS)

    assert (P, F) not in _shapes(jax.make_jaxpr(out)(rows).jaxpr)
    grad = jax.make_jaxpr(jax.grad(lambda r: out(r).sum()))(rows).jaxpr
    assert (P, F) in _shapes(grad)


def test_the_backward_sums_bf16_weight_gradients_in_float32():
    """In bfloat16, every chunk's weight-gradient product and bias sum is float32 (summed
    over the expert's chunks in float32, rounded once), and the gradients come back in the
    parameters' bfloat16."""
    rows, params = _inputs(jnp.bfloat16)

    def loss(params, rows):
        y = grouped_mlp(rows, block_ends(), params, SILU, S, CHUNKS)
        return y.astype(jnp.float32).sum()

    jaxpr = jax.make_jaxpr(jax.grad(loss))(params, rows).jaxpr
    weight_grads = [
        str(eqn.outvars[0].aval.dtype)
        for eqn in equations(jaxpr)
        if eqn.primitive.name == "dot_general" and eqn.outvars[0].aval.shape in ((D, F), (F, D))
    ]
    assert len(weight_grads) == 3 * len(CHUNKS), weight_grads  # 3 kernels per chunk loop
    assert set(weight_grads) == {"float32"}, weight_grads
    bias_sums = [
        str(eqn.invars[0].aval.dtype)
        for eqn in equations(jaxpr)
        if eqn.primitive.name == "reduce_sum" and eqn.outvars[0].aval.shape in ((D,), (F,))
    ]
    assert len(bias_sums) == 3 * len(CHUNKS) and set(bias_sums) == {"float32"}, bias_sums
    rounded = [  # jnp.sum of a bfloat16 sums in float32, then rounds unless told otherwise
        eqn.outvars[0].aval.shape
        for eqn in equations(jaxpr)
        if eqn.primitive.name == "convert_element_type"
        and str(eqn.outvars[0].aval.dtype) == "bfloat16"
        and eqn.outvars[0].aval.shape in ((D,), (F,))
    ]
    assert len(rounded) == 3, rounded  # each bias's gradient once, after its expert's chunks
    grads = jax.grad(loss)(params, rows)
    assert {str(g.dtype) for g in jax.tree.leaves(grads)} == {"bfloat16"}
