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

from posttrain.config import ActivationConfig, MoEConfig
from posttrain.layers.moe.router import Router, route
from posttrain.models import get_config
from posttrain.models.presets import TINY_PRESETS
from posttrain.training import loss
from tests.jaxprs import matmuls, primitive_dtypes, reading, sub_jaxprs
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


#: the gate's families: a MoE (the router's and the experts' dtypes) and gemma4 (the most
#: bf16 islands: softcaps, scaled embeddings, k=v); every family in the slow tier
GATE_BF16 = ("qwen3_moe-tiny", "gemma4-tiny")


@pytest.mark.parametrize(
    "preset",
    [p if p in GATE_BF16 else pytest.param(p, marks=pytest.mark.slow) for p in TINY_PRESETS],
)
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
    # the statistics in NumPy (on a chip each eager op is a compile of its own)
    got_logits, want_logits = np.asarray(got_logits), np.asarray(want_logits)
    delta = float(np.mean(np.abs(got_logits - want_logits)) / np.std(want_logits))
    top1 = float(np.mean(np.argmax(got_logits, -1) == np.argmax(want_logits, -1)))
    assert delta <= MAX_MEAN_DELTA_PER_STD, f"{preset}: mean |delta logit| / std {delta:.3f}"
    assert abs(float(got_nll) - float(want_nll)) <= MAX_NLL_DELTA, (got_nll, want_nll)
    assert top1 >= MIN_TOP1_AGREEMENT, f"{preset}: top-1 agreement {top1:.3f}"
    assert delta > 0  # the bf16 model really computed in bf16


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

    @jax.jit  # one program (on a chip each eager op is a compile of its own)
    def rotated_and_reference():
        positions = jnp.arange(5, dtype=jnp.int32)[None]
        cos, sin = rope_tables(positions, rope, 8)
        x = jax.random.normal(jax.random.key(0), (1, 5, 2, 8), jnp.bfloat16)
        return apply_rope(x, cos, sin), apply_rope(x.astype(jnp.float32), cos, sin)

    out, reference = rotated_and_reference()
    assert out.dtype == jnp.bfloat16
    reference = reference.astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(reference, np.float32))


def test_router_picks_the_fp32_winner_when_bf16_rounding_would_tie():
    """Two experts whose logits differ by 2^-10 (below bf16's 2^-7 step at 1.0): the
    router must rank them as float32 does, whatever the activation dtype."""
    moe = MoEConfig(num_experts=4, top_k=1, moe_d_ff=8)
    router = nnx.eval_shape(lambda: Router(8, moe, norm_eps=1e-6, rngs=nnx.Rngs(0)))
    assert [path for path, _ in nnx.to_flat_state(nnx.state(router, nnx.Param))] == [("kernel",)]
    kernel = np.zeros((8, 4), np.float32)
    kernel[0, :] = [1.0, 1.0 + 2.0**-10, 0.5, 0.25]  # logits of x = e_0
    router.kernel = nnx.Param(jnp.asarray(kernel))  # its only parameter
    x = np.zeros((3, 8), jnp.bfloat16)  # [tokens, d_model], bf16 input
    x[:, 0] = 1.0

    @nnx.jit  # one program (on a chip each eager op is a compile of its own)
    def logits_and_routes(router, x):
        logits = router(x)
        return logits, route(logits, moe).expert_ids, route(logits.astype(jnp.bfloat16), moe)

    logits, expert_ids, bf16_routing = logits_and_routes(router, x)
    assert logits.dtype == jnp.float32
    rounded = np.asarray(logits).astype(jnp.bfloat16)
    assert rounded[0, 0] == rounded[0, 1]
    assert expert_ids[:, 0].tolist() == [1, 1, 1]
    # the same logits rounded to bf16 tie, and top_k takes the lower index: expert 0
    assert int(bf16_routing.expert_ids[0, 0]) == 0


# Experts fixture dims, moe_d_ff distinct from every other size so a matmul that reads
# an expert weight or hidden state is the one with F in an operand's shape.
EXPERT_TOKENS, EXPERT_D_MODEL, EXPERT_D_FF = 32, 8, 12
# bf16 matmuls over d_model 8 / moe_d_ff 12 (scales up to 2) against the float32 twin:
# max |delta| / std measured 0.049 (dense) and 0.038 (sorted, ragged); ~2x headroom.
MAX_EXPERT_DELTA_PER_STD = 0.1
SILU = ActivationConfig("silu", 1.702, 7.0)  # the alpha and limit are unused by silu


def param_dtypes(module) -> set[str]:
    return {str(v.dtype) for v in jax.tree.leaves(nnx.state(module, nnx.Param))}


# What each algorithm's program must hold (the config picks it, never the platform): its
# values all agree, so only the program shows which one ran.
ALGORITHM_PRIMITIVES = {
    "dense": ({"dot_general"}, {"scan", "while", "ragged_dot_general"}),
    # the grouped matmul's chunk loops (layers.moe.grouped), not a scan of conds
    "sorted": ({"while"}, {"cond", "ragged_dot_general"}),
    "ragged": ({"ragged_dot_general"}, {"scan", "while"}),
}


@pytest.mark.parametrize(
    ("algorithm", "expert_bias", "param_dtype"),
    [
        # dense without biases: its float32 result comes from the down einsum alone (a
        # float32 bias would promote a bfloat16 sum and hide it)
        ("dense", False, "bfloat16"),
        ("sorted", True, "float32"),  # float32 weights, bfloat16 compute
        ("ragged", True, "bfloat16"),
    ],
    ids=["dense", "sorted-bias-fp32-params", "ragged-bias"],
)
def test_experts_multiply_in_bf16_and_return_the_weighted_sum_in_float32(
    algorithm, expert_bias, param_dtype
):
    """``Experts`` with dtype bfloat16 on a float32 input, with the fused per-expert scale:
    every parameter takes ``param_dtype``, every matmul of an expert (gate, up, down; in
    the sorted algorithm's chunk loops too) reads bfloat16 operands, the program is the
    configured algorithm's, the weighted sum over experts is float32 (the documented
    result), and it agrees with the float32 twin (the same bf16-representable weights,
    biases and scale) within bf16 rounding."""
    from posttrain.layers.moe.experts import Experts

    moe = MoEConfig(
        num_experts=4, top_k=2, moe_d_ff=EXPERT_D_FF, expert_bias=expert_bias, algorithm=algorithm
    )

    def build(dtype, param_dtype):
        return Experts(
            EXPERT_D_MODEL, moe, SILU, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=param_dtype
        )

    # built abstractly and filled below (on a chip each eager op is a compile of its own)
    low = nnx.eval_shape(lambda: build(jnp.bfloat16, param_dtype))
    high = nnx.eval_shape(lambda: build(jnp.float32, jnp.float32))
    assert param_dtypes(low) == {param_dtype}
    abstract = nnx.state(low, nnx.Param)

    @jax.jit  # one program for every input
    def inputs():
        keys = iter(jax.random.split(jax.random.key(3), 8))
        values = jax.tree.map(  # biases away from their zero init, bf16-representable
            lambda v: jax.random.normal(next(keys), v.shape).astype(jnp.bfloat16).astype(v.dtype),
            abstract,
        )
        x = jax.random.normal(jax.random.key(4), (EXPERT_TOKENS, EXPERT_D_MODEL), jnp.float32)
        scores = jax.random.normal(jax.random.key(5), (EXPERT_TOKENS, moe.num_experts))
        weights, expert_ids = jax.lax.top_k(jax.nn.softmax(scores), moe.top_k)  # [T, R]
        return values, jax.tree.map(lambda v: v.astype(jnp.float32), values), x, weights, expert_ids

    values, values32, x, weights, expert_ids = inputs()
    nnx.update(low, values)
    nnx.update(high, values32)
    scale = jnp.asarray([0.5, 1.0, 1.5, 2.0], jnp.float32)  # [E], the router's float32 one

    def run(experts):
        return jax.jit(lambda x: experts(x, weights, expert_ids, down_scale=scale))

    jaxpr = jax.make_jaxpr(run(low))(x).jaxpr
    expert = reading(jaxpr, EXPERT_D_FF)  # the matmuls of an expert weight or hidden state
    assert len(expert) >= 3, expert  # gate, up and down were found
    assert all(set(dtypes) == {"bfloat16"} for dtypes in expert), expert
    present, absent = ALGORITHM_PRIMITIVES[algorithm]
    primitives = {p for p, _ in primitive_dtypes(jaxpr)}
    assert present <= primitives and not absent & primitives, (algorithm, sorted(primitives))
    got, want = run(low)(x), run(high)(x)
    assert got.dtype == jnp.float32
    got, want = np.asarray(got), np.asarray(want)
    delta = float(np.max(np.abs(got - want)) / np.std(want))
    assert 0 < delta <= MAX_EXPERT_DELTA_PER_STD, f"{algorithm}: max |delta| / std {delta:.4f}"


def test_the_moe_block_hands_its_dtypes_to_the_router_and_both_experts():
    """``MoEBlock`` with dtype and param_dtype bfloat16 and a shared expert, on a bfloat16
    input: every parameter is bfloat16, the router scores in float32 (its island), every
    matmul of the routed and of the shared experts reads bfloat16, the output takes the
    input's dtype and the load-balancing loss is float32. A block that does not pass
    ``dtype`` on computes its experts in float32 without a word (the values barely move)."""
    from posttrain.layers.moe.block import MoEBlock

    d_model, num_experts, shared_d_ff = EXPERT_D_MODEL, 4, 6
    moe = MoEConfig(
        num_experts=num_experts, top_k=2, moe_d_ff=EXPERT_D_FF, shared_expert_d_ff=shared_d_ff
    )
    # built and drawn in one program (on a chip each eager op is a compile of its own)
    block, x = nnx.jit(
        lambda: (
            MoEBlock(
                d_model,
                moe,
                SILU,
                norm_eps=1e-6,
                rngs=nnx.Rngs(0),
                dtype=jnp.bfloat16,
                param_dtype=jnp.bfloat16,
            ),
            jax.random.normal(jax.random.key(6), (2, 16, d_model), jnp.bfloat16),
        )
    )()
    assert param_dtypes(block) == {"bfloat16"}
    jaxpr = jax.make_jaxpr(lambda x: block(x))(x).jaxpr
    routed, shared = reading(jaxpr, EXPERT_D_FF), reading(jaxpr, shared_d_ff)
    assert len(routed) >= 3 and len(shared) >= 3, (routed, shared)
    assert all(set(dtypes) == {"bfloat16"} for dtypes in routed + shared), (routed, shared)
    router = [d for shapes, d in matmuls(jaxpr) if (d_model, num_experts) in shapes]
    assert router and all(set(dtypes) == {"float32"} for dtypes in router), router
    y, aux_loss = jax.jit(lambda x: block(x))(x)
    assert (y.dtype, aux_loss.dtype) == (jnp.bfloat16, jnp.float32)


@pytest.mark.parametrize("norms", [True, False], ids=["qk-v-norms", "no-norms"])
def test_attention_hands_its_dtypes_to_every_projection_and_keeps_its_float32_islands(norms):
    """``Attention`` with dtype and param_dtype bfloat16, biases and sinks, with qk-norm and
    v-norm (Gemma 4) and without (GPT-OSS: the norms' casts would hide a projection's
    float32 output): every parameter is bfloat16; the q, k, v and o projections multiply in
    bfloat16; the scores and the weighted sum read float32 (the softmax's island) made
    from bfloat16 k and v, as HF's bf16 attention rounds them (v-norm's output included,
    ``type_as``); the output is bfloat16. A projection without its ``dtype`` computes in
    float32 without a word: the values move too little for the bf16-vs-fp32 bounds.
    Traced on an fsdp=4 x tensor=2 mesh (fitted to fewer devices: the constraints are in
    the trace whatever their sizes): q, k and the weighted sum are constrained (and
    resharded) in bfloat16; a float32 weighted sum left for ``o_proj`` to cast would move
    twice the bytes and give the same values."""
    from posttrain import sharding
    from posttrain.config import AttentionConfig
    from posttrain.layers.attention import Attention, attention_mask
    from posttrain.layers.rope import rope_tables
    from tests.meshes import fitted

    d_model, n, k, h, batch, seq = 20, 6, 2, 8, 4, 5  # all distinct: operands by shape
    cfg = AttentionConfig(
        num_heads=n, num_kv_heads=k, head_dim=h, qk_norm=norms, v_norm=norms, bias=True, sinks=True
    )

    @nnx.jit  # built and drawn in one program (on a chip each eager op is a compile)
    def build_and_inputs():
        attention = Attention(
            d_model,
            cfg,
            norm_eps=1e-6,
            rngs=nnx.Rngs(0),
            dtype=jnp.bfloat16,
            param_dtype=jnp.bfloat16,
        )
        x = jax.random.normal(jax.random.key(7), (batch, seq, d_model), jnp.bfloat16)
        positions = jnp.broadcast_to(jnp.arange(seq), (batch, seq))
        cos, sin = rope_tables(positions, cfg.rope, h)
        return attention, x, cos, sin, attention_mask(batch, seq, None, None)

    attention, x, cos, sin, mask = build_and_inputs()
    assert param_dtypes(attention) == {"bfloat16"}
    with sharding.use_mesh(sharding.make_mesh(fitted({"fsdp": 4, "tensor": 2}))):
        jaxpr = jax.make_jaxpr(lambda x: attention(x, cos, sin, mask))(x).jaxpr
    constrained = [
        (eqn.invars[0].aval.shape, str(eqn.invars[0].aval.dtype))
        for eqn in jaxpr.eqns
        if eqn.primitive.name == "sharding_constraint"
    ]
    heads, kv_heads = ((batch, seq, n, h), "bfloat16"), ((batch, seq, k, h), "bfloat16")
    assert sorted(constrained) == sorted([heads, kv_heads, heads]), constrained  # q, k, out

    def matmul_dtypes(shape):
        return [dtypes for shapes, dtypes in matmuls(jaxpr) if shape in shapes]

    # q; k and v (their kernels as [D, heads * H] matrices: HeadProjection); o
    for kernel in ((d_model, n * h), (d_model, k * h), (n, h, d_model)):
        found = matmul_dtypes(kernel)
        assert found and all(set(d) == {"bfloat16"} for d in found), (kernel, found)
    assert len(matmul_dtypes((d_model, k * h))) == 2  # k_proj and v_proj
    kv_shape = (batch, seq, k, h)
    islands = matmul_dtypes(kv_shape)  # scores (q.k) and weighted sum (p.v)
    assert len(islands) == 2 and all(set(d) == {"float32"} for d in islands), islands
    # the k and v a matmul reads (jnp.einsum is a jit of its own: the operands it is
    # handed) are cast to float32 from bfloat16, not computed in float32 all along
    producers = {var: eqn for eqn in jaxpr.eqns for var in eqn.outvars}
    sources = [
        producers[var]
        for eqn in jaxpr.eqns
        if eqn.primitive.name == "dot_general"
        or any(matmuls(sub) for sub in sub_jaxprs(eqn.params))
        for var in eqn.invars
        if getattr(var, "aval", None) is not None and var.aval.shape == kv_shape
    ]
    assert len(sources) == 2, sources
    for source in sources:
        assert source.primitive.name == "convert_element_type", source
        assert str(source.invars[0].aval.dtype) == "bfloat16", source
    y = jax.jit(lambda x: attention(x, cos, sin, mask))(x)
    assert y.dtype == jnp.bfloat16 and y.shape == (batch, seq, d_model)
