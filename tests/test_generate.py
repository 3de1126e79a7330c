"""KV-cache decoding and ``posttrain.generate``: incremental == full forward for every
family and layer type, greedy == a recompute loop and == transformers, the samplers'
distributions, the cache's memory, LoRA == merged, bad input."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain import families, generate, sharding
from posttrain.layers import kv_cache
from posttrain.models import CausalLM, build_model, get_config
from posttrain.models.presets import TINY_PRESETS
from tests.meshes import fitted
from tests.strategies import meshes, scaled

pytestmark = pytest.mark.matmul_precision("highest")

# fp32, one device: incremental and full forward differ by reassociation only
# (observed <= 4e-6 on logits ~3, past the sliding window, all families).
INCREMENTAL_ATOL = 1e-5
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19]]  # ragged: left-padded
STEPS = 12  # generated past the tiny presets' sliding window (8)


def padded(prompts=PROMPTS, pad=0):
    return generate.left_pad(prompts, pad)  # numpy: jnp.asarray would compile a transfer


@nnx.jit
def reference_logits(model, tokens, real):
    """Full forward of the padded batch: causal x real keys, positions per real token."""
    seq = tokens.shape[1]
    mask = jnp.tril(jnp.ones((seq, seq), bool))[None] & real[:, None, :]
    positions = jnp.maximum(jnp.cumsum(real, axis=1) - 1, 0)
    logits, _ = model(tokens, positions, None, mask)
    return logits


def _mask(real, queries, masked):
    """``[B, Q, S]``: the caller's mask for queries at slots ``queries`` ``[Q]``: causal over
    the slots x real keys (``"causal"``), every slot open (``"all"``), or ``None``."""
    if masked is None:
        return None
    batch, seq = real.shape
    if masked == "all":
        return jnp.ones((batch, queries.shape[0], seq), bool)
    return (jnp.arange(seq)[None, :] <= queries[:, None])[None] & real[:, None, :]


@functools.partial(nnx.jit, static_argnames=("prefill", "masked"))
def _prefill(model, tokens, real, prefill: int, masked):
    """The first ``prefill`` tokens into an empty cache: ``(logits, cache)``."""
    batch, seq = tokens.shape
    positions = jnp.maximum(jnp.cumsum(real, axis=1) - 1, 0)
    cache = model.init_cache(batch, seq, model.config.dtype)
    mask = _mask(real, jnp.arange(prefill), masked)
    return model(tokens[:, :prefill], positions[:, :prefill], cache, mask)


@functools.partial(nnx.jit, static_argnames="masked")
def _decode(model, tokens, real, cache, t, masked):
    """Token ``t`` (traced: one compile serves every step) onto ``cache``."""
    positions = jnp.maximum(jnp.cumsum(real, axis=1) - 1, 0)
    token = jax.lax.dynamic_slice_in_dim(tokens, t, 1, axis=1)  # [B, 1]
    position = jax.lax.dynamic_slice_in_dim(positions, t, 1, axis=1)
    return model(token, position, cache, _mask(real, t[None], masked))


def incremental_logits(model, tokens, real, prefill: int, masked="causal") -> np.ndarray:
    """Prefill ``prefill`` tokens into a cache, then decode the rest one at a time, each
    call with the caller's mask ``masked`` (:func:`_mask`)."""
    logits, cache = _prefill(model, tokens, real, prefill, masked)
    out = [np.asarray(logits)]
    for t in range(prefill, tokens.shape[1]):
        logits, cache = _decode(model, tokens, real, cache, np.int32(t), masked)
        out.append(np.asarray(logits))
    return np.concatenate(out, axis=1)


def check_incremental(name, scan, mesh_shape=None):
    cfg = get_config(name, scan_layers=scan)
    rng = np.random.RandomState(0)
    lengths = (20, 9, 14, 17, 11, 20, 8, 16)[: 8 if mesh_shape else 3]  # > window 8
    prompts = [list(rng.randint(3, cfg.vocab_size, n)) for n in lengths]
    tokens, real = padded(prompts)
    mesh = sharding.make_mesh(mesh_shape) if mesh_shape else None
    with sharding.use_mesh(mesh) if mesh else contextlib.nullcontext():
        model = build_model(cfg, mesh, seed=1)
        want = np.asarray(reference_logits(model, tokens, real))
        got = incremental_logits(model, tokens, real, prefill=6)
    np.testing.assert_allclose(got[real], want[real], atol=INCREMENTAL_ATOL)


def test_a_prefill_of_the_last_token_only_gives_its_logits_and_the_same_cache():
    """``decode_only_last_token`` (our ``generate``'s prefill, and google-tunix >= 0.1.7's,
    found by its name in ``__call__``'s signature): the last position's logits
    ``[batch, 1, vocab]`` of the full prefill, and the same cache. (With LoRA's
    adapters, through Qwix's wrapped ``forward``: the adapters-vs-merged test below.)"""
    import inspect

    assert "decode_only_last_token" in inspect.signature(CausalLM.__call__).parameters
    model = build_model(get_config("qwen3-tiny"), seed=1)
    tokens, real = padded()
    batch, seq = tokens.shape

    @nnx.jit
    def prefills(model):  # both prefills in one program
        positions = jnp.maximum(jnp.cumsum(real, axis=1) - 1, 0)
        mask = jnp.tril(jnp.ones((seq, seq), bool))[None] & real[:, None, :]
        return [
            model(tokens, positions, model.init_cache(batch, seq, "float32"), mask, **last)
            for last in ({"decode_only_last_token": False}, {"decode_only_last_token": True})
        ]

    (full, full_cache), (last, last_cache) = prefills(model)
    assert last.shape == (batch, 1, full.shape[-1])
    np.testing.assert_allclose(np.asarray(last), np.asarray(full)[:, -1:], rtol=1e-6, atol=1e-6)
    for a, b in zip(jax.tree.leaves(last_cache), jax.tree.leaves(full_cache), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# the gate: Gemma 4 scanned (per-type kv heads and head_dim, sliding and full layers, MoE
# through the scan, sandwich norms); the other eleven in the slow tier. GPT-OSS's cache
# path (sinks, YaRN, sliding layers) stays in the gate through
# test_greedy_generation_equals_a_recompute_loop[gpt_oss-tiny].
GATE_CASES = {("gemma4-tiny", True)}


@pytest.mark.parametrize(
    ("name", "scan"),
    [
        pytest.param(
            n,
            scan,
            id=f"{n}-{'scanned' if scan else 'unscanned'}",
            marks=() if (n, scan) in GATE_CASES else pytest.mark.slow,
        )
        for n in TINY_PRESETS
        for scan in (False, True)
    ],
)
def test_incremental_decoding_equals_the_full_forward(name, scan):
    """Prefill + one-token decode steps give the full forward's logits at every real
    position of a left-padded ragged batch, 12 tokens past the sliding window."""
    check_incremental(name, scan)


@functools.cache
def window_model():
    """gpt_oss-tiny (sliding window 8), 2 rows of 16 tokens, and its full forward's logits
    (``attention_mask=None``)."""
    cfg = get_config("gpt_oss-tiny")
    model = build_model(cfg, seed=1)
    seq = cfg.attention["sliding"].sliding_window + 8
    tokens = np.random.RandomState(2).randint(3, cfg.vocab_size, (2, seq)).astype(np.int32)
    positions = np.broadcast_to(np.arange(seq, dtype=np.int32), (2, seq))
    want = nnx.jit(lambda m, t, p: m(t, p, None, None)[0])(model, tokens, positions)
    return model, tokens, np.asarray(want)


@pytest.mark.parametrize("masked", [None, "causal", "all"])
# the masks are the host's inputs: one on a chip
@pytest.mark.chip_sample("None")
def test_a_cached_prefill_longer_than_the_window_then_decoding(masked):
    """gpt_oss-tiny (sliding window 8): a 12-token prefill, then 4 one-token steps, give
    the full forward's logits, with the caller's causal mask over the slots, without one
    (``attention_mask=None``: each query sees the slots up to its own), and with one
    that opens every slot (the cache stays causal, as the full forward's mask does). The
    prefill's late queries must not see the slots 8 or more behind them."""
    model, tokens, want = window_model()
    prefill = model.config.attention["sliding"].sliding_window + 4
    real = np.ones(tokens.shape, bool)  # no padding: positions are the slots
    got = incremental_logits(model, tokens, real, prefill, masked)
    np.testing.assert_allclose(got, want, atol=INCREMENTAL_ATOL)


def test_a_bfloat16_cache_under_a_float32_model():
    """``init_cache(dtype=bfloat16)`` for a float32 model: keys and values are stored in
    bfloat16 (half the bytes) and decoding stays within bf16 rounding of the float32
    cache's logits."""
    model = build_model(get_config("qwen3-tiny"), seed=1)
    tokens = np.asarray([[5, 6, 7, 8, 9, 10]], np.int32)
    dtypes = ("float32", "bfloat16")

    @nnx.jit
    def steps(model):  # both caches in one program
        positions = jnp.arange(6)[None]
        return {d: model(tokens, positions, model.init_cache(1, 8, d), None) for d in dtypes}

    out = {}
    for dtype, (logits, cache) in steps(model).items():
        assert {str(x.dtype) for x in jax.tree.leaves(cache) if x.ndim > 1} == {dtype}
        out[dtype] = np.asarray(logits)
    assert np.abs(out["float32"]).max() > 0.1
    np.testing.assert_allclose(out["bfloat16"], out["float32"], atol=0.05)
    assert not np.array_equal(out["bfloat16"], out["float32"])  # the bf16 cache was read


@pytest.mark.slow
@pytest.mark.devices(8)
@settings(max_examples=scaled(4), deadline=None)
@given(data=st.data())
def test_incremental_decoding_on_meshes(data):
    name = data.draw(st.sampled_from(TINY_PRESETS), label="preset")
    scan = data.draw(st.booleans(), label="scan")
    mesh_shape = data.draw(meshes(get_config(name)), label="mesh")
    check_incremental(name, scan, mesh_shape)


@pytest.mark.devices(8)
def test_the_cache_is_sharded_like_the_activations():
    """On data x fsdp x tensor the cache's batch is over the data-parallel axes and its kv
    heads over tensor (decoding on meshes: the slow tier; LoRA's test decodes on one)."""
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    cfg = get_config("qwen3-tiny")
    with sharding.use_mesh(mesh):
        model = build_model(cfg, mesh)
        cache = nnx.jit(lambda m: m.init_cache(4, 16, "float32"))(model)
    spec = cache["layer_0"]["k"].sharding.spec
    assert spec[0] == ("data", "fsdp") and spec[2] == "tensor", spec


@functools.cache
def recompute_greedy(name: str) -> list[list[int]]:
    """Greedy tokens by re-running the full forward on each unpadded row (no cache): the
    row right-padded to one width (causal: padding after a token never changes its
    logits), so one compile serves every step."""
    model = build_model(get_config(name), seed=1)
    width = max(len(p) for p in PROMPTS) + STEPS
    forward = nnx.jit(lambda m, t: m(t, None, None, None)[0][0])  # [width, V]
    rows = []
    for prompt in PROMPTS:
        seq = list(prompt)
        for _ in range(STEPS):
            tokens = np.asarray([seq + [0] * (width - len(seq))], np.int32)
            seq.append(int(np.argmax(np.asarray(forward(model, tokens))[len(seq) - 1])))
        rows.append(seq[len(prompt) :])
    return rows


def test_on_token_streams_every_step_in_order_and_a_new_seed_compiles_nothing():
    """``on_token`` gets each step's tokens of every row and which rows had stopped,
    in order: together they are the result (a stopped row's later tokens are padding).
    Sampling again with another seed reuses the compiled loop (the seed is traced)."""
    model = build_model(get_config("qwen3-tiny"), seed=1)
    steps = []
    cfg = generate.SamplingConfig(max_new_tokens=5, temperature=0.8, seed=1, eos_ids=(7,))
    result = generate.generate(model, PROMPTS, cfg, on_token=lambda t, d: steps.append((t, d)))
    streamed = np.stack([t for t, _ in steps], axis=1)  # [B, steps]
    assert len(steps) == max(result.lengths) and streamed.shape[0] == len(PROMPTS)
    assert all(t.dtype == np.int32 and d.dtype == np.bool_ for t, d in steps)  # ids, flags
    for i, (row, length) in enumerate(zip(result.tokens, result.lengths, strict=True)):
        np.testing.assert_array_equal(streamed[i, :length], row[:length])
        assert not any(d[i] for _, d in steps[:length]) and all(d[i] for _, d in steps[length:])
    again = generate.generate(model, PROMPTS, dataclasses.replace(cfg, seed=2))  # no on_token
    compiled = generate._generate.jitted_fn._cache_size()
    generate.generate(model, PROMPTS, dataclasses.replace(cfg, seed=3))
    assert generate._generate.jitted_fn._cache_size() == compiled
    assert again.tokens.shape == result.tokens.shape


@pytest.mark.parametrize(
    "name",
    [n if n == "gpt_oss-tiny" else pytest.param(n, marks=pytest.mark.slow) for n in TINY_PRESETS],
)
def test_greedy_generation_equals_a_recompute_loop(name):
    model = build_model(get_config(name), seed=1)
    out = generate.generate(model, PROMPTS, generate.SamplingConfig(max_new_tokens=STEPS))
    assert [out.row(i) for i in range(len(PROMPTS))] == recompute_greedy(name)
    assert out.stop_reasons == ["length"] * 3 and list(out.lengths) == [STEPS] * 3


def test_a_row_stops_at_its_eos_and_the_others_go_on():
    model = build_model(get_config("qwen3-tiny"), seed=1)
    greedy = generate.generate(model, PROMPTS, generate.SamplingConfig(max_new_tokens=STEPS))
    eos = int(greedy.tokens[1, 4])  # row 1's fifth token
    first = {i: next((j for j, t in enumerate(greedy.row(i)) if t == eos), None) for i in range(3)}
    out = generate.generate(
        model, PROMPTS, generate.SamplingConfig(max_new_tokens=STEPS, eos_ids=(eos, 999))
    )
    for i in range(3):
        stop = first[i]
        if stop is None:
            assert out.row(i) == greedy.row(i) and out.stop_reasons[i] == "length"
        else:
            assert out.row(i) == greedy.row(i)[: stop + 1] and out.stop_reasons[i] == "eos"
            assert (out.tokens[i, stop + 1 :] == 0).all() and (
                out.logprobs[i, stop + 1 :] == 0
            ).all()


def test_logprobs_are_the_models_log_softmax_at_each_token():
    model = build_model(get_config("llama3-tiny"), seed=1)
    cfg = generate.SamplingConfig(max_new_tokens=5, temperature=0.7, seed=2)
    out = generate.generate(model, [PROMPTS[0]], cfg)
    seq = np.asarray([PROMPTS[0] + out.row(0)], np.int32)
    log_softmax = nnx.jit(lambda m, s: jax.nn.log_softmax(m(s, None, None, None)[0][0]))
    want = np.asarray(log_softmax(model, seq))[len(PROMPTS[0]) - 1 : -1]
    want = np.take_along_axis(want, np.asarray(out.row(0))[:, None], axis=1)[:, 0]
    np.testing.assert_allclose(out.logprobs[0], want, atol=1e-5)


def test_a_seed_gives_the_same_tokens_and_top_k_1_is_greedy():
    model = build_model(get_config("qwen3-tiny"), seed=1)
    sampled = generate.SamplingConfig(max_new_tokens=8, temperature=1.5, seed=7)
    a = generate.generate(model, PROMPTS, sampled)
    b = generate.generate(model, PROMPTS, sampled)
    other = generate.generate(model, PROMPTS, generate.SamplingConfig(8, 1.5, seed=8))
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert (a.tokens != other.tokens).any()  # the seed is used
    # STEPS tokens: the greedy program is the one test_a_row_stops... compiles
    greedy = generate.generate(model, PROMPTS, generate.SamplingConfig(max_new_tokens=STEPS))
    top1 = generate.generate(model, PROMPTS, generate.SamplingConfig(STEPS, 1.5, top_k=1, seed=7))
    np.testing.assert_array_equal(top1.tokens, greedy.tokens)


def _uniform_model() -> CausalLM:
    """qwen3-tiny with every parameter 0: every logit is exactly 0 at every step and row,
    so what each step draws depends on its random key alone (uniform over the vocab)."""
    model = build_model(get_config("qwen3-tiny"), seed=1)
    state = nnx.state(model, nnx.Param)  # zeros by transfer, not by a compile per shape
    nnx.update(model, jax.tree.map(lambda x: jax.device_put(np.zeros(x.shape, x.dtype)), state))
    return model


def test_each_step_draws_with_fold_in_of_its_index_and_rows_and_steps_are_independent():
    """Randomness across steps and rows. Documented: step i samples with
    ``fold_in(key(seed), i)``. On a model whose logits are all 0 (the same prompt in
    every row), the tokens of step i are exactly ``categorical(fold_in(key(seed), i),
    zeros [B, V])``; so no two steps of a row, and no two rows, repeat one draw (one key
    reused across steps or rows would repeat it; by chance: V^-7 per row, V = 264). The
    same seed gives the same tokens; another seed others."""
    model = _uniform_model()
    prompts = [PROMPTS[0]] * len(PROMPTS)  # the shapes of the test above: no new compile
    cfg = generate.SamplingConfig(max_new_tokens=8, temperature=1.5, seed=7)
    out = generate.generate(model, prompts, cfg)

    @jax.jit
    def want():  # [B, 8]: step i's draws
        zeros = jnp.zeros((len(prompts), model.config.vocab_size))
        key = jax.random.key(7)
        draws = [jax.random.categorical(jax.random.fold_in(key, i), zeros) for i in range(8)]
        return jnp.stack(draws, axis=1)

    np.testing.assert_array_equal(out.tokens, np.asarray(want()))
    assert all(len(set(row.tolist())) > 1 for row in out.tokens), out.tokens  # steps differ
    assert len({tuple(row.tolist()) for row in out.tokens}) == len(prompts), out.tokens
    np.testing.assert_array_equal(generate.generate(model, prompts, cfg).tokens, out.tokens)
    other = generate.generate(model, prompts, dataclasses.replace(cfg, seed=8))
    assert (other.tokens != out.tokens).any()


# --- the samplers' distributions -----------------------------------------------------

LOGITS = np.log(np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04]))  # one row, V = 6
DRAWS = 20_000
ALPHA = 1e-3  # chi-square significance: a correct sampler fails 1 time in 1000 seeds


def expected(temperature=1.0, top_k=None, top_p=None):
    """The specified distribution, computed in numpy (independent of ``sample``)."""
    p = np.exp(LOGITS / temperature)
    p /= p.sum()
    keep = np.ones_like(p, bool)
    if top_k is not None:
        keep &= p >= np.sort(p)[::-1][top_k - 1]
    if top_p is not None:
        order = np.argsort(-p)
        before = np.cumsum(p[order]) - p[order]
        keep[order[before >= top_p]] = False
    q = np.where(keep, p, 0.0)
    return q / q.sum()


SAMPLERS = (
    dict(temperature=1.0),
    dict(temperature=0.5),
    dict(temperature=2.0),
    dict(top_k=3),
    dict(top_p=0.6),
    dict(top_p=0.8, temperature=0.7),
    dict(top_k=4, top_p=0.9),
)


def _sampler_id(options: dict) -> str:
    return "-".join(f"{k}{v}" for k, v in options.items())


@functools.cache
def sampler_draws() -> dict[str, np.ndarray]:
    """Each of :data:`SAMPLERS`' ``DRAWS`` draws from ``LOGITS`` (keys split from 1234),
    all in one program (one compile)."""

    @jax.jit
    def draw():
        keys = jax.random.split(jax.random.key(1234), DRAWS)
        logits = jnp.asarray(LOGITS, jnp.float32)[None]
        out = {}
        for options in SAMPLERS:
            cfg = generate.SamplingConfig(seed=0, **{"temperature": 1.0, **options})
            out[_sampler_id(options)] = jax.vmap(lambda k, c=cfg: generate.sample(logits, k, c)[0])(
                keys
            )
        return out

    return {name: np.asarray(d) for name, d in draw().items()}


@pytest.mark.parametrize("options", SAMPLERS, ids=_sampler_id)
def test_samplers_draw_the_specified_distribution(options):
    from scipy import stats

    draws = sampler_draws()[_sampler_id(options)]
    want = expected(**{"temperature": 1.0, **options})
    counts = np.bincount(draws, minlength=len(LOGITS))
    assert (counts[want == 0] == 0).all(), (counts, want)  # cut tokens are never drawn
    support = want > 0
    _, p_value = stats.chisquare(counts[support], DRAWS * want[support])
    assert p_value > ALPHA, (counts, DRAWS * want)


def test_top_p_cuts_each_row_of_a_batch_by_its_own_mass():
    """Two rows (one the other's reverse) sampled as one batch: each row keeps exactly
    its own top-p set, normalised over its own vocabulary, not the batch's."""
    cfg = generate.SamplingConfig(seed=0, temperature=1.0, top_p=0.6)
    logits = np.stack([LOGITS, LOGITS[::-1]]).astype(np.float32)  # [2, V]

    @jax.jit
    def draw():  # [N, 2]
        keys = jax.random.split(jax.random.key(99), 2000)
        return jax.vmap(lambda k: generate.sample(jnp.asarray(logits), k, cfg))(keys)

    draws = np.asarray(draw())
    support = expected(top_p=0.6) > 0
    for row, keep in ((0, support), (1, support[::-1])):
        assert set(np.unique(draws[:, row])) == set(np.flatnonzero(keep)), row


def test_the_chi_square_check_rejects_a_wrong_sampler():
    """Teeth: a sampler with the right support but temperature 0.95 instead of 1 (the
    cut-token check cannot see it) is rejected at the same draws and significance."""
    from scipy import stats

    counts = np.random.default_rng(0).multinomial(DRAWS, expected(temperature=0.95))
    assert stats.chisquare(counts, DRAWS * expected())[1] <= ALPHA


# --- the cache ----------------------------------------------------------------------


@pytest.mark.parametrize("scan", [False, True], ids=["unscanned", "scanned"])
@pytest.mark.parametrize("name", TINY_PRESETS)
def test_the_cache_allocates_what_its_formula_says(name, scan):
    cfg = get_config(name, scan_layers=scan)
    model = nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)))
    for dtype in ("float32", "bfloat16"):
        cache = model.init_cache(3, 40, dtype)
        allocated = sum(x.nbytes for x in jax.tree.leaves(cache))
        assert allocated == kv_cache.cache_bytes(cfg, 3, 40, dtype), (dtype, allocated)
    # gemma4: full layers have their own head_dim and kv heads
    shapes = {tuple(x.shape[-2:]) for x in jax.tree.leaves(cache) if x.ndim >= 4}
    assert shapes == {(a.num_kv_heads, a.head_dim) for a in cfg.attention.values()}


# --- LoRA ---------------------------------------------------------------------------


@pytest.mark.devices(8)
def test_generating_with_adapters_equals_generating_with_the_merged_weights():
    from posttrain.lora import LoraConfig, apply_lora, merge_lora

    mesh = sharding.make_mesh({"fsdp": 4, "tensor": 2})
    cfg = get_config("qwen3-tiny")
    with sharding.use_mesh(mesh):
        lora = apply_lora(build_model(cfg, mesh, seed=1), mesh, LoraConfig(rank=4, alpha=8.0))
        # B = 0 at init: give the adapters values, so they change the tokens
        state = nnx.state(lora, nnx.LoRAParam)
        leaves = jax.tree.leaves(state)
        filled = [
            jax.random.normal(jax.random.key(i), x.shape, x.dtype) * 0.3
            for i, x in enumerate(leaves)
        ]
        nnx.update(lora, jax.tree.unflatten(jax.tree.structure(state), filled))
        sampling = generate.SamplingConfig(max_new_tokens=10)
        with_adapters = generate.generate(lora, PROMPTS, sampling)
        merged = generate.generate(merge_lora(lora), PROMPTS, sampling)
        base_model = build_model(cfg, mesh, seed=1)
        base = generate.generate(base_model, PROMPTS, sampling)
        # one prompt, filled up to the 4 data-parallel rows (the same [4, 7] program)
        one = generate.generate(base_model, PROMPTS[:1], sampling)
    np.testing.assert_array_equal(with_adapters.tokens, merged.tokens)
    assert (with_adapters.tokens != base.tokens).any()  # the adapters were applied
    np.testing.assert_array_equal(one.tokens, base.tokens[:1])


# --- against transformers -------------------------------------------------------------

PARITY_FAMILIES = ("gemma4",)  # in the gate; the other five in the slow tier


@pytest.mark.reference
@pytest.mark.parametrize(
    "family",
    [
        f if f in PARITY_FAMILIES else pytest.param(f, marks=pytest.mark.slow)
        for f in families.NAMES
    ],
)
def test_greedy_generation_equals_transformers(hf_tiny, tmp_path, family):
    """Converted tiny transformers models: our greedy tokens equal ``generate(do_sample=False)``
    on a left-padded batch, through EOS (id 2) and past the sliding window."""
    import torch
    import transformers

    from posttrain import conversion

    src = hf_tiny.save(hf_tiny.build(family), tmp_path / "hf")
    # the saved model: perturb_constants also perturbs non-persistent buffers, which
    # save_pretrained does not keep (Gemma 4's differ), so the model in memory is not it
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, attn_implementation="eager")
    conversion.convert_hf_to_native(src, tmp_path / "native")
    model = conversion.load_native(tmp_path / "native")
    tokens, real = generate.left_pad(PROMPTS, 0)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = hf.generate(
            input_ids=torch.as_tensor(tokens, dtype=torch.long),
            attention_mask=torch.as_tensor(real, dtype=torch.long),
            do_sample=False,
            max_new_tokens=STEPS,
            pad_token_id=0,
            eos_token_id=2,
        )
    want = out[:, tokens.shape[1] :].numpy()
    ours = generate.generate(
        model, PROMPTS, generate.SamplingConfig(max_new_tokens=STEPS, eos_ids=(2,), pad_id=0)
    )
    np.testing.assert_array_equal(ours.tokens[:, : want.shape[1]], want)


# --- bad input ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(max_new_tokens=0), "max_new_tokens=0: expected >= 1"),
        (dict(temperature=-1.0), "temperature=-1.0: expected a finite value >= 0"),
        (dict(temperature=float("inf")), "temperature=inf: expected a finite value >= 0"),
        (dict(temperature=float("nan")), "temperature=nan: expected a finite value >= 0"),
        (dict(seed=-1), r"seed=-1: expected an integer in \[0, 2\*\*32\)"),
        (dict(seed=2**32), r"seed=4294967296: expected an integer in \[0, 2\*\*32\)"),
        (dict(top_k=0), "top_k=0: expected >= 1 or None"),
        (dict(top_p=0.0), r"top_p=0.0: expected in \(0, 1\] or None"),
        (dict(top_p=1.5), r"top_p=1.5: expected in \(0, 1\] or None"),
    ],
)
def test_bad_sampling_options_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        generate.SamplingConfig(**kwargs)


def test_a_prompt_longer_than_the_cache_and_an_empty_prompt_are_refused():
    model = build_model(get_config("qwen3-tiny"))
    with pytest.raises(ValueError, match="cache_size=8 is too small: the longest prompt has 7"):
        generate.generate(model, PROMPTS, generate.SamplingConfig(max_new_tokens=4), cache_size=8)
    with pytest.raises(ValueError, match="^generate: every prompt needs at least one token$"):
        generate.generate(model, [[1], []], generate.SamplingConfig())


def test_the_smallest_valid_request_generates_one_token():
    """The edges of every range are accepted: one-token prompts, ``max_new_tokens=1``,
    ``top_p=1``, ``top_k=1``, ``temperature=0``."""
    cfg = generate.SamplingConfig(max_new_tokens=1, temperature=0.0, top_k=1, top_p=1.0)
    out = generate.generate(build_model(get_config("qwen3-tiny")), [[5], [6]], cfg)
    assert out.tokens.shape == (2, 1) and list(out.lengths) == [1, 1]


# --- posttrain generate ---------------------------------------------------------------


def run_cli(capsys, *argv):
    from posttrain import cli

    status = cli.main(["generate", *argv])
    out, err = capsys.readouterr()
    return status, out, err


def test_cli_without_a_model_or_an_export_says_to_run_sft_first(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    status, out, err = run_cli(capsys, "--prompt", "hi")
    assert status == 2 and out == ""
    assert err == (
        "posttrain: error: no --model given and runs/sft holds no model-step<N> export; "
        "run `posttrain sft` first, or pass --model PRESET|DIR\n"
    )


@pytest.mark.wiring
def test_cli_uses_the_newest_export_and_writes_one_record_per_prompt(tmp_path, monkeypatch, capsys):
    """Without --model the newest runs/sft/model-step<N> is used; several prompts give JSONL
    whose tokens equal the API's greedy tokens on that model."""
    from posttrain.conversion import load_native, save_native
    from posttrain.models import flat_params
    from posttrain.tokenizer import byte_tokenizer

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs/sft").mkdir(parents=True)
    for step, name in ((5, "qwen3-tiny"), (12, "llama3-tiny")):
        cfg = get_config(name)
        save_native(
            flat_params(build_model(cfg, seed=step)), cfg, tmp_path / f"runs/sft/model-step{step}"
        )
    status, out, err = run_cli(
        capsys,
        "--prompt",
        "one",
        "--prompt",
        "two words",
        "--max-new-tokens",
        "6",
        "--mesh",
        ",".join(f"{axis}={size}" for axis, size in fitted({"fsdp": 8}).items()),
    )
    assert status == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["prompt"] for r in records] == ["one", "two words"]
    model = load_native(tmp_path / "runs/sft/model-step12")
    assert model.config.family == "llama3"
    tok = byte_tokenizer()
    ids = [tok.encode(t, add_special_tokens=False).ids for t in ("one", "two words")]
    want = generate.generate(model, ids, generate.SamplingConfig(max_new_tokens=6))
    for i, record in enumerate(records):
        assert record["tokens"] == want.row(i)
        assert record["stop_reason"] == want.stop_reasons[i]
        assert len(record["logprobs"]) == len(record["tokens"])
        assert record["text"] == tok.decode(want.row(i), skip_special_tokens=True)


@pytest.mark.wiring
def test_cli_streams_one_prompt_to_stdout(tmp_path, monkeypatch, capsys):
    from posttrain.tokenizer import byte_tokenizer

    monkeypatch.chdir(tmp_path)
    status, out, err = run_cli(
        capsys, "--model", "qwen3-tiny", "--prompt", "stream", "--max-new-tokens", "7"
    )
    assert status == 0, err
    tok = byte_tokenizer()
    model = build_model(get_config("qwen3-tiny"), seed=0)
    want = generate.generate(
        model,
        [tok.encode("stream", add_special_tokens=False).ids],
        generate.SamplingConfig(max_new_tokens=7, eos_ids=(tok.token_to_id("<|im_end|>"),)),
    )
    text = tok.decode(want.row(0), skip_special_tokens=True)
    assert out.rstrip("\n") == text.rstrip("\ufffd")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--cache-size", "4"], "cache_size=4 is too small: the longest prompt has 5 tokens"),
        (["--top-p", "2"], r"top_p=2.0: expected in \(0, 1\] or None"),
        (["--prompts", "{missing}"], "--prompts '.*nope.jsonl' does not exist; expected a JSONL"),
        (["--adapter", "{adapter}"], "made for llama3 with 2 layers, the model is qwen3 with 2"),
        (["--tokenizer", "{tokenizer}"], "tokenizer has 300 ids but the model's vocab_size is 264"),
    ],
    ids=[
        "prompt-longer-than-cache",
        "bad-top-p",
        "missing-prompts-file",
        "adapter-of-another-model",
        "tokenizer-vocab-too-big",
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys, extra, message):
    import json as _json

    from tokenizers import Tokenizer, models

    monkeypatch.chdir(tmp_path)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "lora_config.json").write_text(
        _json.dumps({"format": "posttrain-lora", "family": "llama3", "num_layers": 2})
    )
    vocab = {f"t{i}": i for i in range(300)}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(tmp_path / "tokenizer.json"))
    extra = [
        e.format(
            missing=tmp_path / "nope.jsonl", adapter=adapter, tokenizer=tmp_path / "tokenizer.json"
        )
        for e in extra
    ]
    status, out, err = run_cli(capsys, "--model", "qwen3-tiny", "--prompt", "hello", *extra)
    assert status == 2 and out == ""
    assert err.startswith("posttrain: error: ") and err.count("\n") == 1, err
    assert re.search(message, err), err
