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

from posttrain import _compat, sharding
from posttrain.models import build_model, flat_params, get_config, params
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


def _state_bytes(model) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))


def test_the_host_bound_is_the_models_bytes_inclusive(monkeypatch):
    """A model of exactly HOST_INIT_BYTES (its built state's bytes, counted here from the
    arrays) is initialised on the host; one byte less of bound and it is not."""
    cfg = get_config("qwen3-tiny")
    with jax.default_device(jax.devices("cpu")[0]):
        size = _state_bytes(build_model(cfg, host_init=False))
    monkeypatch.setattr(params, "HOST_INIT_BYTES", size)
    assert init_on_host(cfg, backend="tpu")
    monkeypatch.setattr(params, "HOST_INIT_BYTES", size - 1)
    assert not init_on_host(cfg, backend="tpu")


def test_without_a_cpu_backend_the_accelerator_initialises(monkeypatch):
    """``JAX_PLATFORMS`` without ``cpu``: ``jax.devices('cpu')`` raises, so no host init."""
    devices = jax.devices

    def no_cpu(backend=None):
        if backend == "cpu":
            raise RuntimeError("Unknown backend cpu")
        return devices(backend)

    monkeypatch.setattr(jax, "devices", no_cpu)
    assert not init_on_host(get_config("qwen3-tiny"), backend="tpu")


def test_build_model_asks_init_on_host_only_when_not_told(monkeypatch):
    asked = []
    monkeypatch.setattr(params, "init_on_host", lambda cfg: asked.append(cfg) or False)
    cfg = get_config("qwen3-tiny")
    build_model(cfg)
    assert asked == [cfg]
    build_model(cfg, host_init=False)
    build_model(cfg, host_init=True)
    assert asked == [cfg]


def test_the_default_seed_is_0_and_the_direct_init_runs_on_the_default_device():
    """Unplaced, a model built without host init lives on the default device (here one
    other than the first), and its values are seed 0's, not seed 1's."""
    cfg = get_config("qwen3-tiny")
    other = jax.devices()[-1]
    with jax.default_device(other):
        model = build_model(cfg, host_init=False)
    assert {d for x in jax.tree.leaves(nnx.state(model)) for d in x.devices()} == {other}
    # the references on the same direct path: on an accelerator the default build of a
    # small model is the host's init, whose values are the CPU's stream, not the chip's
    seed0, seed1 = (flat_params(build_model(cfg, seed=s, host_init=False)) for s in (0, 1))
    got = flat_params(model)
    assert all(np.array_equal(got[k], seed0[k]) for k in got)
    assert not all(np.array_equal(got[k], seed1[k]) for k in got)


def test_the_host_init_runs_inside_an_accelerator_mesh_context():
    """The CLI builds inside ``sharding.use_mesh`` (JAX's mesh context). The host path's key
    is committed to the CPU, which a jit refuses under a mesh of other devices ("Received
    incompatible devices for jitted computation": ``posttrain generate`` on a v5e, where the
    mesh holds the chip). Here the mesh holds the last device, which is not the host CPU's first."""
    cpu = jax.devices("cpu")[0]
    others = [d for d in jax.devices() if d != cpu][-1:]
    if not others:
        pytest.skip("needs a device other than the host CPU's first (CPU at --devices 1)")
    mesh = _compat.make_mesh((1, 1), ("fsdp", "tensor"), others)
    cfg = get_config("qwen3-tiny")
    with sharding.use_mesh(mesh):
        hosted = build_model(cfg, mesh, seed=3, host_init=True)
    with jax.default_device(cpu):
        want = flat_params(build_model(cfg, seed=3, host_init=False))
    got = flat_params(hosted)
    assert all(np.array_equal(got[k], want[k]) for k in want)
    assert {d for x in jax.tree.leaves(nnx.state(hosted)) for d in x.devices()} == set(others)


def _placed_on(model) -> set:
    return {d for x in jax.tree.leaves(nnx.state(model)) for d in x.devices()}


@pytest.mark.devices(2)
def test_the_host_path_inits_on_the_first_cpu_and_places_on_the_backends_first(monkeypatch):
    """With the CPU's devices in reverse standing in for an accelerator's (the default
    backend's), the host path initialises on the host's first CPU device and places a model
    built without a mesh on the accelerator's first device."""
    cpu = jax.devices("cpu")
    accelerator = cpu[::-1]
    devices = jax.devices
    monkeypatch.setattr(
        jax, "devices", lambda backend=None: accelerator if backend is None else devices(backend)
    )
    initialised_on = []
    initializer = params._initializer

    def watched(cfg):
        init = initializer(cfg)

        def run(key):
            model = init(key)
            initialised_on.append(_placed_on(model))
            return model

        return run

    monkeypatch.setattr(params, "_initializer", watched)
    model = build_model(get_config("qwen3-tiny"), host_init=True)
    assert initialised_on == [{cpu[0]}]
    assert _placed_on(model) == {accelerator[0]}


def _kv_heads_over(axis: str) -> sharding.Rules:
    return tuple((n, (axis,) if n == "kv_heads" else a) for n, a in sharding.DEFAULT_RULES)


@pytest.mark.devices(8)
@pytest.mark.parametrize("host_init", [False, True], ids=["direct", "host"])
def test_build_model_checks_and_shards_under_the_rules_given(host_init):
    """kv heads over `data` (not a default rule): data=8 is refused for qwen3-tiny's 4 kv
    heads before anything is built; data=2 shards k_proj's kv heads over it."""
    cfg = get_config("qwen3-tiny")
    with pytest.raises(ValueError, match=r"^num_kv_heads=4 is not divisible by mesh axes data=8$"):
        build_model(cfg, sharding.make_mesh({"data": 8}), rules=_kv_heads_over("data"))
    mesh = sharding.make_mesh({"data": 2, "fsdp": 4})
    model = build_model(cfg, mesh, rules=_kv_heads_over("data"), host_init=host_init)
    kernel = model.model.layers[0].self_attn.k_proj.kernel
    # [d_model, kv_heads, head_dim]: head_dim whole (the spec's trailing None dropped)
    assert tuple(_compat.variable_value(kernel).sharding.spec) == ("fsdp", "data")
