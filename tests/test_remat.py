"""The ``save_attention`` rematerialisation (posttrain.layers.remat): what its backward pass
computes again, and that it changes no value or gradient."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain.layers import remat
from posttrain.models import CausalLM, get_config
from tests.jaxprs import equations, matmuls


@jax.custom_vjp
def _doubled_sine(x):
    return 2 * jnp.sin(x)


def _doubled_sine_fwd(x):
    s = jnp.sin(x)
    return 2 * s, s  # one sine makes the output and the residual, as splash's forward kernel


def _doubled_sine_bwd(s, g):
    return (2 * g * jnp.sqrt(1 - s * s),)  # cos x for |x| < pi / 2


_doubled_sine.defvjp(_doubled_sine_fwd, _doubled_sine_bwd)


def _sines(fn, *args) -> int:
    """How many times the gradient program of ``fn`` takes a sine (the op's forward)."""
    jaxpr = jax.make_jaxpr(jax.grad(fn, argnums=(0, 1)))(*args).jaxpr
    return sum(e.primitive.name == "sin" for e in equations(jaxpr))


def test_keep_residuals_keeps_values_and_gradients_and_lets_a_policy_save_them():
    """A custom-VJP op between a matmul and a tanh, its output named as the attention's
    (``remat.OUTPUT``): wrapped, its residual is kept; bare, its forward runs again."""
    x = jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4)
    w = jnp.linspace(0.3, -0.3, 20, dtype=jnp.float32).reshape(4, 5)  # |x @ w| < 1.2

    def plain(x, w):
        return jnp.tanh(remat.name(_doubled_sine(x @ w), remat.OUTPUT)).sum()

    def kept(x, w):
        out = remat.keep_residuals(_doubled_sine)(x @ w)
        return jnp.tanh(remat.name(out, remat.OUTPUT)).sum()

    np.testing.assert_array_equal(plain(x, w), kept(x, w))
    for got, want in zip(jax.grad(kept, (0, 1))(x, w), jax.grad(plain, (0, 1))(x, w), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    policy = remat.POLICIES["save_attention"]
    assert _sines(jax.checkpoint(kept, policy=policy), x, w) == 1
    assert _sines(jax.checkpoint(plain, policy=policy), x, w) == 2  # no name: made again
    assert _sines(jax.checkpoint(kept, policy=remat.POLICIES["full"]), x, w) == 2
    grads = jax.grad(jax.checkpoint(kept, policy=policy), (0, 1))(x, w)
    for got, want in zip(grads, jax.grad(plain, (0, 1))(x, w), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_keep_residuals_passes_several_arguments_and_outputs():
    def two(a, b):
        return a * b, jnp.sin(a) + b

    a, b = jnp.arange(3.0), jnp.arange(3.0) + 1

    def total(fn):
        return lambda a, b: sum(o.sum() for o in fn(a, b))

    assert [np.asarray(o).tolist() for o in remat.keep_residuals(two)(a, b)] == [
        np.asarray(o).tolist() for o in two(a, b)
    ]
    got = jax.grad(total(remat.keep_residuals(two)), (0, 1))(a, b)
    want = jax.grad(total(two), (0, 1))(a, b)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6)


def _grad_program(remat_policy: str, kernel: str = "splash_interpret"):
    """The jaxpr of qwen3-tiny's gradient (scanned layers, 2 x 128 tokens) under a policy."""
    cfg = get_config("qwen3-tiny", attention_kernel=kernel, remat=remat_policy, scan_layers=True)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0))))
    tokens = jnp.zeros((2, 128), jnp.int32)

    def loss(state):
        logits, _ = nnx.merge(graphdef, state).forward(tokens)
        return logits.astype(jnp.float32).mean()

    return cfg, jax.make_jaxpr(jax.grad(loss))(state).jaxpr


def _kernel_name(params: dict) -> str:
    """A pallas_call's kernel name: ``name`` (jax 0.10), ``name_and_src_info`` before."""
    return params["name"] if "name" in params else params["name_and_src_info"].name


def test_save_attention_runs_no_projection_and_no_splash_forward_again():
    """qwen3-tiny (d_model 72, 8 query heads and 4 kv heads of 10): under ``full`` the
    backward pass computes each layer's query, key and value projections and splash's
    forward kernel again; under ``save_attention`` none of them, and nothing else more."""
    programs = {policy: _grad_program(policy)[1] for policy in ("full", "save_attention")}
    kernels = {
        policy: collections.Counter(
            _kernel_name(e.params) for e in equations(jaxpr) if e.primitive.name == "pallas_call"
        )
        for policy, jaxpr in programs.items()
    }
    forward = "splash_mha_fwd_segmented_residuals"
    assert kernels["full"][forward] == 2 and kernels["save_attention"][forward] == 1
    assert kernels["full"] - kernels["save_attention"] == collections.Counter({forward: 1})
    dots = {p: collections.Counter(s for s, _ in matmuls(j)) for p, j in programs.items()}
    rows = 2 * 128
    projections = collections.Counter({((rows, 72), (72, 80)): 1, ((rows, 72), (72, 40)): 2})
    fewer = dots["full"] - dots["save_attention"]
    assert {k: fewer[k] for k in projections} == projections
    assert not dots["save_attention"] - dots["full"]  # nothing computed more


@pytest.mark.parametrize("kernel", ["xla", "splash_interpret"])
def test_save_attention_gives_the_gradients_of_no_remat(kernel):
    """The same parameters under ``none`` and ``save_attention``: the loss equal and each
    gradient within float32 rounding (the policy changes which values are kept, not the
    arithmetic)."""
    results = {}
    for policy in ("none", "save_attention"):
        cfg = get_config("qwen3-tiny", attention_kernel=kernel, remat=policy, scan_layers=True)
        model = CausalLM(cfg, rngs=nnx.Rngs(0))
        tokens = jnp.asarray(np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 128)))

        def loss_fn(model, tokens=tokens):
            logits, _ = model.forward(tokens)
            logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
            return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()

        loss, grads = nnx.jit(nnx.value_and_grad(loss_fn))(model)
        results[policy] = float(loss), jax.tree_util.tree_leaves_with_path(grads)
    (loss0, grads0), (loss1, grads1) = results["none"], results["save_attention"]
    assert loss1 == pytest.approx(loss0, rel=1e-6)
    for (path, want), (_, got) in zip(grads0, grads1, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, err_msg=jax.tree_util.keystr(path))
