"""The two forms that sped up the training step (#43), each against the form it replaced.

* Causal attention without a cache takes its queries in blocks, each over the keys up to its
  own last position (``Attention._attend``; ``QUERY_BLOCKS`` blocks of at least
  ``MIN_QUERY_BLOCK`` positions): the logits and gradients equal one block's.
* Projections merge the token dims ``[B, T]`` into one before the matmul
  (``posttrain.layers.mlp.token_einsum``), unless the mesh shards the sequence.
* The softmax divides after the weighted sum of the values
  (``attention.softmax_attend``): values and gradients equal ``jax.nn.softmax``'s.

The tests lower ``MIN_QUERY_BLOCK`` so that the tiny presets' short sequences are blocked.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain import sharding
from posttrain.layers import attention
from posttrain.layers.mlp import token_einsum
from posttrain.models import build_model, get_config
from tests.jaxprs import matmuls, scoped_primitives

pytestmark = pytest.mark.matmul_precision("highest")

BATCH, SEQ = 3, 37  # 4 blocks of 9, 9, 10, 9 queries with MIN_QUERY_BLOCK = 8
PAD = 6  # row 1 right-padded, row 2 left-padded (its first PAD queries see no key)


def _mask() -> np.ndarray:
    """Tunix's ``[B, T, T]`` causal-and-padding mask and the ``[B, T]`` queries that see a key."""
    valid = np.ones((BATCH, SEQ), bool)
    valid[1, SEQ - PAD :] = False
    valid[2, :PAD] = False
    causal = np.tril(np.ones((SEQ, SEQ), bool))
    return causal[None] & valid[:, None, :], valid


def _loss_logits_grads(model, tokens, mask, valid):
    graph, params, rest = nnx.split(model, nnx.Param, ...)
    positions = jnp.broadcast_to(jnp.arange(SEQ), tokens.shape)

    def loss(p):
        logits = nnx.merge(graph, p, rest)(tokens, positions, None, mask)[0].astype(jnp.float32)
        return jnp.sum(jnp.where(valid[..., None], jax.nn.log_softmax(logits), 0.0)), logits

    (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return np.asarray(logits), [np.asarray(g, np.float32) for g in jax.tree.leaves(grads)]


def score_queries(jaxpr, kv_heads: int = 4, groups: int = 2) -> list[int]:
    """The query lengths T of the attention's score matmuls (queries ``[B, T, K, G, H]``),
    in the traced order (the tiny presets: 4 kv heads, 2 query heads each)."""
    return [
        shape[1]
        for shapes, _ in matmuls(jaxpr.jaxpr)
        for shape in shapes
        if len(shape) == 5 and shape[2:4] == (kv_heads, groups)
    ]


def _score_queries(model, tokens, mask) -> list[int]:
    positions = jnp.broadcast_to(jnp.arange(SEQ), tokens.shape)
    return score_queries(jax.make_jaxpr(lambda t, m: model(t, positions, None, m)[0])(tokens, mask))


@pytest.mark.parametrize(
    ("name", "dtype", "rel"),
    [
        # slow tier: gpt_oss's float32 case takes the same blocks (GQA too), with a window
        pytest.param("qwen3-tiny", "float32", 1e-5, marks=pytest.mark.slow),  # qk-norm, GQA
        ("gpt_oss-tiny", "float32", 1e-5),  # sinks, a sliding window layer
        ("qwen3-tiny", "bfloat16", 1e-2),  # bf16's rounding of other-sized sums
    ],
    ids=["qwen3-tiny-float32-1e-05", "gpt_oss-tiny-float32-1e-05", "qwen3-tiny-bfloat16-0.01"],
)
# on a chip: the dtype users train in (float32 on the CPU)
@pytest.mark.chip_sample("qwen3-tiny-bfloat16-0.01")
def test_causal_query_blocks_give_one_block_s_logits_and_gradients(name, dtype, rel, monkeypatch):
    """With padding on either side, a sliding window and sinks: the blocked attention's
    logits (at every query that sees a key) and parameter gradients equal one block's,
    and the blocks are really taken (their score matmuls have 9, 9, 10, 9 queries).
    A block reading the keys up to its first position instead of its last fails."""
    monkeypatch.setattr(attention, "MIN_QUERY_BLOCK", 8)
    model = build_model(get_config(name, dtype=dtype, param_dtype=dtype), seed=0)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (BATCH, SEQ)), jnp.int32)
    mask, valid = _mask()
    assert _score_queries(model, tokens, mask)[:4] == [9, 9, 10, 9]
    logits, grads = _loss_logits_grads(model, tokens, mask, valid)
    monkeypatch.setattr(attention, "QUERY_BLOCKS", 1)
    assert set(_score_queries(model, tokens, mask)) == {SEQ}
    one_logits, one_grads = _loss_logits_grads(model, tokens, mask, valid)
    assert _scaled_error(logits[valid], one_logits[valid]) <= rel
    # bf16: a gradient of either form is itself up to ~2e-2 of its scale from float32's (a
    # v5e measured the blocked form's 1.9e-2, one block's 2.1e-2, and 1.02e-2 between them;
    # this CPU 2.4e-2 each, 8.9e-4 between): the forms differ by at most that much
    bf16_error = _float32_errors(model, name, tokens, mask, valid, one_grads)
    for got, want, own in zip(grads, one_grads, bf16_error, strict=True):
        assert _scaled_error(got, want) <= max(rel, own)


def _float32_errors(model, name, tokens, mask, valid, grads) -> list[float]:
    """Each bf16 gradient's error against the float32 model's with the same parameters
    (zeros for a float32 model: its forms are held to ``rel`` alone)."""
    if all(g.dtype == np.float32 for g in jax.tree.leaves(nnx.state(model, nnx.Param))):
        return [0.0] * len(grads)
    reference = build_model(get_config(name), seed=0)
    graph, params, rest = nnx.split(reference, nnx.Param, ...)
    params = jax.tree.map(
        lambda ours, theirs: ours.astype(theirs.dtype), nnx.state(model, nnx.Param), params
    )
    _, reference_grads = _loss_logits_grads(nnx.merge(graph, params, rest), tokens, mask, valid)
    return [_scaled_error(g, r) for g, r in zip(grads, reference_grads, strict=True)]


def _scaled_error(got, want) -> float:
    """The largest difference over the largest magnitude (the matmuls of other sizes sum
    in another order: fp32 differences ~1e-6 of the scale)."""
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def test_a_model_that_sees_images_bidirectionally_attends_in_one_block(monkeypatch):
    """An image's tokens see its later tokens (``VisionConfig.bidirectional``), which a
    causal block would cut off (row 0's image spans the first block edge): such a model's
    text attention is not causal, and its logits equal one block's."""
    from tests.path_params import model_with_path_values
    from tests.test_vision import TOKENS, forward, images, native_images
    from tests.test_vision_bidirectional import BIDIRECTIONAL

    monkeypatch.setattr(attention, "MIN_QUERY_BLOCK", 2)  # edges 0, 4, 8, 12, 16
    model = model_with_path_values(get_config("llama3-tiny").replace(vision=BIDIRECTIONAL))
    assert not model.model.layers[0].self_attn.causal
    args = jnp.asarray(TOKENS), native_images(images())
    blocked = np.asarray(forward(model, *args))
    monkeypatch.setattr(attention, "QUERY_BLOCKS", 1)
    np.testing.assert_array_equal(blocked, np.asarray(forward(model, *args)))
    assert build_model(get_config("llama3-tiny"), seed=0).model.layers[0].self_attn.causal


@pytest.mark.slow  # 14 s; the gate keeps a context-sharded forward (test_splash_attention's)
@pytest.mark.devices(8)
def test_a_sharded_sequence_keeps_its_queries_and_tokens_whole(monkeypatch):
    """With the sequence split over ``context``, neither form applies (each would reshard
    the sequence): one score matmul per layer over all queries, projections over
    ``[B, T, D]``; the logits equal the single-device blocked ones."""
    monkeypatch.setattr(attention, "MIN_QUERY_BLOCK", 8)
    cfg = get_config("qwen3-tiny")
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (4, 32)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(32), tokens.shape)
    single = np.asarray(build_model(cfg, seed=0)(tokens, positions, None, None)[0])
    mesh = sharding.make_mesh({"context": 2, "fsdp": 4})
    model = build_model(cfg, mesh, seed=0)
    with sharding.use_mesh(mesh):
        jaxpr = jax.make_jaxpr(lambda t: model(t, positions, None, None)[0])(tokens)
        logits = nnx.jit(lambda m, t: m(t, positions, None, None)[0])(model, tokens)
    assert set(score_queries(jaxpr)) == {32}
    operands = [shape for shapes, _ in matmuls(jaxpr.jaxpr) for shape in shapes]
    assert not [s for s in operands if s[0] == 4 * 32], operands  # no [B*T, ...] operand
    np.testing.assert_allclose(np.asarray(logits), single, atol=1e-5)


@pytest.mark.parametrize(
    ("spec", "x_shape", "k_shape", "merged"),
    [
        ("...i,io->...o", (2, 5, 3), (3, 4), (10, 3)),
        ("...d,dnh->...nh", (2, 5, 3), (3, 2, 4), (10, 3)),
        ("...nh,nhd->...d", (2, 5, 2, 4), (2, 4, 3), (10, 2, 4)),
        ("...d,vd->...v", (5, 3), (7, 3), (5, 3)),  # one token dim: as it is
    ],
)
def test_token_einsum_merges_the_token_dims_and_keeps_the_values(spec, x_shape, k_shape, merged):
    """Values and gradients equal ``jnp.einsum``'s; the matmul's first operand has the
    token dims merged (``[B*T, *in]``)."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal(x_shape), jnp.float32)
    k = jnp.asarray(rng.standard_normal(k_shape), jnp.float32)

    @jax.jit  # one program for both forms (on a chip each eager op is a compile)
    def values_and_grads(x, k):
        def grads(einsum):
            return jax.grad(lambda x, k: jnp.sum(jnp.sin(einsum(spec, x, k))), (0, 1))(x, k)

        return (
            token_einsum(spec, x, k),
            jnp.einsum(spec, x, k),
            grads(token_einsum),
            grads(jnp.einsum),
        )

    got, want, ours, theirs = values_and_grads(x, k)
    np.testing.assert_allclose(got, want, atol=1e-6)
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    jaxpr = jax.make_jaxpr(lambda x, k: token_einsum(spec, x, k))(x, k)
    assert [shapes for shapes, _ in matmuls(jaxpr.jaxpr)] == [(merged, k_shape)]


def _head_projection_matmuls(projection, x) -> list:
    jaxpr = jax.make_jaxpr(lambda x: projection(x))(x)
    return [shapes[1] for shapes, _ in matmuls(jaxpr.jaxpr)]


def test_head_projections_multiply_a_matrix_unless_qwix_may_intercept():
    """A q/k/v projection multiplies its kernel as a ``[D, heads * H]`` matrix, with the
    values and gradients of the einsum over ``[D, heads, H]``; inside a Qwix pass and once
    it holds LoRA adapters it hands Qwix the kernel itself (Qwix matches the einsum's
    operand to the weight by identity; a reshaped kernel would get no adapter)."""
    from posttrain.layers.mlp import qwix_pass

    d_model, heads, head_dim = 12, 3, 4
    projection = attention.HeadProjection(
        d_model,
        heads,
        head_dim,
        "heads",
        use_bias=True,
        rngs=nnx.Rngs(0),
        dtype=jnp.float32,
        param_dtype=jnp.float32,
    )
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 5, d_model)), jnp.float32)
    assert _head_projection_matmuls(projection, x) == [(d_model, heads * head_dim)]
    with qwix_pass():
        assert _head_projection_matmuls(projection, x) == [(d_model, heads, head_dim)]
    assert _head_projection_matmuls(projection, x) == [(d_model, heads * head_dim)]  # reset

    graphdef, state = nnx.split(projection)

    def objective(state, x, intercepted):
        with qwix_pass() if intercepted else contextlib.nullcontext():
            return jnp.sum(jnp.sin(nnx.merge(graphdef, state)(x)))

    @jax.jit  # one program (on a chip each eager op is a compile)
    def values_and_grads(state, x):
        kernel, bias = state["kernel"][...], state["bias"][...]
        return (
            nnx.merge(graphdef, state)(x),
            jnp.einsum("btd,dnh->btnh", x, kernel) + bias,
            *(jax.grad(objective, (0, 1))(state, x, intercepted) for intercepted in (False, True)),
        )

    got, want, matrix, einsum = values_and_grads(state, x)
    np.testing.assert_allclose(got, want, atol=1e-6)
    for a, b in zip(jax.tree.leaves(matrix), jax.tree.leaves(einsum), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)

    projection.kernel_lora_a = nnx.LoRAParam(jnp.zeros((d_model, 2)))
    assert _head_projection_matmuls(projection, x)[0] == (d_model, heads, head_dim)


def _normalised_attention(q, k, v, mask, sinks, scale):
    """The form ``softmax_attend`` replaced: ``jax.nn.softmax`` over the masked scores and
    the sink column, then the weighted sum."""
    s = jnp.einsum("btkgh,bskh->bkgts", q.astype(jnp.float32), k) * scale
    s = jnp.where(mask[:, None, None], s, jnp.finfo(jnp.float32).min)
    if sinks is not None:
        column = jnp.broadcast_to(sinks[None, :, :, None, None], (*s.shape[:-1], 1))
        s = jnp.concatenate([s, column], axis=-1)
    probs = jax.nn.softmax(s, axis=-1)[..., : k.shape[1]]
    return jnp.einsum("bkgts,bskh->btkgh", probs, v)


@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize(
    ("seq", "keys", "q_dtype", "rel"),
    [
        (6, 6, "float32", 1e-5),  # square, as without a cache
        (3, 7, "float32", 1e-5),  # fewer queries than keys, as with a cache
        (6, 6, "bfloat16", 8e-3),  # bf16 queries; q's gradient may round to a neighbour
    ],
)
def test_softmax_attend_equals_the_normalised_softmax(seq, keys, q_dtype, rel, with_sinks):
    """Values and the gradients of q (in its dtype), k, v and the sinks equal the
    normalised softmax's, with a query that sees no key (it averages all values, or puts
    all weight on the sink) and large scores (the row maximum is taken out first)."""
    b, kv, g, h = 2, 2, 3, 4
    rng = np.random.default_rng(3)
    q = jnp.asarray(8 * rng.standard_normal((b, seq, kv, g, h)), q_dtype)
    k, v = (jnp.asarray(8 * rng.standard_normal((b, keys, kv, h)), jnp.float32) for _ in "kv")
    sinks = jnp.asarray(rng.standard_normal((kv, g)), jnp.float32) if with_sinks else None
    mask = np.tril(np.ones((seq, keys), bool), k=keys - seq)[None].repeat(b, 0)
    mask[1, 0] = False  # a query that sees no key
    mask = jnp.asarray(mask)
    weights = jnp.asarray(rng.standard_normal((b, seq, kv, g, h)), jnp.float32)

    def objective(form):
        def f(q, k, v, sinks):
            return jnp.sum(form(q, k, v, mask, sinks, h**-0.5) * weights)

        return jax.value_and_grad(f, argnums=(0, 1, 2, 3) if with_sinks else (0, 1, 2))

    @jax.jit  # one program for both forms (on a chip each eager op is a compile)
    def outputs(q, k, v, sinks):
        got, want = (
            objective(form)(q, k, v, sinks)
            for form in (attention.softmax_attend, _normalised_attention)
        )
        return got, want, attention.softmax_attend(q, k, v, mask, sinks, h**-0.5)

    got, want, out = outputs(q, k, v, sinks)
    assert out.dtype == jnp.float32 and out.shape == (b, seq, kv, g, h)
    # no key: the mean of the values (HF's eager attention), or with a sink all weight on it
    mean = np.broadcast_to(np.asarray(v)[1].mean(0)[:, None], (kv, g, h))
    np.testing.assert_allclose(out[1, 0], 0 * mean if with_sinks else mean, atol=1e-5)
    assert _scaled_error(np.asarray(got[0]), np.asarray(want[0])) <= rel
    for mine, theirs in zip(got[1], want[1], strict=True):
        assert mine.dtype == theirs.dtype
        assert _scaled_error(np.asarray(mine, np.float32), np.asarray(theirs, np.float32)) <= rel


def test_softmax_attend_names_its_stages():
    """The stage scopes Attention's docstring promises for profiles: the scores' matmul
    under ``attention_scores``, the exponential (and no matmul) under
    ``attention_softmax``, the weighted sum's matmul under ``attention_out``."""
    q = jnp.ones((1, 4, 2, 2, 8), jnp.float32)
    k = jnp.ones((1, 4, 2, 8), jnp.float32)
    mask = jnp.ones((1, 4, 4), bool)
    jaxpr = jax.make_jaxpr(lambda q: attention.softmax_attend(q, k, k, mask, None, 0.5))(q)
    scopes = scoped_primitives(jaxpr.jaxpr)
    assert "dot_general" in scopes["attention_scores"]
    assert "exp" in scopes["attention_softmax"]
    assert "dot_general" not in scopes["attention_softmax"]
    assert "dot_general" in scopes["attention_out"]
