"""``build_model``'s host initialisation (:func:`posttrain.models.params.init_on_host`): on
an accelerator a small model is initialised by XLA:CPU and then placed, because a TPU
compiles even a tiny model's initialiser in 5 to 11 s. The placed model holds the values
the CPU gives for its seed (the ``rbg`` stream is each backend's own: on a v5e the
accelerator's own init differs in every value) and the shardings the accelerator's own
path gives."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from posttrain import sharding
from posttrain.models import build_model, flat_params, get_config
from posttrain.models.params import HOST_INIT_BYTES, init_on_host
from tests.meshes import fitted


@pytest.mark.parametrize("mesh_shape", [None, {"fsdp": 4, "tensor": 2}], ids=["no-mesh", "mesh"])
def test_a_host_initialised_model_is_the_cpus_model_placed_the_same_way(mesh_shape):
    cfg = get_config("qwen3-tiny")
    mesh = None if mesh_shape is None else sharding.make_mesh(fitted(mesh_shape))
    with jax.default_device(jax.devices("cpu")[0]):
        on_cpu = build_model(cfg, seed=3, host_init=False)
    direct = build_model(cfg, mesh, seed=3, host_init=False)
    hosted = build_model(cfg, mesh, seed=3, host_init=True)
    want, got = flat_params(on_cpu), flat_params(hosted)
    assert want.keys() == got.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    for a, b in zip(
        jax.tree.leaves(nnx.state(direct)), jax.tree.leaves(nnx.state(hosted)), strict=True
    ):
        assert b.sharding.is_equivalent_to(a.sharding, a.ndim), (a.sharding, b.sharding)
        assert b.sharding.device_set == a.sharding.device_set, (a.sharding, b.sharding)


def test_only_small_models_on_an_accelerator_are_initialised_on_the_host():
    assert init_on_host(get_config("qwen3-tiny"), backend="tpu")
    assert init_on_host(get_config("gemma4-tiny"), backend="gpu")
    assert not init_on_host(get_config("qwen3-tiny"), backend="cpu")  # the CPU inits itself
    assert not init_on_host(get_config("qwen3-0.6b"), backend="tpu")  # ~1.2 GB: on the chip
    assert HOST_INIT_BYTES == 256 * 2**20
