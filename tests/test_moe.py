"""Routed MoE: algorithms vs an independent dense reference, HF routing, aux loss, capacity."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from posttrain.config import ActivationConfig, ModelConfig, MoEConfig
from posttrain.layers.moe import (
    MoEBlock,
    block_layout,
    capacity_mask,
    chunk_blocks,
    default_block_size,
    load_balancing_loss,
    num_blocks_bound,
    sort_by_expert,
)
from tests import transcendentals
from tests.jaxprs import equations
from tests.strategies import moe_cases, scaled

pytestmark = pytest.mark.matmul_precision("highest")

ALGORITHMS = ("dense", "sorted", "ragged")
ACTIVATIONS = ("silu", "gelu_tanh", "clamped_swiglu")
# fp32 forward vs a float64 numpy reference: sums of O(1) terms over d_model = 5,
# moe_d_ff = 7 and top_k <= 4; observed differences <= 1e-6.
ROUTED_ATOL = 1e-5
# Router scores closer than this may rank differently in float32 and float64, so
# the reference could pick another expert; such draws are skipped (rare).
TIE_GAP = 1e-4
NORM_EPS = 1e-6
D_MODEL, D_FF, SHARED_D_FF = 5, 7, 3  # distinct, so a swapped axis is a shape error


# --- building blocks with every parameter away from its init ----------------------


def param_name(path) -> str:
    """``router.kernel`` for a state path ``(DictKey('router'), DictKey('kernel'), ...)``."""
    return ".".join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))


def params64(block: MoEBlock) -> dict[str, np.ndarray]:
    """Every parameter of ``block`` as float64, keyed ``router.kernel`` etc."""
    leaves = jax.tree_util.tree_leaves_with_path(nnx.state(block, nnx.Param))
    return {param_name(path): np.asarray(leaf, np.float64) for path, leaf in leaves}


def build(
    cfg: MoEConfig,
    activation: str,
    seed: int,
    *,
    swiglu_alpha: float = ModelConfig.swiglu_alpha,
    swiglu_limit: float = ModelConfig.swiglu_limit,
    **kw,
) -> MoEBlock:
    """An ``MoEBlock`` (d_model 5) whose parameters are drawn from a seeded RNG.

    Built abstractly (no init compile), then filled away from the init values:
    scales of ones and biases of zeros would hide a scale or bias applied
    wrongly or not at all.
    """
    abstract = nnx.eval_shape(
        lambda: MoEBlock(
            D_MODEL,
            cfg,
            ActivationConfig(activation, swiglu_alpha, swiglu_limit),
            norm_eps=NORM_EPS,
            rngs=nnx.Rngs(0),
            **kw,
        )
    )
    graphdef, state = nnx.split(abstract)
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        name = param_name(path)
        if name.endswith("scale"):  # router.scale, router.per_expert_scale
            value = rng.uniform(0.5, 1.5, leaf.shape)
        elif name.endswith("bias"):
            value = rng.normal(0.0, 0.3, leaf.shape)
        else:  # kernels [..., in, out]: unit-variance outputs
            value = rng.normal(0.0, leaf.shape[-2] ** -0.5, leaf.shape)
        return jnp.asarray(value, leaf.dtype)

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(draw, state))


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdefs, states, x, router_input):
    return [nnx.merge(g, s)(x, router_input) for g, s in zip(graphdefs, states, strict=True)]


def run_all(
    blocks: list[MoEBlock], x: np.ndarray, router_input: np.ndarray | None = None
) -> list[tuple[np.ndarray, float]]:
    """Jitted forwards of several blocks as one program (one compile; the parts
    they share, router and capacity, compile once) as numpy ``(y, aux_loss)``."""
    graphdefs, states = zip(*(nnx.split(b) for b in blocks), strict=True)
    outs = _forward(
        graphdefs,
        states,
        jnp.asarray(x),
        None if router_input is None else jnp.asarray(router_input),
    )
    for y, aux in outs:
        assert y.shape == x.shape and y.dtype == jnp.float32 and aux.dtype == jnp.float32
    return [(np.asarray(y), float(aux)) for y, aux in outs]


def run(
    block: MoEBlock, x: np.ndarray, router_input: np.ndarray | None = None
) -> tuple[np.ndarray, float]:
    """Jitted forward of one block as numpy ``(y, aux_loss)``."""
    return run_all([block], x, router_input)[0]


def inputs(shape, seed: int, scale: float = 1.0) -> np.ndarray:
    return (scale * np.random.default_rng(seed + 1).normal(size=shape)).astype(np.float32)


# --- an independent float64 reference of the HF algorithms ----------------------


def np_softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def np_sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


def np_activation(gate, up, kind, alpha=1.702, limit=7.0):
    if kind == "silu":
        return gate * np_sigmoid(gate) * up
    if kind == "gelu_tanh":
        inner = math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3)
        return 0.5 * gate * (1 + np.tanh(inner)) * up
    gate = np.minimum(gate, limit)  # clamped SwiGLU (GPT-OSS _apply_gate)
    up = np.clip(up, -limit, limit)
    return (up + 1) * gate * np_sigmoid(alpha * gate)


def reference_routing(
    logits: np.ndarray, cfg: MoEConfig, per_expert_scale: np.ndarray | None
) -> tuple[np.ndarray, float]:
    """Routing written out per token: the ``[T, E]`` combine matrix and the tie gap.

    The gap is the smallest distance between the R-th and (R+1)-th ranked value
    over all tokens (inf when R = E).
    """
    num_tokens, num_experts = logits.shape
    k = cfg.top_k
    combine, gap = np.zeros((num_tokens, num_experts)), math.inf
    cap = (
        math.inf
        if cfg.capacity_factor is None
        else math.ceil(cfg.capacity_factor * num_tokens * k / num_experts)
    )
    used = np.zeros(num_experts, int)
    score = np_softmax if cfg.scoring == "softmax" else np_sigmoid
    for t in range(num_tokens):
        # score_then_topk ranks the scores of all E; topk_then_score (GPT-OSS) the logits
        ranked = score(logits[t]) if cfg.score_order == "score_then_topk" else logits[t]
        order = np.argsort(-ranked, kind="stable")
        ids = order[:k]
        if k < num_experts:
            gap = min(gap, ranked[order[k - 1]] - ranked[order[k]])
        w = ranked[ids] if cfg.score_order == "score_then_topk" else score(logits[t, ids])
        if cfg.renormalize:
            w = w / w.sum()
        if per_expert_scale is not None:  # Gemma 4: after renormalising
            w = w * per_expert_scale[ids]
        for e, weight in zip(ids, w, strict=True):  # capacity: token order, then slot
            if used[e] < cap:
                combine[t, e] += weight
            used[e] += 1
    return combine, gap


def reference_moe(
    block: MoEBlock,
    x: np.ndarray,
    router_input: np.ndarray | None,
    activation: str,
    cfg: MoEConfig | None = None,
) -> tuple[np.ndarray, float]:
    """Every expert on every token, combined by the reference routing: ``[B, T, D]``, gap.

    Uses the parameters of ``block`` and its config unless ``cfg`` is given.
    """
    cfg, p = cfg or block.moe, params64(block)
    xt = x.reshape(-1, D_MODEL).astype(np.float64)  # [T, D]
    h = xt if router_input is None else router_input.reshape(-1, D_MODEL).astype(np.float64)
    if cfg.router_input_norm:
        h = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + NORM_EPS)
        h = h * p["router.scale"] * D_MODEL**-0.5
    logits = h @ p["router.kernel"] + p.get("router.bias", 0.0)  # [T, E]
    combine, gap = reference_routing(logits, cfg, p.get("router.per_expert_scale"))
    gate = np.einsum("td,edf->tef", xt, p["experts.gate_proj"])  # [T, E, F]
    up = np.einsum("td,edf->tef", xt, p["experts.up_proj"])  # [T, E, F]
    gate, up = gate + p.get("experts.gate_proj_bias", 0.0), up + p.get("experts.up_proj_bias", 0.0)
    hidden = np_activation(gate, up, activation)  # [T, E, F]
    out = np.einsum("tef,efd->ted", hidden, p["experts.down_proj"])  # [T, E, D]
    y = np.einsum("ted,te->td", out + p.get("experts.down_proj_bias", 0.0), combine)  # [T, D]
    if block.shared_expert is not None:
        shared = [xt @ p[f"shared_expert.{n}.kernel"] for n in ("gate_proj", "up_proj")]
        y = y + np_activation(*shared, activation) @ p["shared_expert.down_proj.kernel"]
    return y.reshape(x.shape), gap


# --- equivalences -----------------------------------------------------------------


def _check_against_dense(case) -> None:
    cfg, activation, shape, seed = case
    blocks = [build(dataclasses.replace(cfg, algorithm=a), activation, seed) for a in ALGORITHMS]
    x = inputs(shape, seed)
    router_input = inputs(shape, seed + 7) if cfg.router_input_norm else None
    expected, gap = reference_moe(blocks[0], x, router_input, activation)
    assume(gap > TIE_GAP)
    for algorithm, (y, _) in zip(ALGORITHMS, run_all(blocks, x, router_input), strict=True):
        np.testing.assert_allclose(
            y, expected, rtol=0, atol=ROUTED_ATOL, err_msg=f"algorithm={algorithm}"
        )


# ~1-2 s of tracing and compiling per example: the gate draws 4 (ci profile; 8 before), the
# slow tier's twin below 24; test_every_algorithm_has_the_dense_gradients below holds the
# three algorithms to dense on fixed cases (activations, expert bias, block sizes, bf16)
@settings(deadline=None, max_examples=scaled(4))
@given(case=moe_cases(D_MODEL, D_FF, SHARED_D_FF, ACTIVATIONS))
def test_every_algorithm_matches_dense_reference(case):
    """dense, sorted and ragged each equal every expert on every token combined by a
    reference routing (all three in one compiled program per example)."""
    _check_against_dense(case)


@pytest.mark.slow
@settings(deadline=None, max_examples=scaled(24))
@given(case=moe_cases(D_MODEL, D_FF, SHARED_D_FF, ACTIVATIONS))
def test_every_algorithm_matches_dense_reference_thorough(case):
    """The forward equivalence with more examples (slow)."""
    _check_against_dense(case)


# grads of the same block under each algorithm: sums over the same fp32 terms in another
# order (the sorted algorithm's chunks, the ragged dot); observed <= 5e-7
ROUTED_GRAD_ATOL = 1e-5
# in bfloat16 (8 significant bits) each algorithm rounds its products and sums on its own
# path: relative to the parameter's largest gradient; observed <= 3.5e-2 (ragged's
# autodiff as much as sorted's hand-written backward), a wrong term moves it by ~1
ROUTED_GRAD_RTOL_BF16 = 6e-2


@pytest.mark.parametrize(
    "activation, expert_bias, block_size, dtype",
    [
        ("silu", False, 1, "float32"),  # chunks of 4, 2 and 1 blocks, no padding
        ("clamped_swiglu", True, 2, "float32"),  # chunks of 2 and 1, padding rows
        ("silu", True, 4, "bfloat16"),  # single blocks, unused blocks at the end
    ],
)
# on a chip: both dtypes
@pytest.mark.chip_sample("clamped_swiglu-True-2-float32", "silu-True-4-bfloat16")
def test_every_algorithm_has_the_dense_gradients(activation, expert_bias, block_size, dtype):
    """The gradient of a weighted sum of the block's output with respect to every
    parameter and the input is the same under ``sorted`` and ``ragged`` as under
    ``dense``, in float32 and in bfloat16. The sorted algorithm's backward is written by
    hand (``layers.moe.grouped``): a chunk read from the wrong rows, a chunk size skipped
    or run once too often, a weight gradient of the wrong expert, padding rows that add
    to a gradient, or a dropped bias gradient shows here. 12 tokens, 4 experts, top 2,
    blocks of 1, 2 or 4 rows: several chunk sizes per expert, and unused blocks at the
    end of the static bound."""
    base = MoEConfig(
        num_experts=4, top_k=2, moe_d_ff=D_FF, expert_bias=expert_bias, block_size=block_size
    )
    kw = {"dtype": jnp.dtype(dtype), "param_dtype": jnp.dtype(dtype)}
    blocks = [
        build(dataclasses.replace(base, algorithm=a), activation, 3, **kw) for a in ALGORITHMS
    ]
    x = jnp.asarray(inputs((2, 6, D_MODEL), 5), dtype)
    weights = jnp.asarray(inputs((2, 6, D_MODEL), 9))

    def grads(block):
        graphdef, state = nnx.split(block)

        def objective(state, x):
            y, _ = nnx.merge(graphdef, state)(x, None)
            return jnp.sum(y.astype(jnp.float32) * weights)

        return jax.jit(jax.grad(objective, argnums=(0, 1)))(state, x)

    def close(got, want, message):
        want = np.asarray(want, np.float32)
        atol = ROUTED_GRAD_ATOL
        if dtype == "bfloat16":
            atol = ROUTED_GRAD_RTOL_BF16 * float(np.max(np.abs(want)))
        assert got.dtype == jnp.dtype(dtype), message
        np.testing.assert_allclose(
            np.asarray(got, np.float32), want, rtol=0, atol=atol, err_msg=message
        )

    (dense_params, dense_x), *others = [grads(b) for b in blocks]
    flat_dense = jax.tree_util.tree_leaves_with_path(dense_params)
    assert any("down_proj_bias" in param_name(p) for p, _ in flat_dense) == expert_bias
    for algorithm, (params, dx) in zip(ALGORITHMS[1:], others, strict=True):
        close(dx, dense_x, algorithm)
        flat = jax.tree_util.tree_leaves_with_path(params)
        for (path, got), (_, want) in zip(flat, flat_dense, strict=True):
            assert float(jnp.max(jnp.abs(want))) > 0, param_name(path)
            close(got, want, f"{algorithm} {param_name(path)}")


def test_fused_expert_scale_matches_unfused():
    """Folding per_expert_scale into down_proj (and its bias) gives the unfused output;
    a uniform scale c multiplies the routed output by c on both paths. Only the fused
    program multiplies a ``[E, F, D]`` kernel (the fold): a block that ignored
    ``fuse_expert_scales`` would give the same values.

    One algorithm (dense, the cheapest to compile): every algorithm reads the
    folded weights from ``Experts._params``, and the reference test above draws
    fused and unfused configs for each algorithm.
    """
    unfused_cfg = MoEConfig(
        num_experts=5,
        top_k=3,
        moe_d_ff=D_FF,
        renormalize=False,
        per_expert_scale=True,
        expert_bias=True,
        algorithm="dense",
    )
    blocks = {
        fused: build(dataclasses.replace(unfused_cfg, fuse_expert_scales=fused), "silu", seed=2)
        for fused in (False, True)
    }
    x = inputs((2, 6, D_MODEL), seed=2)
    y = dict(zip(blocks, (out[0] for out in run_all(list(blocks.values()), x)), strict=True))

    def folds(block) -> bool:  # a multiply whose result has down_proj's [E, F, D] shape
        jaxpr = jax.make_jaxpr(lambda x: block(x))(jnp.asarray(x)).jaxpr
        return any(
            eqn.primitive.name == "mul" and eqn.outvars[0].aval.shape == (5, D_FF, D_MODEL)
            for eqn in equations(jaxpr)
        )

    assert folds(blocks[True]) and not folds(blocks[False])
    np.testing.assert_allclose(y[True], y[False], rtol=0, atol=ROUTED_ATOL)
    np.testing.assert_allclose(
        y[False], reference_moe(blocks[False], x, None, "silu")[0], rtol=0, atol=ROUTED_ATOL
    )

    outputs = {}
    for c in (1.0, 2.5):  # same program, new scale values: no recompile
        for block in blocks.values():
            block.router.per_expert_scale[...] = jnp.full((5,), c)
        outputs[c] = [y for y, _ in run_all(list(blocks.values()), x)]
    for fused, y_one, y_c in zip(blocks, outputs[1.0], outputs[2.5], strict=True):
        assert np.abs(y_c - y_one).max() > 0.1, "scale != 1 must change the output"
        np.testing.assert_allclose(
            y_c, 2.5 * y_one, rtol=1e-5, atol=ROUTED_ATOL, err_msg=f"fused={fused}"
        )


# --- HF routing of specific families ---------------------------------------------


def hf_gpt_oss(x, p, top_k, alpha, limit):
    """``GptOssTopKRouter`` + ``GptOssExperts`` (hf-reference.md section 9), per token.

    Returns the output ``[T, D]`` and how many gate/up values the clamps changed.
    """
    logits = x @ p["router.kernel"] + p["router.bias"]  # 1. logits + bias
    y, clamped = np.zeros_like(x), 0
    for t in range(x.shape[0]):
        ids = np.argsort(-logits[t], kind="stable")[:top_k]  # 2. top-k on the logits
        weights = np_softmax(logits[t, ids])  # 3. softmax over the k only
        for e, w in zip(ids, weights, strict=True):
            gate = x[t] @ p["experts.gate_proj"][e] + p["experts.gate_proj_bias"][e]  # 4.
            up = x[t] @ p["experts.up_proj"][e] + p["experts.up_proj_bias"][e]
            clamped += np.sum(gate > limit) + np.sum(np.abs(up) > limit)
            gate, up = np.minimum(gate, limit), np.clip(up, -limit, limit)  # 5.
            hidden = (up + 1) * gate * np_sigmoid(alpha * gate)  # 6.
            y[t] += w * (hidden @ p["experts.down_proj"][e] + p["experts.down_proj_bias"][e])  # 7.
    return y, clamped


def test_gpt_oss_routing_matches_hf():
    """topk_then_score + router bias + biased clamped-SwiGLU experts follow GPT-OSS.

    One algorithm (the default, sorted): the algorithms' equivalence is tested above.
    """
    alpha, limit, shape = 1.702, 1.5, (2, 5, D_MODEL)
    # renormalize=False: GPT-OSS has no such step; the softmax over the k alone sums to 1
    cfg = MoEConfig(
        num_experts=5,
        top_k=2,
        moe_d_ff=D_FF,
        score_order="topk_then_score",
        renormalize=False,
        router_bias=True,
        expert_bias=True,
        block_size=2,
    )
    block = build(cfg, "clamped_swiglu", seed=3, swiglu_alpha=alpha, swiglu_limit=limit)
    x = inputs(shape, seed=3, scale=2.0)
    expected, clamped = hf_gpt_oss(
        x.reshape(-1, D_MODEL).astype(np.float64), params64(block), cfg.top_k, alpha, limit
    )
    assert clamped > 0, "the case must exercise the clamps"
    np.testing.assert_allclose(
        run(block, x)[0].reshape(expected.shape), expected, rtol=0, atol=ROUTED_ATOL
    )


def hf_gemma4(x, r, p, top_k, eps):
    """``Gemma4TextRouter`` + ``Gemma4TextExperts`` (hf-reference.md section 8), per token."""
    h = r / np.sqrt(np.mean(r * r, axis=-1, keepdims=True) + eps)  # 1. weightless RMSNorm
    h = h * p["router.scale"] * r.shape[-1] ** -0.5  # 2. * scale * d_model^-1/2
    probs = np_softmax(h @ p["router.kernel"])  # 3.-4. project, softmax over all E
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        ids = np.argsort(-probs[t], kind="stable")[:top_k]  # 5. top-k
        weights = probs[t, ids] / probs[t, ids].sum()  # 6. renormalise
        weights = weights * p["router.per_expert_scale"][ids]  # 7. then the per-expert scale
        for e, w in zip(ids, weights, strict=True):  # 8. GELU-tanh experts on x
            gate, up = x[t] @ p["experts.gate_proj"][e], x[t] @ p["experts.up_proj"][e]
            y[t] += w * (np_activation(gate, up, "gelu_tanh") @ p["experts.down_proj"][e])
    return y


def test_gemma4_routing_matches_hf():
    """Routing on the raw residual with a normalised router input; scale after renormalising.

    One algorithm (the default, sorted): the algorithms' equivalence is tested above.
    """
    shape = (1, 9, D_MODEL)
    cfg = MoEConfig(
        num_experts=6,
        top_k=2,
        moe_d_ff=D_FF,
        router_input_norm=True,
        per_expert_scale=True,
        block_size=2,
    )
    block = build(cfg, "gelu_tanh", seed=4)
    x, r = inputs(shape, seed=4), inputs(shape, seed=5, scale=3.0)
    expected = hf_gemma4(
        x[0].astype(np.float64), r[0].astype(np.float64), params64(block), cfg.top_k, NORM_EPS
    )
    # float32 softmax (exp) and GELU-tanh experts against float64: on a TPU v2-v5e tanh is
    # within 1,365.5 ulp (tests/transcendentals.py), so the bound scales with the outputs
    atol = max(ROUTED_ATOL, transcendentals.bound("exp", "tanh") * np.abs(expected).max())
    np.testing.assert_allclose(run(block, x, r)[0][0], expected, rtol=0, atol=atol)


# --- load-balancing loss -----------------------------------------------------------

LN3 = math.log(3.0)
# softmax rows: (.75, .25) for tokens 0, 1, 3 and (.25, .75) for token 2
HAND_LOGITS = np.array([[LN3, 0.0], [LN3, 0.0], [0.0, LN3], [LN3, 0.0]], np.float32)


@pytest.mark.parametrize(
    ("top_k", "expected"),
    [
        # top-1 picks experts 0, 0, 1, 0: counts (3, 1), mean probs (.625, .375):
        # 2 * (3/4 * .625 + 1/4 * .375) = 1.125
        (1, 1.125),
        # top-2 of 2: counts (4, 4): 2 * (4/4 * .625 + 4/4 * .375) = 2
        (2, 2.0),
    ],
    ids=["top1", "top2"],
)
def test_aux_loss_hand_computed(top_k, expected):
    """E * sum_e (count_e / T) * mean_t probs[t, e] on a routing computed by hand."""
    probs = np_softmax(HAND_LOGITS.astype(np.float64))
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    loss = load_balancing_loss(jnp.asarray(probs, jnp.float32), jnp.asarray(ids))
    assert float(loss) == pytest.approx(expected, abs=1e-6)


def test_block_aux_loss_counts_assignments_before_capacity_drops():
    """The block's aux loss is the hand value 1.125 even when capacity 2 drops token 3.

    Counting after the drop would give counts (2, 1): 2 * (2/4 * .625 + 1/4 * .375) = .8125.
    """
    cfg = MoEConfig(num_experts=2, top_k=1, moe_d_ff=D_FF, capacity_factor=1.0, algorithm="dense")
    block = build(cfg, "silu", seed=0)
    block.router.kernel[...] = jnp.eye(D_MODEL, 2)  # logits = the first two channels
    x = np.zeros((1, 4, D_MODEL), np.float32)
    x[0, :, :2] = HAND_LOGITS
    assert run(block, x)[1] == pytest.approx(1.125, abs=1e-6)


# --- capacity ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expert_ids", "capacity_factor", "expected"),
    [
        # E=2, 8 top-1 assignments, cf 0.5: capacity ceil(.5 * 8 / 2) = 2 per expert
        ([[0], [0], [1], [0], [1], [1], [1], [0]], 0.5, [[1], [1], [1], [0], [1], [0], [0], [0]]),
        # E=2, top-2, capacity ceil(.5 * 6 / 2) = 2: token 2 loses even its first choice
        ([[0, 1], [0, 1], [1, 0]], 0.5, [[1, 1], [1, 1], [0, 0]]),
        ([[0, 1], [0, 1], [1, 0]], None, [[1, 1], [1, 1], [1, 1]]),
    ],
    ids=["top1-capacity2", "top2-token-priority", "dropless"],
)
def test_capacity_mask_hand_computed(expert_ids, capacity_factor, expected):
    """Each expert keeps its first ceil(cf * T * R / E) assignments in token, then slot order."""
    keep = jax.jit(capacity_mask, static_argnums=(1, 2))(
        jnp.asarray(expert_ids), 2, capacity_factor
    )
    assert keep.dtype == jnp.bool_, keep.dtype  # dropless too: a mask, not float ones
    np.testing.assert_array_equal(np.asarray(keep), np.asarray(expected, bool))


# router kernel = identity on the first two channels: the larger one wins, so the
# rows go to experts 0, 0, 1, 0, 1, 1, 1, 0 and capacity 2 keeps tokens 0, 1, 2, 4
CAPACITY_LOGITS = np.array(
    [
        [2.0, -1.0],
        [1.5, 0.3],
        [-0.5, 1.0],
        [0.7, 0.2],
        [0.1, 0.9],
        [-1.0, 0.4],
        [0.3, 1.2],
        [1.1, -0.6],
    ],
    np.float32,
)
CAPACITY_KEEP = np.array([1, 1, 1, 0, 1, 0, 0, 0], bool)


def test_capacity_drops_contribute_nothing():
    """With capacity 2 per expert, dropped tokens output 0 and kept ones the dropless
    (reference) output, for every algorithm."""
    x = inputs((1, 8, D_MODEL), seed=1)
    x[0, :, :2] = CAPACITY_LOGITS
    cfg = MoEConfig(num_experts=2, top_k=1, moe_d_ff=D_FF, expert_bias=True, capacity_factor=0.5)
    blocks = [build(dataclasses.replace(cfg, algorithm=a), "silu", seed=1) for a in ALGORITHMS]
    for block in blocks:
        block.router.kernel[...] = jnp.eye(D_MODEL, 2)
    dropless = reference_moe(
        blocks[0], x, None, "silu", cfg=dataclasses.replace(cfg, capacity_factor=None)
    )[0][0]
    assert np.all(np.abs(dropless).max(axis=-1) > 0.01)
    for algorithm, (y, _) in zip(ALGORITHMS, run_all(blocks, x), strict=True):
        np.testing.assert_array_equal(y[0][~CAPACITY_KEEP], 0.0, err_msg=algorithm)
        np.testing.assert_allclose(
            y[0][CAPACITY_KEEP],
            dropless[CAPACITY_KEEP],
            rtol=0,
            atol=ROUTED_ATOL,
            err_msg=algorithm,
        )


# --- sorting by expert -------------------------------------------------------------


_sort_by_expert = jax.jit(sort_by_expert, static_argnums=1)


@settings(deadline=None, max_examples=scaled(6))
@given(num_experts=st.integers(1, 5), data=st.data())
def test_sort_by_expert_matches_a_stable_numpy_sort(num_experts, data):
    """Every field of :class:`SortedAssignments` against numpy's stable argsort, bincount
    and cumsum: ties (one expert's assignments) stay in token, then slot order."""
    top_k = data.draw(st.integers(1, 3))
    row = st.lists(st.integers(0, num_experts - 1), min_size=top_k, max_size=top_k)
    ids = np.asarray(data.draw(st.lists(row, min_size=1, max_size=6)), np.int32)  # [T, R]
    s = _sort_by_expert(jnp.asarray(ids), num_experts)
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")
    # each from its definition, not from the implementation's arithmetic
    position = np.array([list(order).index(i) for i in range(flat.size)])
    rank = np.array([np.sum(flat[:i] == flat[i]) for i in range(flat.size)])  # earlier, same
    expected = {
        "order": order,
        "sorted_ids": flat[order],
        "group_sizes": np.array([np.sum(flat == e) for e in range(num_experts)]),
        "group_starts": np.array([np.sum(flat < e) for e in range(num_experts)]),
        "rank": rank.reshape(ids.shape),
        "position": position.reshape(ids.shape),
    }
    for field, want in expected.items():
        got = getattr(s, field)
        assert got.dtype == jnp.int32, (field, got.dtype)
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=field)


# --- block layout -------------------------------------------------------------------


_block_layout = jax.jit(block_layout, static_argnums=(1, 2))


@settings(deadline=None, max_examples=scaled(6))  # ~0.6 s of XLA compile per example
@given(num_experts=st.integers(1, 6), block_size=st.integers(1, 5), data=st.data())
def test_block_layout_puts_each_assignment_in_a_block_of_its_expert(num_experts, block_size, data):
    """Each assignment gets its own row, within the static bound, in a block of its expert;
    expert e owns ``ceil(count_e / S)`` blocks, ending at ``block_ends[e]``."""
    top_k = data.draw(st.integers(1, num_experts))
    rows_of_ids = st.lists(
        st.integers(0, num_experts - 1), min_size=top_k, max_size=top_k, unique=True
    )
    ids = np.asarray(data.draw(st.lists(rows_of_ids, min_size=1, max_size=8)))  # [T, R]
    layout = _block_layout(jnp.asarray(ids), num_experts, block_size)
    rows, block_ends = np.asarray(layout.assignment_row), np.asarray(layout.block_ends)
    bound = num_blocks_bound(ids.size, num_experts, block_size)
    assert np.asarray(layout.row_token).shape == (bound * block_size,)
    assert bound <= math.ceil(ids.size / block_size) + num_experts
    assert len(set(rows.ravel().tolist())) == ids.size and rows.max() < bound * block_size
    counts = [math.ceil(np.sum(ids == e) / block_size) for e in range(num_experts)]
    np.testing.assert_array_equal(block_ends, np.cumsum(counts))
    assert block_ends.dtype == np.int32 and block_ends[-1] <= bound
    # the expert owning each row's block: how many experts' blocks end at or before it
    owner = np.searchsorted(block_ends, rows // block_size, side="right")
    np.testing.assert_array_equal(owner, ids)
    tokens = np.repeat(np.arange(ids.shape[0]), top_k).reshape(ids.shape)  # [T, R]
    np.testing.assert_array_equal(np.asarray(layout.row_token)[rows], tokens)
    assert layout.block_size == block_size


@pytest.mark.parametrize(
    ("assignments", "experts", "expected"),
    [(4096, 16, 32), (8192, 64, 16), (3000, 16, 16), (10, 3, 8), (10**7, 8, 512)],
    ids=["model-step-shape", "moe-benchmark-shape", "rounds-down", "clamp-low", "clamp-high"],
)
def test_default_block_size(assignments, experts, expected):
    """A power of two at or below A / (8E), clamped to [8, 512]."""
    assert default_block_size(assignments, experts) == expected


@pytest.mark.parametrize(
    ("assignments", "experts", "block_size", "expected"),
    [
        (4096, 16, 32, (8, 4, 2, 1)),  # mean 256 rows: chunks of 256, 128, 64, 32 rows
        (3000, 16, 16, (8, 4, 2, 1)),  # mean 187.5: up to 128 rows, not 256
        (4096, 16, 256, (1,)),  # a block already holds the mean
        (10, 3, 8, (1,)),  # fewer assignments per expert than a block
        (10**7, 8, 8, (64, 32, 16, 8, 4, 2, 1)),  # capped at 512 rows
        (10**7, 8, 1024, (1,)),  # a block over the cap is still one chunk
    ],
)
def test_chunk_blocks(assignments, experts, block_size, expected):
    """Powers of two, largest first, down to one block; the largest chunk's rows stay
    within both the mean assignments per expert and 512 rows."""
    assert chunk_blocks(assignments, experts, block_size) == expected


# --- config errors ------------------------------------------------------------------


def test_unknown_activation_is_rejected():
    """The activation config an MoEBlock takes names a bad activation in its ValueError."""
    with pytest.raises(ValueError, match="'relu'"):
        ActivationConfig("relu", 1.702, 7.0)
