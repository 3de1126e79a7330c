"""Splash attention (``ModelConfig.attention_kernel``, :mod:`posttrain.layers.splash`)
against the XLA path, through whole tiny models, in Pallas' interpret mode on the CPU.

Every case compares the logits of the queries that see a key and the gradients of a loss
over them (padding queries differ by design: the module docstring). Interpret mode is
slow: T = 128 (one block of 128, the smallest the kernel takes), 2-layer tiny presets.
Under a mesh of fake CPU devices the kernel runs per shard (``jax.shard_map``): against
splash on one device, and no all-gather of q, k or v in the compiled program.
"""

from __future__ import annotations

import contextlib
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain import sharding
from posttrain.layers import splash
from posttrain.models import build_model, get_config
from posttrain.plan import topology
from posttrain.plan.compile import build_programs
from posttrain.plan.options import PlanOptions
from tests.jaxprs import equations, sub_jaxprs

pytestmark = pytest.mark.matmul_precision("highest")

SEQ = 128
PAD = 37
#: float32: the kernel sums the softmax and the weighted values over S = 128 keys in
#: another order (blocks, online rescaling) than the XLA path; the rounding of a sum of n
#: terms is within n * eps = 128 * 2^-24 ~ 7.6e-6 of its magnitude, so 1e-5 of the
#: largest value bounds it with room for two layers: of the logits, and of all the
#: gradients (a leaf's gradient can cancel to far below the terms whose rounding it
#: carries: gemma4-tiny's, 1e-3 of the largest, is off by 2e-5 of it).
FP32_TOL = 1e-5
#: bfloat16: each path rounds differently (the kernel rounds q * scale to bfloat16, the
#: XLA path scales float32 scores), and bf16 training of the tiny models is far from the
#: float32 one on some gradient leaves (relative errors > 1 on near-zero leaves); so
#: splash in bf16 must be as close to the float32 XLA model as XLA in bf16 is: within
#: three times its error plus two units of bfloat16's 2^-8 spacing of the leaf's largest value.
BF16_FACTOR, BF16_SLACK = 3.0, 2 * 2**-8


def _padding_mask(batch: int, seq: int = SEQ) -> tuple[np.ndarray, np.ndarray]:
    """Tunix's causal x non-pad mask ``[B, T, T]`` of rows: none, right, left and middle
    padding (cycled), and the ``[B, T]`` tokens that are not padding (a padding query
    may see no key in a sliding layer)."""
    valid = np.ones((batch, seq), bool)
    for row in range(batch):
        kind = row % 4
        if kind == 1:
            valid[row, seq - PAD :] = False
        elif kind == 2:
            valid[row, :PAD] = False
        elif kind == 3:
            valid[row, PAD : 2 * PAD] = False
    causal = np.tril(np.ones((seq, seq), bool))
    mask = causal[None] & valid[:, None, :]
    return mask, valid


def _packed_mask(batch: int, seq: int = SEQ) -> tuple[np.ndarray, np.ndarray]:
    """The packing path's same-segment mask (``training.loss.packed_attention_mask``):
    segments of 50, 41 and 9 tokens, then padding (segment 0) seeing only padding."""
    ids = np.zeros((batch, seq), np.int32)
    ids[:, :50], ids[:, 50:91], ids[:, 91:100] = 1, 2, 3
    ids[1::2] = np.roll(ids[1::2], 11, axis=1)  # odd rows start with padding
    mask = ids[:, :, None] == ids[:, None, :]
    return mask, np.ones((batch, seq), bool)


MASKS = {"causal": None, "padding": _padding_mask, "packed": _packed_mask}


def _compiled(cfg, mask, valid, batch, mesh=None, seq=SEQ, device=None):
    """A tiny model's loss and gradient (built on ``mesh`` and compiled under it, if one
    is given; its parameters moved onto ``device``, if one is given), compiled, and its
    parameters."""
    model = build_model(cfg, mesh, seed=3)
    if device is not None:  # build_model places a small model on jax.devices()[0]
        nnx.update(model, jax.device_put(nnx.state(model), device))
    graph, params, rest = nnx.split(model, nnx.Param, ...)
    tokens = jax.random.randint(jax.random.key(5), (batch, seq), 0, cfg.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(seq), tokens.shape)

    def loss(p):
        logits = nnx.merge(graph, p, rest)(tokens, positions, None, mask)[0]
        logits = logits.astype(jnp.float32)
        return jnp.sum(jnp.where(valid[..., None], jax.nn.log_softmax(logits), 0.0)), logits

    step = jax.jit(jax.value_and_grad(loss, has_aux=True))
    with sharding.use_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        return step.lower(params).compile(), params


def _logits_grads(cfg, mask, valid, batch, mesh=None, seq=SEQ, device=None):
    step, params = _compiled(cfg, mask, valid, batch, mesh, seq, device)
    (_, logits), grads = step(params)
    if device is not None:
        ran_on = {d for leaf in [logits, *jax.tree.leaves(grads)] for d in leaf.devices()}
        assert ran_on == {device}, f"the reference ran on {ran_on}, not on {device}"
    logits = np.where(valid[..., None], np.asarray(logits), 0.0)
    return logits, [np.asarray(g, np.float32) for g in jax.tree.leaves(grads)]


def _leaves(result):
    logits, grads = result
    return [("logits", logits)] + [(f"grad {i}", g) for i, g in enumerate(grads)]


def _host_reference(cfg, mask, valid, batch):
    """The XLA path in float32 on the host's CPU (exact float32 products and sums), when
    the tests run on an accelerator; None on the CPU, where ``want`` is already that.

    On a TPU at ``highest`` precision both paths still round (the chip's float32 matmul
    passes, its exp). The truth both approximate is the host's; splash on the chip is held
    to it as closely as the chip's XLA path is, or FP32_TOL (ON_A_TPU_FP32: it is not yet)."""
    if jax.default_backend() == "cpu":
        return None
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        return _logits_grads(cfg, mask, valid, batch, device=cpu)


def _check_equal(preset, case, dtype, batch=4):
    cfg = get_config(preset)
    mask, valid = (None, np.ones((batch, SEQ), bool)) if case == "causal" else MASKS[case](batch)
    want = _logits_grads(cfg, mask, valid, batch)
    host = _host_reference(cfg, mask, valid, batch) if dtype == "float32" else None
    splash_cfg = cfg.replace(attention_kernel="splash_interpret", dtype=dtype)
    got = _logits_grads(splash_cfg, mask, valid, batch)
    xla = (
        _logits_grads(cfg.replace(dtype=dtype), mask, valid, batch) if dtype != "float32" else want
    )
    grad_scale = max(float(np.max(np.abs(g))) for g in want[1])
    hosts = _leaves(host) if host is not None else [(None, None)] * len(_leaves(want))
    for (name, w), (_, g), (_, x), (_, h) in zip(
        _leaves(want), _leaves(got), _leaves(xla), hosts, strict=True
    ):
        scale = max(float(np.max(np.abs(w))), 1e-30)
        err = float(np.max(np.abs(g - w)))
        if dtype == "float32":
            bound = FP32_TOL * (scale if name == "logits" else grad_scale)
            if h is not None:  # on an accelerator: both against the host's float32
                err = float(np.max(np.abs(g - h)))
                bound = max(bound, BF16_FACTOR * float(np.max(np.abs(w - h))))
        else:
            bound = BF16_FACTOR * float(np.max(np.abs(x - w))) + BF16_SLACK * scale
        assert err <= bound, f"{preset} {case} {dtype} {name}: {err:.3g} > {bound:.3g}"


#: a v5e's float32 splash gradients, measured (lent chip, 2026-12-06, at 28f2b37; the
#: figures and their commands in docs/scale.md): against the host's float32 XLA,
#: splash's worst gradient is 1.86x FP32_TOL (qwen3 padding) and 2.53x (gpt_oss packed) in
#: interpret mode, 1.87x and 2.57x as the compiled Mosaic kernel, where the chip's own XLA
#: path is 0.32x and 0.35x; the logits agree (0.26-0.30x). The online softmax's float32
#: on the chip (its exp, its rescaling) rounds more than the one-pass softmax: held as a
#: strict xfail there, so a fix (or a jax that rounds less) shows.
ON_A_TPU_FP32 = pytest.mark.xfail(
    condition="jax.default_backend() == 'tpu'",
    strict=True,
    reason="issue 54: splash's float32 gradients on a v5e are 1.9-2.6x FP32_TOL from the "
    "host's float32, the chip's XLA 0.32-0.35x (ON_A_TPU_FP32)",
)


@pytest.mark.parametrize(
    ("preset", "case", "dtype"),
    [
        pytest.param("qwen3-tiny", "padding", "float32", marks=ON_A_TPU_FP32),
        # sinks, a sliding layer
        pytest.param("gpt_oss-tiny", "packed", "float32", marks=ON_A_TPU_FP32),
    ],  # gemma4's bf16 padding (13 s here) and every other case: the slow tier's below
    ids=["qwen3-padding-fp32", "gpt_oss-packed-fp32"],
)
# on a chip both are the strict xfail above: one shows a fix
@pytest.mark.chip_sample("qwen3-padding-fp32")
def test_splash_equals_xla(preset, case, dtype):
    """Splash attention's logits and parameter gradients equal the XLA path's."""
    _check_equal(preset, case, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", sorted(MASKS))
@pytest.mark.parametrize("preset", ["llama3-tiny", "qwen3-tiny", "gemma4-tiny", "gpt_oss-tiny"])
def test_splash_equals_xla_everywhere(preset, case, dtype):
    """Every family with attention variants, every mask kind, both dtypes."""
    _check_equal(preset, case, dtype)


def _gathers(hlo: str) -> set[tuple[int, ...]]:
    """The result shapes of a compiled HLO's all-gathers."""
    found = re.findall(r"= \w+\[([\d,]*)\]\S* all-gather\(", hlo)
    return {tuple(int(d) for d in dims.split(",") if d) for dims in found}


def _check_sharded(preset, case, axes, batch=4, seq=SEQ, **overrides):
    """Splash under a mesh of ``axes`` (``jax.shard_map``) against splash on one device:
    logits and gradients within :data:`FP32_TOL`; no all-gather yields a whole q, k or v
    (``[B, N, T, H]``, ``[B, K, T, H]``: what XLA does around an unsplit kernel)."""
    cfg = get_config(preset, attention_kernel="splash_interpret", **overrides)
    mask, valid = MASKS[case](batch, seq) if MASKS[case] else (None, np.ones((batch, seq), bool))
    want = _logits_grads(cfg, mask, valid, batch, seq=seq)
    mesh = sharding.make_mesh(axes)
    step, params = _compiled(cfg, mask, valid, batch, mesh, seq)
    (_, logits), grads = step(params)
    logits = np.where(valid[..., None], np.asarray(logits), 0.0)
    got = logits, [np.asarray(g, np.float32) for g in jax.tree.leaves(grads)]
    grad_scale = max(float(np.max(np.abs(g))) for g in want[1])
    for (name, w), (_, g) in zip(_leaves(want), _leaves(got), strict=True):
        bound = FP32_TOL * (float(np.max(np.abs(w))) if name == "logits" else grad_scale)
        assert float(np.max(np.abs(g - w))) <= bound, f"{preset} {axes} {name}"
    padded = -(-seq // splash.LANES) * splash.LANES
    whole = {
        (batch, n, padded, a.head_dim)
        for a in cfg.attention.values()
        for n in (a.num_heads, a.num_kv_heads)
    }
    assert not whole & _gathers(step.as_text()), sorted(whole & _gathers(step.as_text()))


@pytest.mark.devices(8)
def test_splash_under_a_mesh_runs_on_each_shard():
    """fsdp 4 x tensor 2, with sinks: each device's kernel gets its batch rows and heads
    (and those heads' sinks), nothing gathers q, k or v around it, and the logits and
    gradients equal one device's."""
    _check_sharded(
        "gpt_oss-tiny", "padding", {"fsdp": 4, "tensor": 2}, num_layers=1, layer_types=("full",)
    )


@pytest.mark.slow
@pytest.mark.devices(8)
@pytest.mark.parametrize(
    ("preset", "case", "axes", "seq"),
    [
        ("gpt_oss-tiny", "packed", {"fsdp": 4, "tensor": 2}, SEQ),  # sinks, sliding
        ("gemma4-tiny", "padding", {"data": 2, "fsdp": 2, "tensor": 2}, SEQ),  # k_eq_v
        ("llama3-tiny", "causal", {"fsdp": 2, "tensor": 4}, SEQ),  # one kv head a shard
        ("gpt_oss-tiny", "padding", {"fsdp": 8}, 100),  # padded to a block
    ],
    ids=[
        "gpt_oss-packed-fsdp4-tp2",
        "gemma4-padding-dp2-fsdp2-tp2",
        "llama3-causal-fsdp2-tp4",
        "gpt_oss-padding-fsdp8-t100",
    ],
)
def test_splash_under_a_mesh_everywhere(preset, case, axes, seq):
    """Other families, masks and meshes: as :func:`test_splash_under_a_mesh_runs_on_each_shard`."""
    _check_sharded(preset, case, axes, seq=seq, batch=8 if axes.get("fsdp") == 8 else 4)


@pytest.mark.devices(2)
@pytest.mark.parametrize(
    ("unsplit", "q_axes", "kv_axes"),
    [("activation_kv_heads", "'tensor'", "None"), ("activation_heads", "None", "'tensor'")],
)
def test_kv_heads_split_unlike_the_query_heads_are_refused(unsplit, q_axes, kv_axes):
    """Rules that put the kv heads on other mesh axes than the query heads: one line
    at trace time naming both (a shard's query heads would read others' kv heads)."""
    rules = tuple((name, () if name == unsplit else axes) for name, axes in sharding.DEFAULT_RULES)
    q, k = jnp.zeros((2, SEQ, 8, 10)), jnp.zeros((2, SEQ, 4, 10))
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((SEQ, SEQ), bool)), (2, SEQ, SEQ))
    masks = splash.splash_mask(causal, causal, None, "splash_interpret")
    mesh = sharding.make_mesh({"tensor": 2}, devices=jax.devices()[:2])
    with sharding.use_mesh(mesh, rules), pytest.raises(ValueError) as info:
        jax.eval_shape(lambda q, k: splash.attend(q, k, k, masks, None, 1.0), q, k)
    assert str(info.value) == (
        f"splash attention splits num_heads=8 over mesh axes {q_axes} but num_kv_heads=4 "
        f"over {kv_axes}; expected the same axes for both (each shard's query heads read "
        "only its own kv heads)"
    )


@pytest.mark.devices(2)
def test_splash_without_sinks_under_a_mesh_traces():
    """No sinks under a mesh (qwen3, llama3; the gate's mesh case has sinks): the
    ``shard_map`` takes the five arrays only, and the output keeps q's shape. Traced."""
    q, k = jnp.zeros((2, SEQ, 4, 16)), jnp.zeros((2, SEQ, 2, 16))
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((SEQ, SEQ), bool)), (2, SEQ, SEQ))
    masks = splash.splash_mask(causal, causal, None, "splash_interpret")
    mesh = sharding.make_mesh({"tensor": 2}, devices=jax.devices()[:2])
    with sharding.use_mesh(mesh):
        out = jax.eval_shape(lambda q, k: splash.attend(q, k, k, masks, None, 1.0), q, k)
    assert (out.shape, out.dtype) == (q.shape, q.dtype)


def _forward(cfg, mask, seq=SEQ, batch=2):
    model = build_model(cfg, seed=3)
    tokens = jax.random.randint(jax.random.key(5), (batch, seq), 0, cfg.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(seq), tokens.shape)
    return np.asarray(model(tokens, positions, None, mask)[0])


@pytest.mark.devices(8)
def test_a_sequence_sharded_over_context_falls_back_to_the_xla_path():
    """The kernel needs whole sequences: with ``context`` = 2 every layer attends through
    the XLA path over the mask the decoder built (no pallas_call), and the logits equal the
    XLA model's on the same mesh."""
    cfg = get_config("qwen3-tiny", num_layers=1, layer_types=("full",))
    mesh = sharding.make_mesh({"context": 2, "fsdp": 4})
    tokens = jax.random.randint(jax.random.key(5), (4, SEQ), 0, cfg.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(SEQ), tokens.shape)
    mask, _ = _padding_mask(4, SEQ)
    logits = {}
    for kernel in ("xla", "splash_interpret"):
        model = build_model(cfg.replace(attention_kernel=kernel), mesh, seed=3)
        with sharding.use_mesh(mesh):
            forward = lambda t, m, model=model: model(t, positions, None, m)[0]  # noqa: E731
            assert "pallas_call" not in str(jax.make_jaxpr(forward)(tokens, mask))
            logits[kernel] = np.asarray(jax.jit(forward)(tokens, mask))
    np.testing.assert_allclose(logits["splash_interpret"], logits["xla"], rtol=0, atol=0)


@pytest.mark.slow  # 14 s of interpret mode; the gate keeps splash against XLA on two masks
def test_a_mask_segment_ids_cannot_express_gives_nan():
    """An example whose mask is no causal x segment mask (a key hidden from one query
    only) gets NaN logits; the other example is unchanged."""
    cfg = get_config("qwen3-tiny", num_layers=1, layer_types=("full",))
    mask = np.broadcast_to(np.tril(np.ones((SEQ, SEQ), bool)), (2, SEQ, SEQ)).copy()
    mask[1, 90, 20] = False
    want = _forward(cfg, mask)
    got = _forward(cfg.replace(attention_kernel="splash_interpret"), mask)
    assert np.isnan(got[1]).all()
    np.testing.assert_allclose(got[0], want[0], rtol=0, atol=FP32_TOL * np.abs(want[0]).max())


@pytest.mark.slow  # 18 s of interpret mode; the gate keeps splash against XLA on two masks
def test_a_sequence_off_the_block_is_padded():
    """T = 100 (not a multiple of 128): padded to a block inside the kernel, same logits."""
    cfg = get_config("gpt_oss-tiny")
    mask, valid = _padding_mask(2, 100)
    want = _forward(cfg, mask, seq=100)
    got = _forward(cfg.replace(attention_kernel="splash_interpret"), mask, seq=100)
    got, want = got[valid], want[valid]
    np.testing.assert_allclose(got, want, rtol=0, atol=FP32_TOL * np.abs(want).max())


def test_segment_ids_of_padding_and_packing():
    """First visible key per query, the key's own where valid, sentinels elsewhere."""
    mask, _ = _padding_mask(4, 8 + 2 * PAD)
    q, kv = (np.asarray(a) for a in splash.segment_ids(jnp.asarray(mask)))
    assert (q[0] == 0).all() and (kv[0] == 0).all()
    assert (kv[1, -PAD:] == splash.NO_KEY).all() and (q[1, -PAD:] == 0).all()
    assert (q[2, :PAD] == splash.NO_QUERY).all() and (q[2, PAD:] == PAD).all()
    assert (kv[3, PAD : 2 * PAD] == splash.NO_KEY).all() and (q[3] == 0).all()
    implied = np.asarray(splash.implied_mask(jnp.asarray(q), jnp.asarray(kv), None))
    np.testing.assert_array_equal(implied, mask)


def test_segment_ids_are_int32():
    """The kernel's segment ids are int32 (:class:`~posttrain.layers.splash.SplashMask`'s
    dtype), not argmax's cast elsewhere (float ids would compare alike but are no contract)."""
    mask, _ = _packed_mask(2, 16)
    q, kv = splash.segment_ids(jnp.asarray(mask))
    assert (q.dtype, kv.dtype) == (jnp.int32, jnp.int32)


def _attend_jaxpr(dtype):
    """splash.attend traced (not run) over B = 1, N = 2, K = 1, H = 16, scale 1/3."""
    q, k = jnp.zeros((1, SEQ, 2, 16), dtype), jnp.zeros((1, SEQ, 1, 16), dtype)
    causal = jnp.tril(jnp.ones((SEQ, SEQ), bool))[None]
    masks = splash.splash_mask(causal, causal, None, "splash_interpret")
    return jax.make_jaxpr(lambda q, k: splash.attend(q, k, k, masks, None, 1 / 3))(q, k).jaxpr


def test_bfloat16_attention_stays_bfloat16():
    """bfloat16: q is scaled in float32 and rounded back, so the kernel's q, k and v are
    all bfloat16, and so is the output (a float32 q would make a mixed-precision kernel, a
    float32 output float32 work after it; the slow tier's bf16 cases see either only
    through tolerances)."""
    jaxpr = _attend_jaxpr(jnp.bfloat16)
    assert [v.aval.dtype for v in jaxpr.outvars] == [jnp.bfloat16]
    (call,) = [e for e in equations(jaxpr) if e.primitive.name == "pallas_call"]
    floats = [v.aval for v in call.invars if jnp.issubdtype(v.aval.dtype, jnp.floating)]
    assert [(a.shape, a.dtype) for a in floats] == [
        ((2, SEQ, 16), jnp.bfloat16),
        ((1, SEQ, 16), jnp.bfloat16),
        ((1, SEQ, 16), jnp.bfloat16),
    ]


def test_the_kernel_runs_under_the_attention_splash_scope():
    """Profiles and HLO dumps find the kernel under the ``attention_splash`` scope, as the
    XLA path's stages under theirs (tests/test_models.py)."""
    scoped = [
        e
        for e in equations(_attend_jaxpr(jnp.float32))
        if "attention_splash" in str(e.source_info.name_stack).split("/")
    ]
    inner = {
        e.primitive.name for top in scoped for sub in sub_jaxprs(top.params) for e in equations(sub)
    }
    assert "pallas_call" in inner


def _primitives(cfg) -> set[str]:
    model = build_model(cfg, seed=0)
    tokens = jnp.zeros((1, SEQ), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda t: model(t, jnp.broadcast_to(jnp.arange(SEQ), t.shape)))(tokens)
    return {str(e.primitive) for e in _equations(jaxpr.jaxpr)}


def _equations(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.core.subjaxprs(eqn) if hasattr(jax.core, "subjaxprs") else ():
            yield from _equations(sub)
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                yield from _equations(inner)


def test_the_option_reaches_the_model():
    """``attention_kernel`` decides whether the model's program holds a ``pallas_call``."""
    cfg = get_config("qwen3-tiny", num_layers=1, layer_types=("full",))
    assert "pallas_call" not in _primitives(cfg)
    assert "pallas_call" in _primitives(cfg.replace(attention_kernel="splash_interpret"))


@pytest.mark.skipif(jax.default_backend() == "tpu", reason="the refusal is off a TPU")
def test_splash_off_a_tpu_is_refused_at_build():
    with pytest.raises(ValueError) as info:
        build_model(get_config("qwen3-tiny", attention_kernel="splash"))
    assert str(info.value) == (
        f"attention_kernel='splash' needs a TPU backend, this is {jax.default_backend()!r}"
    )


@pytest.mark.parametrize(
    ("platform", "kernel", "refused"),
    [
        ("tpu", "splash", False),
        ("cpu", "splash", True),
        ("gpu", "splash", True),
        ("cpu", "splash_interpret", False),
        ("cpu", "xla", False),
    ],
)
def test_only_a_tpu_target_takes_the_kernel(monkeypatch, platform, kernel, refused):
    """The check by the platform the program targets (a TPU mesh's, the plan's deviceless
    one included): splash on a TPU passes, anywhere else is refused; the interpreter and
    XLA pass everywhere."""
    monkeypatch.setattr(splash, "target_platform", lambda: platform)
    if refused:
        with pytest.raises(ValueError, match=f"needs a TPU backend, this is '{platform}'$"):
            splash.check_backend(kernel)
    else:
        splash.check_backend(kernel)


def test_the_target_is_the_current_meshs_platform(monkeypatch):
    """Under a mesh the target is its devices' platform, not the backend's (the plan's
    deviceless TPU devices on a CPU host; a mesh of one device included)."""
    tpu = types.SimpleNamespace(platform="tpu")
    mesh = types.SimpleNamespace(devices=np.array([tpu], dtype=object))
    monkeypatch.setattr(sharding, "current", lambda: types.SimpleNamespace(mesh=mesh))
    assert splash.target_platform() == "tpu"


@pytest.mark.skipif(jax.default_backend() == "tpu", reason="the refusal is off a TPU")
@pytest.mark.parametrize(
    "argv",
    [["sft"], ["sft", "--vision"], ["dpo"], ["dpo", "--algorithm", "orpo"], ["distill"]],
    ids=["sft", "vision-sft", "dpo", "orpo", "distill"],
)
def test_the_cli_refuses_splash_off_a_tpu_before_writing(argv, tmp_path, capsys):
    """``--attention-kernel splash`` on a CPU: one line naming the flag and the backend,
    exit 2, no output directory (the options' check, before any read or write)."""
    from posttrain import cli

    out = tmp_path / "run"
    status = cli.main([*argv, "--attention-kernel", "splash", "--output", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert (status, err) == (
        2,
        [
            "posttrain: error: --attention-kernel splash needs a TPU backend, "
            f"this is {jax.default_backend()!r}"
        ],
    )
    assert not out.exists() and not any(tmp_path.iterdir())


def test_an_unknown_kernel_is_refused():
    with pytest.raises(ValueError, match=r"attention_kernel='flash' must be one of xla, splash, "):
        get_config("qwen3-tiny", attention_kernel="flash")


@pytest.mark.slow  # 2.5 s here, lowering only
@pytest.mark.aot
def test_a_sharded_splash_step_lowers_for_a_v5e_slice():
    """Deviceless v5e-8, fsdp 4 x tensor 2: the train step lowers with each Mosaic call
    inside a ``shard_map`` (without one, jax 0.10.2 refuses to lower: "Mosaic kernels
    cannot be automatically partitioned")."""
    options = PlanOptions(
        model="qwen3-tiny",
        topology="v5e-8",
        attention_kernel="splash",
        mesh={"fsdp": 4, "tensor": 2},
        num_layers=1,
        batch=8,
        seq=2048,
    )
    _, programs, mesh = build_programs(options, topology.get("v5e-8"))
    step = programs["train step"]
    with sharding.use_mesh(mesh, jax_context=False):
        text = step.jitted.lower(*step.args, **step.kwargs).as_text()
    calls = text.count("tpu_custom_call")
    assert calls and calls == text.count("sdy.manual_computation"), calls
