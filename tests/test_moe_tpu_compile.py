"""The ``ragged`` MoE algorithm compiles for a TPU: deviceless compiles for a v5e through
libtpu (the tpu extra), so this CPU machine catches what first failed on a lent v5e.

Two XLA:TPU failures of ``jax.lax.ragged_dot`` (libtpu 0.0.42), each failing the TPU tier's
``tests/test_moe.py`` on the chip and each reproduced here without one:

* one expert: the group sizes fold to a constant, and the compiler fails a RET_CHECK in
  ``mask_aggregator.cc``;
* bfloat16 experts under ``jax.default_matmul_precision("highest")`` (how the float32
  tests pin their precision): Mosaic's kernel refuses a float32 contraction of bfloat16
  vectors ("Bad lhs type"), forward and backward.

:func:`posttrain.layers.moe.experts.ragged_dot` steers around both; the values are
checked against ``jax.lax.ragged_dot`` on the CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import SingleDeviceSharding

from posttrain import _compat
from posttrain.config import ActivationConfig, ModelConfig, MoEConfig
from posttrain.layers.moe import MoEBlock
from posttrain.layers.moe.experts import ragged_dot
from posttrain.plan import topology

pytestmark = pytest.mark.host  # compiles for a described TPU, runs nothing on a device

D_MODEL, MOE_D_FF = 128, 256  # lane-sized, as a real model's: the Mosaic kernel's path


def _v5e_compile(fn, *args) -> None:
    """Lowers and compiles ``fn`` for one v5e chip from abstract arguments."""
    sharding = SingleDeviceSharding(topology.devices(topology.get("v5e-1"))[0])
    specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), args)
    with _compat.no_persistent_compilation_cache():  # a deviceless compiler cannot load one
        jax.jit(fn).lower(*specs).compile()


def _block(num_experts: int, top_k: int, dtype) -> MoEBlock:
    moe = MoEConfig(num_experts=num_experts, top_k=top_k, moe_d_ff=MOE_D_FF, algorithm="ragged")
    return nnx.eval_shape(
        lambda: MoEBlock(
            D_MODEL,
            moe,
            ActivationConfig("silu", ModelConfig.swiglu_alpha, ModelConfig.swiglu_limit),
            norm_eps=1e-6,
            rngs=nnx.Rngs(0),
            dtype=dtype,
            param_dtype=dtype,
        )
    )


def _loss_and_grads(graphdef):
    def loss(state, x):
        y, aux = nnx.merge(graphdef, state)(x, None)
        return y.astype(jnp.float32).sum() + aux

    return jax.value_and_grad(loss, argnums=(0, 1))


@pytest.mark.parametrize(
    "num_experts, top_k, dtype, precision",
    [
        (1, 1, jnp.float32, "default"),  # one group: the constant group sizes
        (4, 2, jnp.bfloat16, "highest"),  # bfloat16 under a pinned highest precision
        (4, 2, jnp.float32, "highest"),  # float32 keeps the pinned precision
    ],
    ids=["one-expert", "bfloat16-highest", "float32-highest"],
)
def test_the_ragged_block_and_its_gradients_compile_for_a_v5e(num_experts, top_k, dtype, precision):
    graphdef, state = nnx.split(_block(num_experts, top_k, dtype))
    x = jnp.zeros((2, 8, D_MODEL), dtype)
    with jax.default_matmul_precision(precision):
        _v5e_compile(_loss_and_grads(graphdef), state, x)


@pytest.mark.parametrize(
    "groups", [[5], [2, 0, 3], [0, 5]], ids=["one", "empty-middle", "empty-first"]
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_ragged_dot_equals_jax_s_on_the_cpu(groups, dtype):
    """One group goes through a plain dot: the same numbers as the ragged kernel's."""
    rng = np.random.default_rng(0)
    lhs = jnp.asarray(rng.normal(size=(sum(groups), 6)), dtype)
    rhs = jnp.asarray(rng.normal(size=(len(groups), 6, 3)), dtype)
    sizes = jnp.asarray(groups, jnp.int32)
    with jax.default_matmul_precision("highest"):
        got = ragged_dot(lhs, rhs, sizes)
        want = jax.lax.ragged_dot(lhs, rhs, sizes)
    assert got.dtype == want.dtype == dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-6)


@pytest.mark.parametrize(
    "dtype, want",
    [(jnp.float32, jax.lax.Precision.HIGHEST), (jnp.bfloat16, jax.lax.Precision.DEFAULT)],
    ids=["float32-keeps-highest", "bfloat16-pinned-default"],
)
def test_ragged_dot_keeps_a_float32_callers_precision_and_pins_narrower_operands(dtype, want):
    """Under ``default_matmul_precision("highest")`` the program's product runs at
    HIGHEST for float32 operands and at DEFAULT for bfloat16 ones (the CPU's values
    cannot tell: it multiplies float32 exactly either way); one group is a plain dot."""
    for groups, primitive in (([5], "dot_general"), ([2, 3], "ragged_dot_general")):
        lhs = jnp.ones((5, 6), dtype)
        rhs = jnp.ones((len(groups), 6, 3), dtype)
        with jax.default_matmul_precision("highest"):
            jaxpr = jax.make_jaxpr(ragged_dot)(lhs, rhs, jnp.asarray(groups, jnp.int32))
        (product,) = [e for e in jaxpr.eqns if "dot" in e.primitive.name]
        assert (product.primitive.name, product.params["precision"]) == (primitive, (want, want))
