"""Splash attention (``ModelConfig.attention_kernel``, :mod:`posttrain.layers.splash`)
against the XLA path, through whole tiny models, in Pallas' interpret mode on the CPU.

Every case compares the logits of the queries that see a key and the gradients of a loss
over them (padding queries differ by design: the module docstring). Interpret mode is
slow: T = 128 (one block of 128, the smallest the kernel takes), 2-layer tiny presets.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain.layers import splash
from posttrain.models import build_model, get_config

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


def _logits_grads(cfg, mask, valid, batch):
    model = build_model(cfg, seed=3)
    graph, params, rest = nnx.split(model, nnx.Param, ...)
    tokens = jax.random.randint(jax.random.key(5), (batch, SEQ), 0, cfg.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(SEQ), tokens.shape)

    def loss(p):
        logits = nnx.merge(graph, p, rest)(tokens, positions, None, mask)[0]
        logits = logits.astype(jnp.float32)
        return jnp.sum(jnp.where(valid[..., None], jax.nn.log_softmax(logits), 0.0)), logits

    (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    logits = np.where(valid[..., None], np.asarray(logits), 0.0)
    return logits, [np.asarray(g, np.float32) for g in jax.tree.leaves(grads)]


def _leaves(result):
    logits, grads = result
    return [("logits", logits)] + [(f"grad {i}", g) for i, g in enumerate(grads)]


def _check_equal(preset, case, dtype, batch=4):
    cfg = get_config(preset)
    mask, valid = (None, np.ones((batch, SEQ), bool)) if case == "causal" else MASKS[case](batch)
    want = _logits_grads(cfg, mask, valid, batch)
    splash_cfg = cfg.replace(attention_kernel="splash_interpret", dtype=dtype)
    got = _logits_grads(splash_cfg, mask, valid, batch)
    xla = (
        _logits_grads(cfg.replace(dtype=dtype), mask, valid, batch) if dtype != "float32" else want
    )
    grad_scale = max(float(np.max(np.abs(g))) for g in want[1])
    for (name, w), (_, g), (_, x) in zip(_leaves(want), _leaves(got), _leaves(xla), strict=True):
        scale = max(float(np.max(np.abs(w))), 1e-30)
        err = float(np.max(np.abs(g - w)))
        if dtype == "float32":
            bound = FP32_TOL * (scale if name == "logits" else grad_scale)
        else:
            bound = BF16_FACTOR * float(np.max(np.abs(x - w))) + BF16_SLACK * scale
        assert err <= bound, f"{preset} {case} {dtype} {name}: {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize(
    ("preset", "case", "dtype"),
    [
        ("qwen3-tiny", "padding", "float32"),
        ("gpt_oss-tiny", "packed", "float32"),  # sinks, a sliding layer
    ],  # gemma4's bf16 padding (13 s here) and every other case: the slow tier's below
    ids=["qwen3-padding-fp32", "gpt_oss-packed-fp32"],
)
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


def _forward(cfg, mask, seq=SEQ, batch=2):
    model = build_model(cfg, seed=3)
    tokens = jax.random.randint(jax.random.key(5), (batch, seq), 0, cfg.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(seq), tokens.shape)
    return np.asarray(model(tokens, positions, None, mask)[0])


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
