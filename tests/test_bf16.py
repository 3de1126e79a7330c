"""The bfloat16 tier: the full-size presets run in bfloat16, so every family runs here in
bfloat16 too, against its float32 twin, and the float32 islands are checked directly.

Float32 islands (where bf16 rounding changes decisions or loses the sum): the router's
logits, scores and top-k; the attention softmax; RMSNorm's mean of squares; the logits
and the loss's log-softmax.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain.config import MoEConfig
from posttrain.layers.moe.router import Router, route
from posttrain.models import get_config
from posttrain.models.presets import TINY_PRESETS
from posttrain.sft import loss
from tests.path_params import model_with_path_values

BATCH, SEQ = 2, 24
# bf16 keeps 8 significant bits (relative rounding 2^-9 per op). On these fixtures (two
# layers, logits of std ~2.5) we measured, over the six families: mean |delta logit| up to
# 0.047 x the logits' std (mixtral; 0.005-0.024 for the dense ones), |delta mean NLL| up
# to 0.036 and top-1 agreement down to 0.896. MoE families sit at the top: a bf16 hidden
# state that moves a token across a routing near-tie sends it to another expert. The
# bounds leave ~2x headroom. The maximum |delta| is not bounded: those flips make it O(1).
MAX_MEAN_DELTA_PER_STD = 0.1
MAX_NLL_DELTA = 0.08
MIN_TOP1_AGREEMENT = 0.8
# Primitives that must only ever see float32 operands in a bf16 forward + loss: sums and
# maxima (norm variance, softmax denominators, loss), exp/log (softmax, log-softmax), top_k.
LOW_PRECISION = {"bfloat16", "float16"}  # integer counts are no island
FLOAT32_ONLY = {"reduce_sum", "reduce_max", "top_k", "exp", "log", "log1p", "logsumexp"}


@functools.cache
def tokens() -> jax.Array:
    return jax.random.randint(jax.random.key(11), (BATCH, SEQ), 1, 264, dtype=jnp.int32)


def forward_and_nll(model):
    def run(ids):
        logits, _ = model.forward(ids)
        targets = jnp.ones((BATCH, SEQ - 1), bool)
        return logits, loss.token_nll(logits, ids, targets) / targets.sum()

    return run


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_bf16_model_agrees_with_its_fp32_twin(preset):
    """Same (bf16-representable) weights, bf16 vs fp32 compute: logits and NLL agree
    within the bf16 bounds above."""
    bf16 = get_config(preset, dtype="bfloat16", param_dtype="bfloat16")
    fp32 = get_config(preset)
    got_logits, got_nll = jax.jit(forward_and_nll(model_with_path_values(bf16)))(tokens())
    want_logits, want_nll = jax.jit(
        forward_and_nll(model_with_path_values(fp32, rounded_to="bfloat16"))
    )(tokens())
    assert got_logits.dtype == jnp.float32  # the logits are an fp32 island
    delta = float(jnp.mean(jnp.abs(got_logits - want_logits)) / jnp.std(want_logits))
    top1 = float(jnp.mean(jnp.argmax(got_logits, -1) == jnp.argmax(want_logits, -1)))
    assert delta <= MAX_MEAN_DELTA_PER_STD, f"{preset}: mean |delta logit| / std {delta:.3f}"
    assert abs(float(got_nll) - float(want_nll)) <= MAX_NLL_DELTA, (got_nll, want_nll)
    assert top1 >= MIN_TOP1_AGREEMENT, f"{preset}: top-1 agreement {top1:.3f}"
    assert delta > 0  # the bf16 model really computed in bf16


def primitive_dtypes(jaxpr) -> list[tuple[str, str]]:
    """``(primitive, operand dtype)`` of every equation, sub-jaxprs (scan, jit, cond) included."""
    out = []
    for eqn in jaxpr.eqns:
        for var in eqn.invars:
            aval = getattr(var, "aval", None)
            if aval is not None and hasattr(aval, "dtype"):
                out.append((eqn.primitive.name, str(aval.dtype)))
        for sub in sub_jaxprs(eqn.params):
            out.extend(primitive_dtypes(sub))
    return out


def sub_jaxprs(params: dict):
    """The jaxprs an equation's params hold (scan/cond/pjit/custom_vjp bodies)."""
    for value in params.values():
        for item in value if isinstance(value, tuple | list) else (value,):
            inner = getattr(item, "jaxpr", item)  # a ClosedJaxpr holds a Jaxpr
            if hasattr(inner, "eqns"):
                yield inner


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_float32_islands_stay_float32_in_a_bf16_model(preset):
    """In the bf16 forward + loss, every reduction, exp/log and top_k reads float32."""
    cfg = get_config(preset, dtype="bfloat16", param_dtype="bfloat16")
    model = model_with_path_values(cfg)
    jaxpr = jax.make_jaxpr(forward_and_nll(model))(tokens()).jaxpr
    seen = primitive_dtypes(jaxpr)
    assert any(p == "dot_general" and d == "bfloat16" for p, d in seen)  # the bulk is bf16
    assert {p for p, _ in seen} & {"reduce_sum", "exp", "log"}  # the islands are there
    if cfg.moe is not None:
        assert any(p == "top_k" for p, _ in seen)
    low = sorted({(p, d) for p, d in seen if p in FLOAT32_ONLY and d in LOW_PRECISION})
    assert not low, f"{preset}: float32 islands computed in lower precision: {low}"


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_every_parameter_takes_the_param_dtype(preset):
    """param_dtype=bfloat16 reaches every parameter (a constructor that drops it falls
    back to float32 without a word)."""
    from posttrain.conversion.native import abstract_params

    cfg = get_config(preset, dtype="bfloat16", param_dtype="bfloat16")
    wrong = {k: str(v.dtype) for k, v in abstract_params(cfg).items() if v.dtype != jnp.bfloat16}
    assert not wrong, f"{preset}: parameters not in bfloat16: {wrong}"


def test_rope_rotates_in_float32_and_returns_the_activation_dtype():
    """A bfloat16 ``[batch, seq, heads, head_dim]`` input: rotated in float32 and rounded
    once, back to bfloat16 (a float32 result would carry attention in float32 on)."""
    from posttrain.layers.rope import apply_rope, rope_tables

    rope = get_config("qwen3-tiny").attention["full"].rope
    positions = jnp.arange(5, dtype=jnp.int32)[None]
    cos, sin = rope_tables(positions, rope, 8)
    x = jax.random.normal(jax.random.key(0), (1, 5, 2, 8), jnp.bfloat16)
    out = apply_rope(x, cos, sin)
    assert out.dtype == jnp.bfloat16
    reference = apply_rope(x.astype(jnp.float32), cos, sin).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(reference, np.float32))


def test_router_picks_the_fp32_winner_when_bf16_rounding_would_tie():
    """Two experts whose logits differ by 2^-10 (below bf16's 2^-7 step at 1.0): the
    router must rank them as float32 does, whatever the activation dtype."""
    moe = MoEConfig(num_experts=4, top_k=1, moe_d_ff=8)
    router = Router(8, moe, norm_eps=1e-6, rngs=nnx.Rngs(0))
    kernel = np.zeros((8, 4), np.float32)
    kernel[0, :] = [1.0, 1.0 + 2.0**-10, 0.5, 0.25]  # logits of x = e_0
    router.kernel[...] = jnp.asarray(kernel)
    x = jnp.zeros((3, 8), jnp.bfloat16).at[:, 0].set(1.0)  # [tokens, d_model], bf16 input
    logits = router(x)
    assert logits.dtype == jnp.float32
    assert jnp.asarray(logits, jnp.bfloat16)[0, 0] == jnp.asarray(logits, jnp.bfloat16)[0, 1]
    routing = route(logits, moe)
    assert routing.expert_ids[:, 0].tolist() == [1, 1, 1]
    # the same logits rounded to bf16 tie, and top_k takes the lower index: expert 0
    assert int(route(logits.astype(jnp.bfloat16), moe).expert_ids[0, 0]) == 0
