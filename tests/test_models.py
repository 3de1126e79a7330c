"""Decoder families: forward shapes, sharded == single-device, scan == unscanned, remat."""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain import _compat, sharding
from posttrain.config import RematPolicy, choices
from posttrain.models import (
    CausalLM,
    build_model,
    flat_params,
    get_config,
    load_flat_params,
    stack_layers,
    unstack_layers,
)
from posttrain.models.decoder import REMAT_POLICIES
from posttrain.models.presets import TINY_PRESETS
from tests.jaxprs import scoped_primitives
from tests.strategies import custom_rules, factorisations, mesh_id, meshes, scaled
from tests.tracing import tracer_sharding_reads

pytestmark = pytest.mark.matmul_precision("highest")

# fp32 forward on 8 fake CPU devices vs 1: reduction order differs across shards,
# observed differences ~1e-6 on logits of magnitude ~1.
SHARDED_ATOL = 1e-5
# Remat recomputes the forward inside the backward pass, and XLA fuses the
# recomputation differently: fp32 reassociation, observed <= 2.1e-6 on grads ~0.4.
REMAT_GRAD_ATOL = 1e-5
# The single-device tests' batch; the sharded ones' splits over any 8-device mesh.
BATCH, SHARDED_BATCH, SEQ = 2, 8, 16
# Each mesh costs a sharded compile (~5 s on 2 cores): 2 per family in the `ci`
# profile (20 examples), 20 under `thorough` (200).
MESH_EXAMPLES = scaled(2)


def tokens_for(cfg, batch=BATCH, seq=SEQ, seed=0):
    return jnp.asarray(
        np.random.RandomState(seed).randint(0, cfg.vocab_size, (batch, seq)), dtype=jnp.int32
    )


def model_with(cfg, flat: dict[str, np.ndarray]) -> CausalLM:
    """A single-device ``CausalLM`` of ``cfg`` holding ``flat`` (no initialiser is compiled)."""
    return load_flat_params(nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0))), flat)


@functools.cache
def preset_model(name: str) -> CausalLM:
    """The preset's single-device model (seed 0); the tests only read it."""
    return build_model(get_config(name))


def _call_and_aux(model: CausalLM, tokens):
    logits, cache = model(tokens, None, None, None)
    return logits, cache, model.forward(tokens)[1]["moe_aux_loss"]


@functools.cache
def reference_call(name: str) -> tuple[np.ndarray, object, float]:
    """Single-device ``(logits, cache, moe_aux_loss)`` on ``[BATCH, SEQ]`` tokens: the first
    two through ``__call__`` with Tunix's positional convention ``(tokens, positions,
    cache, attention_mask)``, the aux loss through ``forward``; one program (on a chip
    each distinct program is seconds of compile)."""
    model = preset_model(name)
    logits, cache, aux = nnx.jit(_call_and_aux)(model, tokens_for(model.config))
    return np.asarray(logits), cache, float(aux)


@functools.cache
def reference_logits(name: str) -> np.ndarray:
    """Single-device logits on ``[SHARDED_BATCH, SEQ]`` tokens (the sharded tests')."""
    cfg = get_config(name)
    forward = nnx.jit(lambda m, t: m.forward(t)[0])
    return np.asarray(forward(preset_model(name), tokens_for(cfg, batch=SHARDED_BATCH)))


def sharded_logits(cfg, mesh_shape) -> np.ndarray:
    mesh = sharding.make_mesh(mesh_shape)
    model = build_model(cfg, mesh)
    with sharding.use_mesh(mesh):
        tokens = jax.device_put(
            tokens_for(cfg, batch=SHARDED_BATCH),
            jax.sharding.NamedSharding(
                mesh,
                sharding.logical_to_spec(
                    ("activation_batch", "activation_length"),
                    (SHARDED_BATCH, SEQ),
                    dict(mesh.shape),
                ),
            ),
        )
        logits, _ = nnx.jit(lambda m, t: m.forward(t))(model, tokens)
    return np.asarray(logits)


@pytest.mark.parametrize("name", TINY_PRESETS)
def test_forward_shapes_and_tunix_convention(name):
    """Each tiny preset maps [B, T] tokens to finite [B, T, V] float32 logits via __call__."""
    cfg = get_config(name)
    logits, cache, _ = reference_call(name)
    assert logits.shape == (BATCH, SEQ, cfg.vocab_size) and logits.dtype == np.float32
    assert cache is None
    assert np.isfinite(logits).all()


# The dense presets' sharded forwards are the slow tier's: each of their parameter kinds is
# sharded in the gate by a routed preset's (gemma4: tied embedding, dense MLP, qk-norm;
# mixtral: llama3's attention, an lm_head of its own).
SHARDED_IN_SLOW_TIER = ("llama3-tiny", "qwen3-tiny")


@pytest.mark.devices(8)
@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.slow) if n in SHARDED_IN_SLOW_TIER else n
        for n in TINY_PRESETS
    ],
)
@settings(max_examples=MESH_EXAMPLES)
@given(data=st.data())
def test_sharded_forward_equals_single_device(name, data):
    """On any 8-device mesh the config allows, logits equal the single-device logits."""
    cfg = get_config(name)
    mesh_shape = data.draw(meshes(cfg), label="mesh")
    got = sharded_logits(cfg, mesh_shape)
    np.testing.assert_allclose(
        got, reference_logits(name), atol=SHARDED_ATOL, err_msg=f"{name} on {mesh_id(mesh_shape)}"
    )


@pytest.mark.devices(8)
@pytest.mark.parametrize(
    ("name", "mesh_shape", "message"),
    [
        ("qwen3-tiny", {"tensor": 8}, "num_kv_heads=4 is not divisible by mesh axes tensor=8"),
        ("llama3-tiny", {"data": 3}, "has 3 devices but 8 devices are available"),
    ],
    ids=["kv-heads-tensor8", "wrong-device-count"],
)
def test_unusable_mesh_raises_clear_error(name, mesh_shape, message):
    """A mesh the config cannot use fails with a one-line ValueError before JAX runs."""
    with pytest.raises(ValueError, match=message):
        build_model(get_config(name), sharding.make_mesh(mesh_shape))


@pytest.mark.devices(8)
def test_experts_not_divisible_by_expert_axis():
    """num_experts=6 on expert=4 is rejected naming both numbers."""
    base = get_config("mixtral-tiny")
    cfg = base.replace(moe=dataclasses.replace(base.moe, num_experts=6))
    with pytest.raises(ValueError, match="num_experts=6 is not divisible by mesh axes expert=4"):
        build_model(cfg, sharding.make_mesh({"expert": 4, "data": 2}))


@pytest.mark.parametrize("name", TINY_PRESETS)
# on a chip: a layer-type pattern and the routed MoE in the scanned body
@pytest.mark.chip_sample("gemma4-tiny", "qwen3_moe-tiny")
def test_scan_equals_unscanned(name):
    """scan_layers=True with the same (stacked) weights gives the unscanned logits and
    load-balancing loss (the unscanned ones: the forward test's program)."""
    cfg = get_config(name)
    flat = flat_params(preset_model(name))
    scanned = model_with(cfg.replace(scan_layers=True), stack_layers(flat, cfg))
    assert unstack_layers(flat_params(scanned), cfg).keys() == flat.keys()
    got, got_aux = nnx.jit(lambda m, t: m.forward(t))(scanned, tokens_for(cfg))
    want, _, want_aux = reference_call(name)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)
    np.testing.assert_allclose(float(got_aux["moe_aux_loss"]), want_aux, rtol=1e-5)


def loss_and_grads(model: CausalLM, tokens):
    def loss_fn(model):
        logits, aux = model.forward(tokens)
        logp = jax.nn.log_softmax(logits[:, :-1])
        nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()
        return nll + 0.01 * aux["moe_aux_loss"]

    loss, grads = nnx.jit(nnx.value_and_grad(loss_fn))(model)
    return float(loss), {k: np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(grads)}


@pytest.mark.parametrize(
    ("name", "scan"),
    [
        ("qwen3_moe-tiny", False),
        # scanned remat: the slow tier's (the gate's budget; the MoE case stays here)
        pytest.param("qwen3-tiny", True, marks=pytest.mark.slow),
        pytest.param("gemma4-tiny", True, marks=pytest.mark.slow),
    ],
    ids=["qwen3_moe-unscanned", "qwen3-scanned", "gemma4-scanned"],
)
def test_remat_policies_same_loss_and_grads(name, scan):
    """Every remat policy (none/full/save_dots) gives the same loss and gradients."""
    cfg = get_config(name, scan_layers=scan)
    if cfg.moe is not None and not scan:  # the dense expert path; sorted (default) when scanned
        cfg = cfg.replace(moe=dataclasses.replace(cfg.moe, algorithm="dense"))
    tokens = tokens_for(cfg)
    # the preset's own parameters (the expert algorithm changes none): its compiled
    # initialiser is the forward tests', not one more
    flat = flat_params(build_model(get_config(name, scan_layers=scan)))
    assert set(REMAT_POLICIES) == set(choices(RematPolicy))  # every policy tested and built
    results = {
        policy: loss_and_grads(model_with(cfg.replace(remat=policy), flat), tokens)
        for policy in choices(RematPolicy)
    }
    loss0, grads0 = results["none"]
    for policy in ("full", "save_dots"):
        loss, grads = results[policy]
        assert loss == pytest.approx(loss0, rel=1e-6)
        assert grads.keys() == grads0.keys()
        for key in grads0:
            np.testing.assert_allclose(
                grads[key], grads0[key], atol=REMAT_GRAD_ATOL, err_msg=f"{policy} {key}"
            )


# --- model construction under tracing ------------------------------------------------------


def test_next_rng_key_is_the_streams_own_key_eager_and_traced():
    """``_compat.next_rng_key(rngs.params)`` returns the key ``rngs.params()`` would and
    advances the same counter, outside and inside a trace."""

    def draw(take, seed):
        rngs = nnx.Rngs(seed)
        keys = [jax.random.key_data(take(rngs.params)) for _ in range(3)]
        return jnp.stack(keys), jnp.asarray(_compat.variable_value(rngs.params.count))

    for seed in (0, 7):
        for run in (lambda f: f(), lambda f: jax.jit(f)()):
            ours = run(functools.partial(draw, _compat.next_rng_key, seed))
            theirs = run(functools.partial(draw, lambda stream: stream(), seed))
            for a, b in zip(ours, theirs, strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            assert int(ours[1]) == 3


@pytest.mark.parametrize("name", ["qwen3_moe-tiny", "gemma4-tiny"])
def test_model_init_never_asks_a_tracer_for_its_sharding(name, monkeypatch):
    """Under tracing, ``tracer.sharding`` raises an AttributeError whose message walks every
    equation traced so far; read once per parameter (``rngs.params()`` on flax >= 0.12.1)
    it made model construction quadratic (llama3-8b ``eval_shape``: 3.5 s, 0.5 s without;
    ``benchmarks/model_init.py``). Building a model must not read it."""
    with tracer_sharding_reads(monkeypatch) as reads:
        abstract = nnx.eval_shape(lambda: CausalLM(get_config(name), rngs=nnx.Rngs(0)))
    assert len(jax.tree.leaves(nnx.state(abstract, nnx.Param))) > 10
    assert reads == []


def test_parameters_name_only_known_logical_axes():
    """A misspelt logical axis would leave its parameter replicated on every mesh."""
    with pytest.raises(ValueError, match="param logical axis 'EMBED' is not one of"):
        sharding.param(nnx.Rngs(0), nnx.initializers.zeros, (4, 2), ("EMBED", "exp"))
    assert sharding.param(nnx.Rngs(0), nnx.initializers.zeros, (4,), (None,)).shape == (4,)


@pytest.mark.devices(8)
def test_activations_name_only_known_logical_axes():
    """A misspelt activation axis would leave the activation unconstrained on every mesh:
    ``constrain`` refuses it, outside a mesh as on one, and the default rules give every
    name it accepts (and the parameters' names) a rule, and no other name."""
    x, mesh = jnp.zeros((8, 4, 2)), sharding.make_mesh({"data": 8})
    for context in (contextlib.nullcontext(), sharding.use_mesh(mesh)):
        with (
            context,
            pytest.raises(
                ValueError, match="activation logical axis 'activation_HEADS' is not one of"
            ),
        ):
            sharding.constrain(x, ("activation_batch", "activation_HEADS", None))
    with sharding.use_mesh(mesh):
        got = sharding.constrain(x, ("activation_batch", "activation_heads", None))
    want = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    assert got.sharding.is_equivalent_to(want, x.ndim)
    ruled = [name for name, _ in sharding.DEFAULT_RULES]
    assert sorted(ruled) == sorted(sharding.ACTIVATION_AXIS_NAMES + sharding.PARAM_AXES)


@pytest.mark.devices(8)
def test_attention_shards_its_heads_over_tensor_and_d_model_over_fsdp():
    """Tensor parallelism splits attention by heads (Megatron-LM, Shoeybi et al. 2019)
    and fsdp splits d_model: on an fsdp=4 x tensor=2 mesh each attention parameter's
    spec says so. A projection built with no heads axis would stay whole on every
    device, and every forward would still agree."""
    from posttrain.config import AttentionConfig
    from posttrain.layers.attention import Attention
    from posttrain.tree import path_name

    cfg = AttentionConfig(
        num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, bias=True, sinks=True
    )
    abstract = nnx.eval_shape(lambda: Attention(16, cfg, norm_eps=1e-6, rngs=nnx.Rngs(0)))
    mesh = sharding.make_mesh({"fsdp": 4, "tensor": 2})
    shardings = sharding.state_shardings(nnx.state(abstract, nnx.Param), mesh)
    specs = {
        path_name(path): tuple(_compat.variable_value(v).spec)
        for path, v in nnx.to_flat_state(shardings)
    }
    heads_in, heads_out = ("fsdp", "tensor"), ("tensor",)  # trailing replicated dims dropped
    assert specs == {
        "q_proj.kernel": heads_in,
        "q_proj.bias": heads_out,
        "k_proj.kernel": heads_in,
        "k_proj.bias": heads_out,
        "v_proj.kernel": heads_in,
        "v_proj.bias": heads_out,
        "o_proj.kernel": ("tensor", None, "fsdp"),
        "o_proj.bias": ("fsdp",),
        "q_norm.scale": (),
        "k_norm.scale": (),
        "sinks": ("tensor",),
    }


@functools.cache
def abstract_state(name: str) -> nnx.State:
    cfg = get_config(name)
    return nnx.state(nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0))))


@pytest.mark.devices(8)
@settings(max_examples=scaled(200), deadline=None)  # ~5 ms each
@given(
    name=st.sampled_from(TINY_PRESETS),
    rules=custom_rules(),
    mesh_shape=st.sampled_from(factorisations(8, ("fsdp", "fsdp_transpose", "expert", "tensor"))),
)
def test_a_mesh_check_mesh_accepts_shards_every_parameter(name, rules, mesh_shape):
    """check_mesh is sound under any rules: when it accepts a mesh, every parameter
    of the model shards on it (each dimension through ``logical_to_spec``)."""
    try:
        get_config(name).check_mesh(mesh_shape, rules)
    except ValueError:
        return
    sharding.state_shardings(abstract_state(name), sharding.make_mesh(mesh_shape), rules)


def test_profiles_name_the_attention_and_moe_stages():
    """Each attention and MoE stage is a named scope: the lowered forward names them all."""
    cfg = get_config("qwen3_moe-tiny")
    model = nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
    text = (
        jax.jit(lambda s, t: nnx.merge(graphdef, s)(t, None, None, None)[0])
        .lower(state, tokens)
        .as_text(debug_info=True)
    )
    for scope in (
        "attention_qkv",
        "attention_scores",
        "attention_softmax",
        "attention_out",
        "moe_router",
        "moe_dispatch",
        "moe_experts",
        "moe_combine",
    ):
        assert scope in text, scope


# Each documented stage scope (Attention.__call__, MoEBlock: for profiles and HLO dumps)
# and a primitive its stage's work must hold.
STAGE_SCOPES = {
    "attention_qkv": "dot_general",  # the q, k, v projections
    "attention_scores": "dot_general",  # q . k
    "attention_softmax": "exp",
    "attention_out": "dot_general",  # probs . v and o_proj
    "moe_router": "top_k",
    "moe_dispatch": "select_n",  # capacity drops become zero weights
    "moe_experts": "dot_general",
    "moe_combine": "add",  # routed + shared expert
}


def test_each_documented_stage_scope_holds_its_work():
    """The named scopes that the attention and MoE docstrings promise for profiles and HLO
    dumps are in the forward's program, each around its stage's work (a renamed scope
    breaks every profile query that names it, silently)."""
    from tests.path_params import model_with_path_values

    cfg = get_config("qwen3_moe-tiny")
    moe = dataclasses.replace(cfg.moe, shared_expert_d_ff=8, capacity_factor=1.5)
    cfg = cfg.replace(moe=moe)  # every stage present: capacity drops, a shared expert
    model = model_with_path_values(cfg)
    tokens = jnp.ones((1, 8), jnp.int32)
    scopes = scoped_primitives(jax.make_jaxpr(lambda t: model.forward(t))(tokens).jaxpr)
    missing = {s: p for s, p in STAGE_SCOPES.items() if p not in scopes.get(s, set())}
    assert not missing, f"stage scopes without their work: {missing}"
