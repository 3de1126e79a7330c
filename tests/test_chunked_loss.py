"""The chunked NLL (``posttrain.training.chunked_loss``): it equals the full logits' NLL, value
and gradients, and the compiled step holds far less than the full logits (issue #55)."""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given
from hypothesis import strategies as st

from posttrain import sharding
from posttrain.lora import LoraConfig, apply_lora
from posttrain.models import CausalLM, get_config
from posttrain.training import chunked_loss, loss
from tests.meshes import fitted
from tests.path_params import model_with_path_values

pytestmark = pytest.mark.matmul_precision("highest")

SEQ = 17  # prime: no chunk of 2..16 positions divides it, so the tail is padded
# float32: the same products summed in another order (chunks, the head gradient's partial
# sums per chunk); observed <= 2e-7 of the value, and on gradients <= 1e-6 of the model's
# largest gradient entry (the absolute scale: a scalar's gradient, Gemma's layer_scalar,
# sums terms ~1e5 times larger than itself, and inherits their rounding).
F32_RTOL = 1e-5
# bfloat16 (8 significant bits): a chunk's matmuls round where the whole batch's do not, and
# that difference goes back through every layer; observed <= 0.8% of a leaf's norm.
BF16_NORM_RTOL = 3e-2
# the compiled step's temporaries with chunks of 16 positions (vocab 32,768, 2 x 512 tokens:
# 128 MiB of float32 logits), over the full logits' step (observed 0.12) and over one copy
# of the full float32 logits (observed 0.39; 1.37 when the chunks' logits are kept for the
# backward, as autodiff of a scan without the custom VJP or a checkpoint keeps them)
TEMP_RATIO = 0.5


def batch_of(cfg, batch: int = 2, seq: int = SEQ, seed: int = 0) -> dict:
    """Token rows with about 70% of positions targets, two packed segments in row 0."""
    rng = np.random.default_rng(seed)
    segments = np.ones((batch, seq), np.int32)
    segments[0, seq // 2 :] = 2
    return {
        "input_tokens": jnp.asarray(rng.integers(1, cfg.vocab_size, (batch, seq)), jnp.int32),
        "input_mask": jnp.asarray(rng.random((batch, seq)) < 0.7),
        "positions": jnp.asarray(np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq))),
        "segment_ids": jnp.asarray(segments),
    }


def nll_and_grads(model, batch, trained=nnx.Param, **options):
    """Jitted ``(nll_sum, d nll_sum / d trained variables)`` of ``sft_terms(**options)``."""
    graphdef, params, rest = nnx.split(model, trained, ...)

    @jax.jit
    def run(params, batch):
        def nll(params):
            return loss.sft_terms(nnx.merge(graphdef, params, rest), **batch, **options)["nll_sum"]

        return jax.value_and_grad(nll)(params)

    value, grads = run(params, batch)
    return float(value), {path: np.asarray(v[...]) for path, v in nnx.to_flat_state(grads)}


def assert_same_nll(model, batch, *, chunk, bf16=False, trained=nnx.Param):
    """Chunked (``logit_chunk=chunk``) and full logits: equal value and gradients."""
    want, want_grads = nll_and_grads(model, batch, trained, chunked=False)
    got, got_grads = nll_and_grads(model, batch, trained, logit_chunk=chunk)
    assert got_grads.keys() == want_grads.keys()
    if bf16:
        np.testing.assert_allclose(got, want, rtol=BF16_NORM_RTOL)
        for path, g in want_grads.items():
            diff = np.linalg.norm((got_grads[path] - g).astype(np.float64))
            assert diff <= BF16_NORM_RTOL * np.linalg.norm(g.astype(np.float64)), path
        return
    np.testing.assert_allclose(got, want, rtol=F32_RTOL)
    scale = max(float(np.max(np.abs(g))) for g in want_grads.values())
    for path, g in want_grads.items():
        np.testing.assert_allclose(
            got_grads[path], g, rtol=F32_RTOL, atol=F32_RTOL * scale, err_msg=str(path)
        )


@functools.cache
def model_of(preset: str, dtype: str = "float32") -> CausalLM:
    return model_with_path_values(get_config(preset, dtype=dtype, param_dtype=dtype))


@pytest.mark.parametrize(
    ("preset", "chunk"),
    [
        ("qwen3-tiny", 1),  # a chunk per position: 17 chunks
        # slow tier: gemma4's and llama3's cases chunk by 5 too (tied and untied)
        pytest.param("qwen3-tiny", 5, marks=pytest.mark.slow),  # 4 chunks of 5: 3 padded
        # slow tier: the default case is one chunk too
        pytest.param("qwen3-tiny", 100, marks=pytest.mark.slow),  # more than the sequence
        ("qwen3-tiny", None),  # the default: one chunk at this size
        ("gemma4-tiny", 5),  # final_logit_softcap, tied
        ("llama3-tiny", 5),  # an lm_head of its own
    ],
    ids=["tied-chunk1", "tied-chunk5", "tied-chunk100", "tied-default", "softcap", "untied"],
)
# on a chip: a tied and an untied head
@pytest.mark.chip_sample("tied-default", "untied")
def test_the_chunked_nll_equals_the_full_logits_nll_float32(preset, chunk):
    """Every chunk size (1, not dividing the length, longer than it, the default), tied and
    untied heads, with and without the softcap: the same NLL and parameter gradients."""
    model = model_of(preset)
    assert_same_nll(model, batch_of(model.config), chunk=chunk)


@pytest.mark.parametrize(
    "preset",
    # the gate's bfloat16 case has an lm_head of its own; tied heads chunk in float32 above
    [pytest.param("qwen3-tiny", marks=pytest.mark.slow), "llama3-tiny"],
    ids=["tied", "untied"],
)
def test_the_chunked_nll_equals_the_full_logits_nll_bfloat16(preset):
    """A bfloat16 model (compute and parameters): equal within bfloat16's precision, and
    each gradient keeps its parameter's dtype."""
    model = model_of(preset, "bfloat16")
    assert_same_nll(model, batch_of(model.config), chunk=5, bf16=True)
    _, grads = nll_and_grads(model, batch_of(model.config), logit_chunk=5)
    assert {str(g.dtype) for g in grads.values()} == {"bfloat16"}


@pytest.mark.devices(8)
def test_lora_on_the_lm_head_applies_inside_the_chunks():
    """LoRA adapters on ``lm_head`` (B != 0) on a mesh whose ``tensor`` axis shards the
    vocabulary: the chunked NLL and the adapters' gradients equal the full logits' (the
    chunks are projected inside ``forward``, where Qwix intercepts)."""
    cfg = get_config("llama3-tiny")
    mesh = sharding.make_mesh(fitted({"data": 2, "tensor": 2, "fsdp": 2}))
    base = sharding.shard_model(model_with_path_values(cfg), mesh)
    lora = LoraConfig(rank=4, alpha=8.0, target=r"lm_head|.*/self_attn/q_proj")
    model = apply_lora(base, mesh, lora)
    rng = np.random.default_rng(1)
    state = nnx.state(model, nnx.LoRAParam)
    noisy = jax.tree.map(lambda x: x + 0.1 * rng.standard_normal(x.shape).astype(x.dtype), state)
    nnx.update(model, noisy)  # B != 0: the adapters change the logits
    with sharding.use_mesh(mesh):
        assert_same_nll(model, batch_of(cfg, batch=4), chunk=5, trained=nnx.LoRAParam)
        _, grads = nll_and_grads(model, batch_of(cfg, batch=4), nnx.LoRAParam, logit_chunk=5)
    head = [p for p in grads if p[0] == "lm_head"]
    assert len(head) == 2 and all(np.abs(grads[p]).max() > 0 for p in head), sorted(grads)


def test_a_frozen_head_gets_no_weight_gradient_computed():
    """LoRA on the attention only (the bfloat16 head frozen): the backward builds no float32
    gradient sum of the head's kernel ``[d_model, vocab]``; training the head builds one."""
    cfg = get_config("llama3-tiny", dtype="bfloat16", param_dtype="bfloat16")
    mesh = sharding.make_mesh({"fsdp": 1}, devices=jax.devices()[:1])
    base = sharding.shard_model(model_with_path_values(cfg), mesh)
    model = apply_lora(base, mesh, LoraConfig(rank=4, alpha=8.0, target=r".*/q_proj"))
    head_sum = f"f32[{cfg.d_model},{cfg.vocab_size}]"
    batch = batch_of(cfg)

    def program(trained) -> str:
        graphdef, params, rest = nnx.split(model, trained, ...)

        def nll(params, rest):  # the frozen rest an argument, traced as the step's is
            merged = nnx.merge(graphdef, params, rest)
            return loss.sft_terms(merged, **batch, logit_chunk=5)["nll_sum"]

        return str(jax.make_jaxpr(jax.grad(nll))(params, rest))

    assert head_sum not in program(nnx.LoRAParam)
    assert head_sum in program(nnx.Param)


@pytest.mark.parametrize(("trained", "want"), [(nnx.Param, 3), (nnx.LoRAParam, 2)])
def test_the_head_runs_once_a_chunk_and_the_backward_recomputes_nothing(trained, want):
    """The gradients are taken in the forward's pass over the chunks: the differentiated
    loss holds the head's matmul once, its hidden states' gradient, and its weights'
    gradient when the head is trained (3; a frozen head under LoRA, 2), as many as the full
    logits' loss. Recomputing each chunk's logits in the backward, as the loss did before,
    made it 4 and 3: the head of qwen3-0.6b is a quarter of its parameters (issue #55)."""
    cfg = get_config("llama3-tiny")  # an lm_head of its own: no embedding lookup's matmul
    assert cfg.vocab_size not in (cfg.d_model, SEQ, 2)
    mesh = sharding.make_mesh({"fsdp": 1}, devices=jax.devices()[:1])
    base = sharding.shard_model(model_with_path_values(cfg), mesh)
    model = apply_lora(base, mesh, LoraConfig(rank=4, alpha=8.0, target=r".*/q_proj"))
    batch = batch_of(cfg)
    graphdef, params, rest = nnx.split(model, trained, ...)

    def matmuls(**options) -> int:
        def nll(params, rest):
            merged = nnx.merge(graphdef, params, rest)
            return loss.sft_terms(merged, **batch, **options)["nll_sum"]

        jaxpr = jax.make_jaxpr(jax.grad(nll))(params, rest).jaxpr
        return chunked_loss.vocab_matmuls(jaxpr, cfg.vocab_size)

    assert matmuls(logit_chunk=5) == want
    assert matmuls(chunked=False) == want  # the full logits' loss: as many


def test_vocab_matmuls_looks_inside_every_held_jaxpr():
    """A matmul with a vocabulary-sized operand counts wherever the jaxpr holds it: at the
    top, in a scan's body, in both branches of a cond (a tuple of jaxprs) and under
    ``jax.checkpoint`` (a bare ``Jaxpr``, not a closed one); others never."""
    vocab = 11
    w = jnp.ones((3, vocab))

    def f(x):  # x [2, 3]; every product below but the last has an operand of 11
        y = x @ w  # 1
        y = jax.lax.cond(x[0, 0] > 0, lambda y: y @ w.T @ w, lambda y: y * 2.0, y)  # 2
        y = jax.checkpoint(lambda y: (y @ w.T) @ w)(y)  # 2
        _, z = jax.lax.scan(lambda c, r: (c, r @ w.T), 0.0, y[None])  # 1
        return z.sum() + (x @ jnp.ones((3, 3))).sum()  # 0: no dimension of 11

    jaxpr = jax.make_jaxpr(f)(jnp.ones((2, 3))).jaxpr
    assert chunked_loss.vocab_matmuls(jaxpr, vocab) == 1 + 2 + 2 + 1


def test_the_gradients_keep_their_dtypes_and_the_head_sums_in_float32():
    """A bfloat16 model: the hidden states' gradient comes back in bfloat16, and the head's
    weight gradient is summed over the chunks in a float32 carry (one rounding to
    bfloat16 at the end, not one a chunk)."""
    cfg = get_config("llama3-tiny", dtype="bfloat16", param_dtype="bfloat16")
    model = model_with_path_values(cfg)
    batch = batch_of(cfg)
    hidden = jnp.ones((2, SEQ, cfg.d_model), jnp.bfloat16) * 0.1
    targets = loss.target_mask(batch["input_mask"], batch["segment_ids"])

    def nll(hidden):
        return chunked_loss.chunked_nll(hidden, model, batch["input_tokens"], targets, chunk=5)

    _, vjp = jax.vjp(nll, hidden)
    (dhidden,) = vjp(jnp.float32(1.0))
    assert dhidden.dtype == jnp.bfloat16 and dhidden.shape == hidden.shape
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def full(params):
        merged = nnx.merge(graphdef, params, rest)
        return loss.sft_terms(merged, **batch, logit_chunk=5)["nll_sum"]

    carries = [
        str(v.aval)
        for eqn in chunked_loss.equations(jax.make_jaxpr(jax.grad(full))(params).jaxpr)
        if eqn.primitive.name == "scan"
        for v in eqn.outvars
    ]
    assert f"float32[{cfg.d_model},{cfg.vocab_size}]" in carries, carries


def test_uncounted_costs_are_the_chunks_a_loop_counts_once():
    """``count - 1`` chunks of the loop: none for one chunk; the head's matmuls' FLOPs
    (2 with a frozen head, 3 trained) and bytes (the weights read twice, a trained head's
    float32 sum read and written, 4 or 5 passes over the chunk's float32 logits) over the
    devices that split rows and vocabulary."""
    cfg = get_config("qwen3-0.6b")  # bfloat16 weights; 8 chunks of 256 positions here
    rules = sharding.DEFAULT_RULES
    d, v = cfg.d_model, cfg.vocab_size
    trained = chunked_loss.uncounted_costs(cfg, 4, 2048, {}, rules, head_trained=True)
    assert trained == (
        7 * 3 * 2.0 * 4 * 256 * d * v,
        7 * (2 * d * v * 2 + 8 * d * v + 20 * 4 * 256 * v),
    )
    frozen = chunked_loss.uncounted_costs(cfg, 4, 2048, {}, rules, head_trained=False)
    assert frozen == (7 * 2 * 2.0 * 4 * 256 * d * v, 7 * (2 * d * v * 2 + 16 * 4 * 256 * v))
    # fsdp=2, tensor=2: 2 rows and half the vocabulary a device, so 3 chunks of 683 -> 768
    split = chunked_loss.uncounted_costs(
        cfg, 4, 2048, {"fsdp": 2, "tensor": 2}, rules, head_trained=True
    )
    assert split[0] == 2 * 3 * 2.0 * 2 * 768 * d * (v // 2)
    # 3 rows over 2 devices: 2 rows on one (rounded up), so 5 chunks of 410 -> 4 of 512
    odd = chunked_loss.uncounted_costs(cfg, 3, 2048, {"fsdp": 2}, rules, head_trained=True)
    assert odd[0] == 3 * 3 * 2.0 * 2 * 512 * d * v
    # rules without activation_vocab (replicated) on tensor=2: 2 rows, the whole vocabulary
    # (the default rules' half would make it 3 chunks of 768)
    whole = tuple(r for r in rules if r[0] != "activation_vocab")
    unsplit = chunked_loss.uncounted_costs(
        cfg, 4, 2048, {"tensor": 2, "fsdp": 2}, whole, head_trained=True
    )
    assert unsplit[0] == 3 * 3 * 2.0 * 2 * 512 * d * v  # 4 chunks of 512
    # tensor=3 does not divide the vocabulary: 50,646 entries on a device, 4 chunks of 512
    thirds = chunked_loss.uncounted_costs(cfg, 4, 2048, {"tensor": 3}, rules, head_trained=False)
    assert thirds[0] == 3 * 2 * 2.0 * 4 * 512 * d * 50_646
    assert chunked_loss.uncounted_costs(cfg, 4, 128, {}, rules, head_trained=True) == (0, 0)


@pytest.mark.devices(8)
def test_a_sequence_sharded_mesh_chunks_in_multiples_of_its_axes():
    """On a mesh sharding the sequence (context=2) and the vocabulary (tensor=2), a chunk
    of 3 positions is rounded up to 4 and the NLL and gradients equal the full logits'."""
    cfg = get_config("qwen3-tiny")
    mesh = sharding.make_mesh(fitted({"context": 2, "tensor": 2, "fsdp": 2}))
    model = sharding.shard_model(model_with_path_values(cfg), mesh)
    with sharding.use_mesh(mesh):
        assert chunked_loss.chunk_length(2, 16, cfg.vocab_size, 3) == 4
        assert_same_nll(model, batch_of(cfg, seq=16), chunk=3)


@pytest.mark.slow
def test_images_reach_the_chunked_nll(tmp_path):
    """Vision SFT's batch (images at the image tokens): chunked equals full logits."""
    from tests.test_vision_sft import image_batch  # needs tunix (skips without it)

    model = model_with_path_values(get_config("gemma4-vision-tiny"))
    batch = image_batch(tmp_path)
    assert_same_nll(model, batch, chunk=37)
    text_only = {k: v for k, v in batch.items() if k != "images"}
    assert nll_and_grads(model, text_only, logit_chunk=37)[0] != pytest.approx(
        nll_and_grads(model, batch, logit_chunk=37)[0]
    )


@pytest.mark.parametrize(
    ("batch", "seq", "vocab", "chunk", "mesh", "want"),
    [
        (4, 2048, 151_936, None, {}, 256),  # 220 fit in 512 MiB: 10 of 205 -> 8 of 256 (TILE)
        (4, 1024, 151_936, None, {}, 256),  # 5 of 205 -> 4 of 256 (the v5e's 83 s compile)
        # 110 fit: 10 of 103 -> 8 of 128 (103 rows of a bf16 tile of 16 made the chunk's
        # [8, 103, vocab] -> [824, vocab] a copy: 14.4 ms of a v5e's 405 ms step)
        (8, 1024, 151_936, None, {}, 128),
        (16, 1024, 151_936, None, {}, 64),  # 55 fit: 19 of 54 -> 16 of 64, a multiple of 16
        (16, 1000, 151_936, None, {}, 48),  # 55 fit: 21 of 48 (1008) pad less than 16 of 64
        (4, 100, 479_349, None, {}, 64),  # 70 fit: 2 of 50 -> 2 of 64 (48: 3, padding more)
        (4, 127, 479_349, None, {}, 127),  # 2 of 64 pad 1; the tile, 128, is the sequence
        # 35 a device on context=2: 2 of 64 -> the tile as the sequence, rounded up to
        # its 2 shards: 126, not 125
        (4, 125, 958_698, None, {"context": 2}, 126),
        (4, 100, 838_860, None, {}, 32),  # 40 fit: 3 of 34 -> 4 of 32; never one of 100 (2.5x)
        # 330 fit: 4 of 258 -> 4 of 288, lcm(16, 3); 3 of 384 pad as much, farther
        (8, 1024, 151_936, None, {"context": 3}, 288),
        (4, 4096, 223_696, None, {}, 128),  # 150 fit: 28 of 147 -> the nearest tile, 128
        (4, 4096, 134_217, None, {}, 256),  # 250 fit: 17 of 241 -> 16 of 256; 128 pads as little
        (4, 4096, 151_936, None, {"context": 3}, 384),  # 660 fit: 7 of 588 -> 11 of lcm(128, 3)
        (4, 2048, 151_936, None, {"fsdp": 2, "tensor": 2}, 768),  # 3 of 683: 3 of 768, not 4 of 640
        (4, 127, 151_936, None, {}, 127),  # one chunk: the whole sequence, not a tile
        (4, 300, 264, None, {}, 300),  # one chunk of 300, not rounded to 384
        (4, 2048, 151_936, 2048, {}, 2048),
        (4, 2048, 151_936, 4096, {}, 2048),  # never more than the sequence
        (4, 17, 264, 5, {}, 5),
        (4, 16, 264, 5, {}, 4),  # 4 chunks either way: evened out, no padding
        (1, 10, 264, 1, {}, 1),
        (1024, 64, 262_144, None, {}, 1),  # not one position fits: one a chunk all the same
        (32, 4096, 262_144, None, {}, 16),  # 16 positions fit
        (32, 4096, 262_144, None, {"fsdp": 4}, 64),  # 8 rows per device: 4x as many
        (4, 4096, 262_144, None, {"tensor": 4}, 512),  # a quarter of the vocabulary
        (4, 4096, 264, 3, {"context": 2}, 4),  # rounded up to the sequence's 2 shards
        (4, 2048, 151_936, None, {"tensor": 3}, 512),  # 50,646 entries a device, rounded up
    ],
)
@pytest.mark.host  # arithmetic on shapes: no program
def test_chunk_length(batch, seq, vocab, chunk, mesh, want):
    """Default: the positions whose float32 logits fit in 512 MiB on one device; evened
    out over the chunks it takes; a multiple of the axes sharding the sequence; from 128
    positions up, the multiple of 128 and of those axes below or above it that pads least,
    else the nearer; under 128, from 16 up, the same among the multiples of 16 and, from
    64, 128 itself; one past the sequence is the sequence."""
    got = chunked_loss.chunk_length(batch, seq, vocab, chunk, mesh_shape=mesh)
    assert got == want and type(got) is int  # a reshape's dimension


@pytest.mark.host
@given(
    batch=st.integers(1, 64),
    seq=st.integers(1, 16_384),
    vocab=st.integers(1_000, 300_000),
    context=st.sampled_from([1, 2, 3, 4, 8]),
)
def test_a_default_chunk_is_tiled_and_pads_less_than_a_chunk(batch, seq, vocab, context):
    """Any default chunk: a multiple of the axes sharding the sequence; from 128 positions
    up, either the whole sequence or a multiple of 128 and of those axes; from 16 up, of 16
    and those axes; never longer than the sequence; its padding under one chunk."""
    length = chunked_loss.chunk_length(batch, seq, vocab, mesh_shape={"context": context})
    count = -(-seq // length)
    assert length % context == 0
    assert length <= -(-seq // context) * context  # the sequence, rounded up to its shards
    if math.lcm(128, context) <= length < seq:
        assert length % math.lcm(128, context) == 0
    if math.lcm(16, context) <= length < seq:
        assert length % math.lcm(16, context) == 0 or length == math.lcm(128, context)
    assert count * length - seq < length


@pytest.mark.devices(2)
def test_chunk_length_reads_the_current_meshs_rules():
    """Under ``use_mesh`` without arguments: its mesh and its rules (here the vocabulary
    left whole on tensor=2: 128 positions of 262,144 entries, not 256)."""
    whole = tuple(r for r in sharding.DEFAULT_RULES if r[0] != "activation_vocab")
    mesh = sharding.make_mesh({"tensor": 2}, devices=jax.devices()[:2])
    with sharding.use_mesh(mesh, whole):
        assert chunked_loss.chunk_length(4, 4096, 262_144) == 128
    with sharding.use_mesh(mesh):
        assert chunked_loss.chunk_length(4, 4096, 262_144) == 256


@pytest.mark.host
@pytest.mark.parametrize("chunk", [0, -3, 2.5, True, "8"])
def test_a_chunk_that_is_no_positive_integer_is_refused(chunk):
    with pytest.raises(ValueError, match=f"logit chunk={chunk!r} must be a positive integer"):
        chunked_loss.chunk_length(2, 16, 264, chunk)


@pytest.mark.aot
@pytest.mark.host  # a deviceless compile on the host: no chip runs it
def test_on_a_tpu_a_chunk_of_whole_bf16_tiles_reshapes_its_logits_without_a_copy():
    """Why a default chunk is a multiple of ``SUBLANES``: the chunked loss's value and
    gradient compiled for a v5e (libtpu, deviceless; bfloat16, 8 x 256, vocab 2,048): with
    chunks of 37 positions the compiled program copies each chunk's ``[8, 37, vocab]``
    logits into ``[296, vocab]`` (37 rows are no whole number of a bfloat16 tile's 16; on
    the chip, at qwen3-0.6b's 8 x 1024 and 103 positions, 14.4 ms of a 405 ms step), with
    chunks of 32 it copies nothing. Should the 37-row copy go (a libtpu that lays the
    chunk out otherwise), ``SUBLANES`` no longer buys anything: this test says so."""
    from posttrain import _compat
    from posttrain.plan import topology

    device = topology.devices(topology.get("v5e-1"))[0]
    on_chip = jax.sharding.SingleDeviceSharding(device)
    base = get_config("qwen3-tiny")
    cfg = base.replace(vocab_size=2048, dtype="bfloat16", param_dtype="bfloat16")
    graphdef, params, rest = nnx.split(
        nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0))), nnx.Param, ...
    )
    rows, seq = 8, 256

    def nll(params, hidden, tokens, targets, chunk):
        model = nnx.merge(graphdef, params, rest)
        return chunked_loss.chunked_nll(hidden, model, tokens, targets, chunk=chunk)

    def abstract(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=on_chip)

    def copies(chunk: int) -> list[str]:
        length = chunked_loss.chunk_length(rows, seq, cfg.vocab_size, chunk)
        assert length == chunk  # no rounding of an explicit chunk here
        step = jax.jit(jax.value_and_grad(nll, argnums=(0, 1)), static_argnums=4)
        args = (
            jax.tree.map(lambda x: abstract(x.shape, x.dtype), params),
            abstract((rows, seq, cfg.d_model), jnp.bfloat16),
            abstract((rows, seq), jnp.int32),
            abstract((rows, seq - 1), jnp.bool_),
        )
        with _compat.no_persistent_compilation_cache():  # a deviceless compiler cannot load one
            hlo = step.lower(*args, chunk).compile().as_text()
        flat = rf"= \w+\[{rows * length},{cfg.vocab_size}\]\S* (?:copy|reshape)\("
        chunked = rf"= \w+\[{rows},{length},{cfg.vocab_size}\]\S* (?:copy|transpose)\("
        return [line for line in hlo.splitlines() if re.search(f"{flat}|{chunked}", line)]

    assert 32 % chunked_loss.SUBLANES == 0 and 37 % chunked_loss.SUBLANES != 0
    assert copies(32) == []
    assert copies(37), "no copy of 37-row chunks' logits: SUBLANES may no longer be needed"


def test_the_compiled_step_holds_far_less_than_the_full_logits():
    """``memory_analysis`` of the jitted NLL and gradient (vocab 32,768, 2 x 512 tokens):
    the chunked loss's temporaries are under half the full logits loss's, and under half
    of one copy of the batch's float32 logits (no chunk's logits kept for the backward)."""
    cfg = get_config("qwen3-tiny", vocab_size=32_768)
    model = nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)))  # never materialised
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    batch = batch_of(cfg, seq=512)

    def temporaries(**options) -> int:
        def nll(params):
            return loss.sft_terms(nnx.merge(graphdef, params, rest), **batch, **options)["nll_sum"]

        compiled = jax.jit(jax.value_and_grad(nll)).lower(params).compile()
        # a profile shows the loss: its ops carry the named scope
        scope = re.search(r'op_name="[^"]*[/(]chunked_nll[)/]', compiled.as_text())
        scoped[scope is not None] = options
        return compiled.memory_analysis().temp_size_in_bytes

    scoped = {}
    full, chunked = temporaries(chunked=False), temporaries(logit_chunk=16)
    assert scoped == {False: {"chunked": False}, True: {"logit_chunk": 16}}
    logits = 2 * 512 * cfg.vocab_size * 4  # one copy of the batch's float32 logits
    assert full >= logits
    assert chunked < TEMP_RATIO * full, (chunked, full)
    assert chunked < TEMP_RATIO * logits, (chunked, logits)


@pytest.mark.parametrize(
    ("options", "logits"),
    [({}, "[2,16,"), ({"chunked": False}, "[2,16,"), ({"logit_chunk": 4}, "[2,4,")],
)
def test_a_trainers_loss_options_reach_its_objective(options, logits):
    """``SFTStep.loss_options`` (``benchmarks/sft_step.py --logit-chunk``) reach
    ``sft_terms``: the objective's jaxpr has the chunked loss's scan unless they ask for
    the full logits, and its float32 logits are a chunk's (4 positions) when they set one."""
    from posttrain.training.step import SFTStep

    cfg = get_config("qwen3-tiny")
    model = model_with_path_values(cfg)
    fields = {"loss_options": options, "moe_aux_loss_weight": 0.0, "grad_accum_steps": 1}
    step = type("Step", (SFTStep,), fields)()
    jaxpr = jax.make_jaxpr(lambda b: step._objective(model, b)[0])(batch_of(cfg, seq=16))
    eqns = list(chunked_loss.equations(jaxpr.jaxpr))
    assert any(e.primitive.name == "scan" for e in eqns) == options.get("chunked", True)
    shapes = {str(v.aval) for e in eqns for v in e.outvars}
    assert f"float32{logits}{cfg.vocab_size}]" in shapes, sorted(shapes)
    if logits == "[2,4,":
        assert f"float32[2,16,{cfg.vocab_size}]" not in shapes
