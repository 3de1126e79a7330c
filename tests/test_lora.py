"""LoRA / QLoRA through Qwix: any mesh, every family, scanned or not; merge, save, PEFT export.

Cost control: the mesh property is split in two. ``apply_lora`` alone traces
abstractly (about a second), so many meshes are cheap; a jitted forward and
LoRA gradient compiles for 5-20 s on CPU, so few examples run in the gate and
more under ``--slow``. Base models here are filled from numpy and placed
(:func:`placed_model`), not initialised by a compiled program.

16 devices: ``test_apply_lora_on_16_device_meshes`` runs the cheap property in
a subprocess with ``POSTTRAIN_DEVICES=16`` (about 15 s), so the 8-device gate
runs it without a ``devices(16)`` marker that ``--strict-skips`` would fail.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import safetensors
import safetensors.numpy
from flax import nnx
from hypothesis import given, settings

from posttrain import _compat, families, sharding
from posttrain.hf_schema.rows import expand
from posttrain.hf_schema.transforms import REGISTRY
from posttrain.lora import (
    LoraConfig,
    apply_lora,
    dummy_batch_shape,
    export_peft,
    load_adapter,
    lora_deltas,
    lora_params,
    merge_lora,
    save_adapter,
    unmerge_lora,
)
from posttrain.lora.adapters import adapter_arrays
from posttrain.models import PRESETS, CausalLM, flat_params, get_config
from tests.strategies import ALL_AXES, mesh_id, meshes, presets_and_meshes, scaled
from tests.tracing import tracer_sharding_reads

pytestmark = pytest.mark.matmul_precision("highest")

LORA = LoraConfig(rank=4, alpha=8.0)
# B = 0 adds an exact zero, but XLA may fuse the LoRA model's matmuls differently:
# observed <= 1.5e-7 on fp32 logits of magnitude ~1.
ZERO_ADAPTER_ATOL = 1e-6
# merge then unmerge: (W + d) - d in fp32, |W| ~ 0.1: one rounding, ~1e-8.
UNMERGE_ATOL = 1e-6
# merged vs adapter logits: W x + s (x A) B vs (W + s A B) x reassociates in fp32;
# observed ~7e-6 on logits ~1 with B ~ 0.1 N(0, 1).
MERGED_ATOL = 5e-5
# QLoRA (B = 0) vs the float base model: base-weight rounding; observed 1-4% of max |logit|
# for int8 per-channel and int4 tiles of 2 on the tiny models.
QLORA_RTOL_OF_MAX = 0.1


def placed_model(cfg, mesh=None, seed: int = 0) -> CausalLM:
    """A ``CausalLM`` of ``cfg`` with N(0, 0.05) weights drawn by numpy, placed on ``mesh``.

    No XLA program is compiled (``build_model`` compiles an initialiser per config).
    """
    if mesh is not None:
        cfg.check_mesh(dict(mesh.shape))
    graphdef, state = nnx.split(nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(seed)
    flat = [
        (p, v.replace(rng.normal(0.0, 0.05, v.shape).astype(v.dtype)))
        for p, v in nnx.to_flat_state(state)
    ]
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    return model if mesh is None else sharding.shard_model(model, mesh)


def expected_adapters(cfg, experts: bool = False) -> int:
    """LoRA params the default target should create: 2 per adapted weight, counted from cfg."""
    units = cfg.layer_types[: cfg.layer_period] if cfg.scan_layers else cfg.layer_types
    weights = 0
    for t in units:
        weights += 3 if cfg.attention[t].k_eq_v else 4  # q, k, (v), o
        if cfg.moe is None or cfg.dense_mlp_with_moe:
            weights += 3  # gate, up, down
        if cfg.moe is not None and cfg.moe.shared_expert_d_ff:
            weights += 3
        if experts:
            weights += 3
    return 2 * weights


def tokens_on(cfg, mesh, batch: int, seq: int, seed: int = 0) -> jax.Array:
    tokens = np.random.RandomState(seed).randint(0, cfg.vocab_size, (batch, seq)).astype(np.int32)
    spec = sharding.logical_to_spec(
        ("activation_batch", "activation_length"), (batch, seq), dict(mesh.shape)
    )
    return jax.device_put(tokens, jax.sharding.NamedSharding(mesh, spec))


def nll(model, tokens):
    logits, _ = model.forward(tokens)
    logp = jax.nn.log_softmax(logits[:, :-1])
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()


_LORA_GRAD = nnx.jit(nnx.value_and_grad(nll, argnums=nnx.DiffState(0, nnx.LoRAParam)))
_FORWARD = nnx.jit(lambda model, tokens: model.forward(tokens)[0])


def lora_loss_and_grads(model, tokens):
    """Jitted loss and gradient with respect to the LoRA params only."""
    return _LORA_GRAD(model, tokens)


def forward(model, tokens) -> np.ndarray:
    """Jitted logits (one cache: plain models of one config and placement share a compile)."""
    return np.asarray(_FORWARD(model, tokens))


def randomise_adapters(model, seed: int = 1) -> None:
    """Adds 0.1 N(0, 1) (numpy) to every LoRA param, so B != 0, keeping shardings."""
    rng = np.random.default_rng(seed)
    flat = []
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
        value = var.get_value()
        noise = 0.1 * rng.standard_normal(value.shape)
        flat.append(
            (
                path,
                var.replace(
                    jax.device_put(np.asarray(value) + noise.astype(value.dtype), value.sharding)
                ),
            )
        )
    nnx.update(model, nnx.from_flat_state(flat))


def old_dummy_shape(mesh, rules=sharding.DEFAULT_RULES) -> tuple[int, int]:
    """The pre-fix rule: dummy batch = size of the data axis alone."""
    return mesh.shape["data"], sharding.sequence_parallel_size(mesh, rules)


def check_apply(preset: str, scan: bool, mesh_shape: dict[str, int], dummy_rule=None):
    """apply_lora succeeds on the mesh, with the expected count of placed LoRA params."""
    cfg = get_config(preset, scan_layers=scan)
    mesh = sharding.make_mesh(mesh_shape)
    model = placed_model(cfg, mesh)
    dummy = None if dummy_rule is None else dummy_rule(mesh)
    lora_model = apply_lora(model, mesh, LORA, dummy_shape=dummy)
    params = lora_params(lora_model)
    assert len(params) == expected_adapters(cfg), sorted(params)
    for name, value in params.items():
        assert value.sharding.mesh == mesh, name
    return cfg, mesh, lora_model


# --- config -----------------------------------------------------------------------


@pytest.mark.parametrize("preset", sorted(p for p in PRESETS if p.endswith("-tiny")))
def test_only_variables_have_a_shape(preset):
    """Qwix <= 0.1.4 (``flax_util.find_param``) takes every module attribute with a
    ``shape`` as a param and reads ``.value``: a ``numpy.dtype`` attribute (``shape == ()``)
    broke LoRA there (tunix-0.1.4-era). Only ``nnx.Variable``s may have a shape."""
    model = nnx.eval_shape(lambda: CausalLM(get_config(preset), rngs=nnx.Rngs(0)))
    offenders = [
        f"{type(module).__name__}.{name} ({type(value).__name__})"
        for _, module in _compat.iter_modules(model)
        for name, value in vars(module).items()
        if hasattr(value, "shape") and not isinstance(value, nnx.Variable)
    ]
    assert not offenders, offenders


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(rank=0, alpha=1.0), "rank=0 must be an integer > 0"),
        (dict(rank=-2, alpha=1.0), "rank=-2 must be an integer > 0"),
        (dict(rank=4, alpha=0.0), "alpha=0.0 must be a finite number > 0"),
        (dict(rank=4, alpha=-1.0), "alpha=-1.0 must be a finite number > 0"),
        (dict(rank=4, alpha="abc"), "alpha='abc' must be a finite number > 0"),
        (dict(rank=4, alpha=float("inf")), "alpha=inf must be a finite number > 0"),
        (dict(rank=4, alpha=True), "alpha=True must be a finite number > 0"),
        (
            dict(rank=4, alpha=8.0, weight_qtype="int8", tile_size="x"),
            "tile_size='x' must be a finite number > 0",
        ),
        (dict(rank=4, alpha=8.0, dropout=1.0), r"dropout=1.0 must be in \[0, 1\)"),
        (dict(rank=4, alpha=8.0, target="(q_proj"), "is not a valid regex"),
        (dict(rank=4, alpha=8.0, weight_qtype="int3"), "weight_qtype='int3' must be one of"),
        (dict(rank=4, alpha=8.0, tile_size=32), "tile_size=32 needs weight_qtype"),
        (dict(rank=4, alpha=8.0, target=".*", experts=True), "experts=True only extends"),
    ],
    ids=[
        "rank0",
        "rank-neg",
        "alpha0",
        "alpha-neg",
        "alpha-string",
        "alpha-inf",
        "alpha-bool",
        "tile-string",
        "dropout1",
        "bad-regex",
        "qtype",
        "tile-no-qtype",
        "experts-with-target",
    ],
)
def test_lora_config_rejects_bad_values(kwargs, message):
    """Each invalid LoraConfig field fails with a one-line ValueError naming the value."""
    with pytest.raises(ValueError, match=message):
        LoraConfig(**kwargs)


@pytest.mark.devices(8)  # the product of three 2-sized axes on the batch: 8 devices
def test_dummy_batch_shape_multiplies_the_rule_axes():
    """Dummy batch = product of the activation_batch rule's axes, seq = activation_length's,
    and a rule gaining an axis is counted (the rules are read, not a fixed axis list)."""
    mesh = sharding.make_mesh({"data": 1, "fsdp": 2, "expert": 2, "context": 2})
    assert dummy_batch_shape(mesh) == (4, 2)
    rules = tuple(
        (n, (*a, "tensor_sequence") if n == "activation_batch" else a)
        for n, a in sharding.DEFAULT_RULES
        if n != "activation_length"
    )
    mesh = sharding.make_mesh({"fsdp": 2, "tensor_sequence": 2, "context": 2})
    assert dummy_batch_shape(mesh, rules) == (4, 1)


# --- the mesh property ------------------------------------------------------------------


@pytest.mark.devices(8)
@settings(max_examples=scaled(5))
@given(case=presets_and_meshes())
def test_apply_lora_on_any_mesh(case):
    """On any 8-device mesh a tiny preset allows, scanned or not, apply_lora creates the
    expected number of LoRA params, each placed on that mesh."""
    check_apply(*case)


def _check_step(case) -> None:
    preset, scan, mesh_shape = case
    cfg, mesh, lora_model = check_apply(preset, scan, mesh_shape)
    batch, seq = dummy_batch_shape(mesh)
    with sharding.use_mesh(mesh):
        loss, grads = lora_loss_and_grads(lora_model, tokens_on(cfg, mesh, batch, 2 * seq))
    assert np.isfinite(float(loss)), mesh_id(mesh_shape)
    grads = {"/".join(map(str, p)): np.asarray(v) for p, v in nnx.to_flat_state(grads)}
    assert len(grads) == expected_adapters(cfg)
    assert all(k.endswith(("_lora_a", "_lora_b")) for k in grads)
    assert any(np.abs(g).max() > 0 for k, g in grads.items() if k.endswith("_lora_b"))


@pytest.mark.devices(8)
@settings(max_examples=scaled(2))
@given(case=presets_and_meshes())
def test_lora_forward_and_grad_on_any_mesh(case):
    """On any allowed 8-device mesh the LoRA model's jitted loss and LoRA-only gradient
    run, are finite, and reach every adapter (B gets a nonzero gradient)."""
    _check_step(case)


@pytest.mark.slow
@pytest.mark.devices(8)
@settings(max_examples=scaled(24))
@given(case=presets_and_meshes())
def test_lora_forward_and_grad_on_any_mesh_thorough(case):
    """The forward/gradient property with more examples (slow)."""
    _check_step(case)


@pytest.mark.slow  # a subprocess (imports ~4 s) and 8 examples: ~9 s of the gate's ~120 s
def test_apply_lora_on_16_device_meshes():
    """The apply_lora property on 16 fake devices, in a subprocess (the gate runs 8): meshes
    with four axes of size 2, or an axis of 16, which 8 devices cannot make. Slow tier: the
    8-device property and the old-rule teeth below catch the dummy-input regression."""
    code = textwrap.dedent("""
        from harness.devices.devices import configure_devices
        configure_devices(16)
        from hypothesis import given, settings
        from tests.strategies import presets_and_meshes, scaled
        from tests.test_lora import check_apply

        @settings(max_examples=scaled(8), deadline=None, derandomize=True, database=None)
        @given(case=presets_and_meshes(devices=16))
        def prop(case):
            check_apply(*case)

        prop()
        print("16-device property ok")
    """)
    env = {**os.environ, "POSTTRAIN_DEVICES": "16"}
    env.pop("XLA_FLAGS", None)
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=os.path.dirname(os.path.dirname(__file__)),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


# --- the Qwix pass under tracing --------------------------------------------------------


def test_tracing_rngs_draw_the_keys_of_nnx_rngs_eager_and_traced():
    """``_compat.tracing_rngs(seed)`` (handed to Qwix) draws the keys ``nnx.Rngs(seed)``
    would, per stream, and counts the same, outside and inside a trace."""

    def draw(make, seed):
        rngs = make(seed)
        keys = [jax.random.key_data(rngs.params()) for _ in range(3)]
        keys.append(jax.random.key_data(rngs.dropout()))
        return jnp.stack(keys), jnp.asarray(_compat.variable_value(rngs.default.count))

    for seed in (0, 7):
        for run in (lambda f: f(), lambda f: jax.jit(f)()):
            ours = run(lambda seed=seed: draw(_compat.tracing_rngs, seed))
            theirs = run(lambda seed=seed: draw(nnx.Rngs, seed))
            for a, b in zip(ours, theirs, strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            assert int(ours[1]) == 4


def _tracer_sharding_reads(monkeypatch, cfg, lora, mesh) -> int:
    """How often ``apply_lora`` reads ``tracer.sharding`` (and checks the adapters)."""
    model = placed_model(cfg, mesh)
    with tracer_sharding_reads(monkeypatch) as reads:
        lora_model = apply_lora(model, mesh, lora)
    assert len(lora_params(lora_model)) == expected_adapters(cfg, lora.experts)
    return len(reads)


@pytest.mark.devices(8)
@pytest.mark.parametrize(
    ("preset", "lora"),
    [
        ("llama3-tiny", LORA),
        ("qwen3_moe-tiny", LORA.replace(experts=True)),
        ("llama3-tiny", LORA.replace(weight_qtype="int8")),
    ],
    ids=["lora", "experts", "qlora"],
)
def test_apply_lora_never_asks_a_tracer_for_its_sharding(preset, lora, monkeypatch):
    """``tracer.sharding`` raises an AttributeError whose message walks every equation
    traced so far. Qwix reads it for every adapted weight (``get_canonical_pspec``) and
    flax >= 0.12.1 for every key drawn, so a Qwix pass over traced params was quadratic
    (qwen3-0.6b: 38.4 s against 3.5 s, ``benchmarks/lora_apply.py``). Unscanned,
    apply_lora must not trace the params, nor draw keys through ``RngStream.__call__``;
    scanned, the reads (of layer 0's slices) must not grow with the layer count. QLoRA
    quantises for real before the LoRA pass (traced in one pass, Qwix read each quantised
    kernel's sharding: 14 reads here; qwen3-0.6b: 196 reads, ``apply_lora`` 35-39 s
    against 10.8 s now)."""
    cfg = get_config(preset)
    if lora.experts:
        cfg = cfg.replace(moe=dataclasses.replace(cfg.moe, algorithm="dense"))
    mesh = sharding.make_mesh({"fsdp": 4, "tensor": 2})
    assert _tracer_sharding_reads(monkeypatch, cfg, lora, mesh) == 0
    if lora.weight_qtype:
        return  # unscanned is where QLoRA read its quantised kernels from tracers (14)
    scanned = [
        _tracer_sharding_reads(
            monkeypatch,
            cfg.replace(scan_layers=True, num_layers=n, layer_types=cfg.layer_types[:1] * n),
            lora,
            mesh,
        )
        for n in (2, 6)
    ]
    assert scanned[0] == scanned[1], scanned


# --- teeth: the old dummy-input rule must fail ------------------------------------------------


@pytest.mark.devices(8)
def test_old_dummy_rule_fails_with_fsdp():
    """With the old rule (dummy batch = data axis) apply_lora fails on an fsdp=4 mesh."""
    with pytest.raises(
        ValueError,
        match=r"activation_batch\) of size 1 is not divisible by "
        r"mesh axes fsdp=4",
    ):
        check_apply("llama3-tiny", False, {"fsdp": 4, "tensor": 2}, old_dummy_shape)


@pytest.mark.slow  # ~25 apply_lora calls while hypothesis shrinks (~80 s on 2 cores)
@pytest.mark.devices(8)
def test_old_dummy_rule_property_shrinks_to_minimal_mesh():
    """The property run with the old rule fails, and hypothesis shrinks it to the first mesh
    (in the strategy's order) where the batch is sharded by more than the data axis."""
    cfg = get_config("llama3-tiny")
    strategy = meshes(cfg, 8, ALL_AXES)
    shapes = (
        strategy.wrapped_strategy.elements
        if hasattr(strategy, "wrapped_strategy")
        else strategy.elements
    )
    minimal = next(m for m in shapes if sharding.data_parallel_size(m) != m.get("data", 1))
    failing = []

    @settings(max_examples=scaled(10), derandomize=True, database=None)
    @given(mesh_shape=strategy)
    def prop(mesh_shape):
        try:
            check_apply("llama3-tiny", False, mesh_shape, old_dummy_shape)
        except ValueError:
            failing.append(mesh_shape)
            raise

    with pytest.raises(ValueError, match="not divisible by mesh axes"):
        prop()
    assert failing[-1] == minimal, (failing[-1], minimal)


# --- equivalences: B = 0, one step, merge / unmerge ------------------------------------------


@pytest.mark.devices(8)
@pytest.mark.parametrize(
    ("preset", "scan", "experts"),
    [
        # the gate's case: experts and attention unscanned; the scanned dense one is slow-tier
        pytest.param("llama3-tiny", True, False, marks=pytest.mark.slow),
        ("qwen3_moe-tiny", False, True),
    ],
    ids=["llama3-scanned", "qwen3_moe-experts-unscanned"],
)
def test_zero_adapter_step_and_merge_roundtrip(preset, scan, experts):
    """B = 0 keeps the base logits; one SGD step on LoRA params changes only LoRA params;
    merged weights give the adapter's logits; unmerge restores the base within 1e-6."""
    cfg = get_config(preset, scan_layers=scan)
    if experts:
        cfg = cfg.replace(moe=dataclasses.replace(cfg.moe, algorithm="dense"))
    mesh = sharding.make_mesh({"fsdp": 2, "tensor": 2, "data": 2})
    base = placed_model(cfg, mesh)
    lora_model = apply_lora(base, mesh, LORA.replace(experts=experts))
    assert len(lora_params(lora_model)) == expected_adapters(cfg, experts)
    tokens = tokens_on(cfg, mesh, 4, 8)
    with sharding.use_mesh(mesh):
        np.testing.assert_allclose(
            forward(lora_model, tokens), forward(base, tokens), atol=ZERO_ADAPTER_ATOL
        )
        before = {
            "/".join(map(str, p)): np.asarray(v)
            for p, v in nnx.to_flat_state(nnx.state(lora_model))
        }
        tx = optax.sgd(0.5)
        lora_state = nnx.state(lora_model, nnx.LoRAParam)
        _, grads = lora_loss_and_grads(lora_model, tokens)
        updates, _ = tx.update(grads, tx.init(lora_state), lora_state)
        nnx.update(lora_model, optax.apply_updates(lora_state, updates))
        after = {
            "/".join(map(str, p)): np.asarray(v)
            for p, v in nnx.to_flat_state(nnx.state(lora_model))
        }
        changed = {k for k in before if not np.array_equal(before[k], after[k])}
        assert changed and all(k.endswith("_lora_b") for k in changed), sorted(changed)[:5]

        randomise_adapters(lora_model)
        merged = merge_lora(lora_model)
        np.testing.assert_allclose(
            forward(merged, tokens), forward(lora_model, tokens), atol=MERGED_ATOL
        )
    restored, original = flat_params(unmerge_lora(merged, lora_model)), flat_params(base)
    assert restored.keys() == original.keys()
    for key in original:
        np.testing.assert_allclose(restored[key], original[key], atol=UNMERGE_ATOL, err_msg=key)
    deltas = lora_deltas(lora_model)
    assert len(deltas) == expected_adapters(cfg, experts) // 2


@pytest.mark.devices(8)
@pytest.mark.parametrize(
    ("qtype", "tile_size"),
    [("int8", None), pytest.param("int4", 2, marks=pytest.mark.slow)],
    ids=["int8", "int4-tile2"],
)
def test_qlora_scanned_runs_and_adapts(qtype, tile_size):
    """QLoRA (quantised base weights) on a scanned model: adapters created, logits near the
    float base model, LoRA-only gradient runs, and a nonzero B changes the logits."""
    cfg = get_config("qwen3-tiny", scan_layers=True)
    mesh = sharding.make_mesh({"fsdp": 4, "tensor": 2})
    base = placed_model(cfg, mesh)
    lora_model = apply_lora(base, mesh, LORA.replace(weight_qtype=qtype, tile_size=tile_size))
    assert len(lora_params(lora_model)) == expected_adapters(cfg)
    quantised = [p for p, _ in nnx.to_flat_state(nnx.state(lora_model)) if "qvalue" in p]
    assert len(quantised) == expected_adapters(cfg) // 2
    tokens = tokens_on(cfg, mesh, 4, 8)
    with sharding.use_mesh(mesh):
        want = forward(base, tokens)
        got = forward(lora_model, tokens)
        np.testing.assert_allclose(got, want, atol=QLORA_RTOL_OF_MAX * np.abs(want).max())
        loss, _ = lora_loss_and_grads(lora_model, tokens)
        assert np.isfinite(float(loss))
        randomise_adapters(lora_model)
        assert np.abs(forward(lora_model, tokens) - got).max() > 1e-3


@pytest.mark.devices(8)
def test_merging_a_bfloat16_model_keeps_every_weights_dtype():
    """merge_lora of a bfloat16 model: each merged weight is bfloat16 (the sum formed in
    float32, rounded back once), and the adapted ones moved. Mutation survivor of the
    jitted ``_shifted`` (the sum left in float32)."""
    mesh = sharding.make_mesh({"fsdp": 4, "data": 2})
    bf16 = get_config("qwen3-tiny", dtype="bfloat16", param_dtype="bfloat16")
    model = apply_lora(placed_model(bf16, mesh), mesh, LORA)
    randomise_adapters(model)
    base, merged = flat_params(placed_model(bf16, mesh)), flat_params(merge_lora(model))
    assert base.keys() == merged.keys()
    assert {v.dtype for v in merged.values()} == {jnp.dtype(jnp.bfloat16)}
    assert any(not np.array_equal(base[k], merged[k]) for k in base)


@pytest.mark.devices(8)
def test_qlora_merge_gives_the_dequantised_base_plus_the_deltas():
    """merge_lora of a QLoRA model: each quantised weight becomes qwix's dequantisation
    of it plus (alpha / rank) A.B, every other parameter is the base's own, and the merged
    model's logits are the QLoRA model's (the kernels compute on the same values)."""
    from posttrain.lora.merge import base_weights

    cfg = get_config("qwen3-tiny", scan_layers=True)
    mesh = sharding.make_mesh({"fsdp": 4, "tensor": 2})
    base = placed_model(cfg, mesh)
    lora_model = apply_lora(base, mesh, LORA.replace(weight_qtype="int8"))
    randomise_adapters(lora_model)
    weights = {".".join(map(str, p)): np.asarray(v) for p, v in base_weights(lora_model).items()}
    plain = flat_params(base)
    assert weights.keys() == plain.keys()
    deltas = {k: np.asarray(v) for k, v in lora_deltas(lora_model).items()}
    merged = flat_params(merge_lora(lora_model))
    quantised = 0
    for key, value in plain.items():
        delta = deltas.get(key)
        if delta is None:
            np.testing.assert_array_equal(weights[key], value, err_msg=key)
            np.testing.assert_array_equal(merged[key], value, err_msg=key)
            continue
        quantised += 1
        # int8 with per-channel scales: near the float weight, never equal to it
        assert not np.array_equal(weights[key], value), key
        np.testing.assert_allclose(weights[key], value, atol=0.02 * np.abs(value).max())
        np.testing.assert_allclose(merged[key], weights[key] + delta, rtol=1e-6, atol=1e-6)
    assert quantised == expected_adapters(cfg) // 2
    tokens = tokens_on(cfg, mesh, 4, 8)
    with sharding.use_mesh(mesh):
        want = forward(lora_model, tokens)
        np.testing.assert_allclose(
            forward(merge_lora(lora_model), tokens), want, atol=1e-4 * np.abs(want).max()
        )


# --- bad input ------------------------------------------------------------------------------------


@pytest.mark.devices(8)
@pytest.mark.parametrize(
    ("preset", "mesh_shape", "lora", "error", "message"),
    [
        (
            "llama3-tiny",
            {"fsdp": 8},
            LORA.replace(target=".*/no_such_module"),
            ValueError,
            r"matches no module path of llama3; paths look like: .*model/layers/0/self_attn/q_proj",
        ),
        (
            "llama3-tiny",
            {"fsdp": 8},
            LORA.replace(target=".*/self_attn"),
            ValueError,
            r"matched 2 modules \(model/layers/0/self_attn, .*\) but Qwix created no nnx.LoRAParam",
        ),
        (
            "qwen3-tiny",
            {"tensor": 8},
            LORA,
            ValueError,
            "num_kv_heads=4 is not divisible by mesh axes tensor=8",
        ),
        (
            "qwen3_moe-tiny",
            {"fsdp": 8},
            LORA.replace(experts=True),
            ValueError,
            "LoRA on routed experts .* needs moe.algorithm='dense'",
        ),
        ("llama3-tiny", {"fsdp": 8}, LORA.replace(dropout=0.1), NotImplementedError, "dropout=0.1"),
    ],
    ids=[
        "target-matches-nothing",
        "target-without-weights",
        "mesh-does-not-divide",
        "experts-sorted",
        "dropout",
    ],
)
def test_apply_lora_rejects_bad_input(preset, mesh_shape, lora, error, message):
    """Unusable targets, meshes and options fail before any compile, saying what is wrong."""
    mesh = sharding.make_mesh(mesh_shape)
    model = placed_model(get_config(preset))  # unplaced: the bad mesh could not hold it
    with pytest.raises(error, match=message):
        apply_lora(model, mesh, lora)


def _fused_gemma4():
    cfg = get_config("gemma4-tiny")
    return cfg.replace(moe=dataclasses.replace(cfg.moe, algorithm="dense", fuse_expert_scales=True))


@pytest.mark.devices(8)
@pytest.mark.parametrize(
    ("make_config", "lora", "message"),
    [
        (
            lambda: get_config("llama3-tiny", dtype="bfloat16"),
            LORA.replace(weight_qtype="int8"),
            r"QLoRA \(weight_qtype='int8'\) needs dtype == param_dtype, got bfloat16 and float32",
        ),
        (_fused_gemma4, LORA.replace(experts=True), "needs moe.fuse_expert_scales=False"),
    ],
    ids=["qlora-mixed-dtypes", "experts-fused-scales"],
)
def test_apply_lora_refuses_a_base_qwix_would_adapt_wrongly(make_config, lora, message):
    """QLoRA on a model computing in another dtype than its weights', and routed experts
    whose per-expert scale is fused into down_proj (Qwix would adapt the product as a
    weight), fail before any trace, saying which field."""
    mesh = sharding.make_mesh({"fsdp": 8})
    model = placed_model(make_config())
    with pytest.raises(ValueError, match=message):
        apply_lora(model, mesh, lora)


# --- adapters on disk -------------------------------------------------------------------------


@pytest.mark.devices(8)
def test_save_load_across_layouts_and_config_check(tmp_path):
    """An adapter saved from a scanned model loads into an unscanned one (same values,
    unstacked) and back (stacked); loading into a model with another rank/alpha lists
    each difference."""
    mesh = sharding.make_mesh({"fsdp": 4, "data": 2})

    def build(scan_layers):
        cfg = get_config("gemma4-tiny", scan_layers=scan_layers)
        return apply_lora(placed_model(cfg, mesh), mesh, LORA)

    def assert_same(scanned, plain):
        stacked = lora_params(scanned)
        for key, value in lora_params(plain).items():
            parts = key.split(".")
            i = int(parts[2])  # model.layers.{i}...
            block = ".".join(["model", "blocks", str(i % 2), *parts[3:]])
            np.testing.assert_array_equal(np.asarray(value), np.asarray(stacked[block])[i // 2])

    scanned = build(scan_layers=True)
    randomise_adapters(scanned)
    save_adapter(scanned, tmp_path / "adapter")
    plain = build(scan_layers=False)
    load_adapter(plain, tmp_path / "adapter")
    assert_same(scanned, plain)
    randomise_adapters(plain, seed=2)  # other values, so the way back is seen
    save_adapter(plain, tmp_path / "unscanned-adapter")
    load_adapter(scanned, tmp_path / "unscanned-adapter")
    assert_same(scanned, plain)
    other = apply_lora(
        placed_model(get_config("gemma4-tiny"), mesh), mesh, LoraConfig(rank=2, alpha=4.0)
    )
    with pytest.raises(
        ValueError,
        match=r"rank 4 \(adapter\) != 2 \(model\); "
        r"alpha 8.0 \(adapter\) != 4.0 \(model\)",
    ):
        load_adapter(other, tmp_path / "adapter")


@pytest.mark.devices(8)
def test_loading_keeps_each_adapters_sharding_and_the_models_dtype(tmp_path):
    """A float32 adapter loaded into the bfloat16 twin: each adapter keeps its sharding
    and the model's dtype (the values rounded to it). Mutation survivors."""
    mesh = sharding.make_mesh({"fsdp": 4, "data": 2})
    source = apply_lora(placed_model(get_config("qwen3-tiny"), mesh), mesh, LORA)
    randomise_adapters(source)
    save_adapter(source, tmp_path / "adapter")
    bf16 = get_config("qwen3-tiny", dtype="bfloat16", param_dtype="bfloat16")
    target = apply_lora(placed_model(bf16, mesh), mesh, LORA)
    before = {k: (v.dtype, v.sharding) for k, v in lora_params(target).items()}
    assert {dtype for dtype, _ in before.values()} == {jnp.dtype(jnp.bfloat16)}
    assert any(not s.is_fully_replicated for _, s in before.values())  # some are sharded
    load_adapter(target, tmp_path / "adapter")
    want, got = lora_params(source), lora_params(target)
    for k, (dtype, placement) in before.items():
        assert got[k].dtype == dtype and got[k].sharding == placement, k
        np.testing.assert_array_equal(
            np.asarray(got[k]), np.asarray(want[k]).astype(jnp.bfloat16), err_msg=k
        )


@pytest.mark.devices(8)
def test_a_saved_adapter_holds_the_arrays_it_was_given_and_names_its_format(tmp_path):
    """``save_adapter(..., arrays=)`` writes the arrays it is given (across processes every
    process gathers them and one writes: recomputing them there would be a collective in
    one process only), and the file's header names the format. Mutation survivors."""
    mesh = sharding.make_mesh({"fsdp": 2, "tensor": 2, "data": 2})
    model = apply_lora(placed_model(get_config("qwen3-tiny"), mesh), mesh, LORA)
    given_arrays = {k: v + 1.0 for k, v in adapter_arrays(model).items()}
    save_adapter(model, tmp_path / "adapter", arrays=given_arrays)
    path = tmp_path / "adapter" / "lora_adapter.safetensors"
    written = safetensors.numpy.load_file(path)
    assert written.keys() == given_arrays.keys() and len(written) > 4
    for k, v in given_arrays.items():
        np.testing.assert_array_equal(written[k], v, err_msg=k)
    with safetensors.safe_open(path, "np") as f:
        assert f.metadata() == {"format": "posttrain-lora"}


@pytest.mark.devices(8)
@pytest.mark.parametrize("preset", ["qwen3-tiny", "gpt_oss-tiny"])
def test_peft_export_matches_conversion_layout(tmp_path, preset):
    """PEFT lora_B @ lora_A * alpha/r equals the conversion table's HF layout of the native
    weight delta, for every adapted module (HF names from the conversion tables)."""
    cfg = get_config(preset, scan_layers=True)
    mesh = sharding.make_mesh({"fsdp": 2, "tensor": 2, "data": 2})
    lora_model = apply_lora(placed_model(cfg, mesh), mesh, LORA)
    randomise_adapters(lora_model)
    export_peft(lora_model, tmp_path / "peft")
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["peft_type"] == "LORA"
    # what PEFT's save_pretrained writes for a plain LoRA adapter used for inference
    fixed = {
        "task_type": "CAUSAL_LM",
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "lora_dropout": 0.0,
        "init_lora_weights": True,
        "inference_mode": True,
    }
    assert json.dumps({k: config[k] for k in fixed}) == json.dumps(fixed)  # false is not 0
    with safetensors.safe_open(tmp_path / "peft" / "adapter_model.safetensors", "np") as f:
        assert f.metadata() == {"format": "pt"}  # transformers' loaders ask for it
    assert set(config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj"} | (
        {"gate_proj", "up_proj", "down_proj"} if cfg.moe is None else set()
    )
    tensors = safetensors.numpy.load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    table = families.get(cfg.family).table
    rows = {
        e.native_keys[0]: e
        for e in expand(table.rows, cfg.replace(scan_layers=False), table.layouts[0])
    }
    deltas = lora_deltas(lora_model)
    checked = 0
    for key, delta in deltas.items():  # model.blocks.{p}.<rest>, stacked
        parts = key.split(".")
        for j, layer_delta in enumerate(np.asarray(delta)):
            i = j * cfg.layer_period + int(parts[2])
            native = ".".join(["model", "layers", str(i), *parts[3:]])
            entry = rows[native]
            hf = REGISTRY[entry.transform.name].to_hf([layer_delta], [native])[0]
            module = "base_model.model." + entry.hf_keys[0].removesuffix(".weight")
            got = tensors[module + ".lora_B.weight"] @ tensors[module + ".lora_A.weight"]
            np.testing.assert_allclose(got * LORA.scale, hf, atol=1e-5, err_msg=native)
            checked += 1
    assert (
        checked
        == len(tensors) // 2
        == expected_adapters(cfg) // 2 * cfg.num_layers // (cfg.layer_period)
    )


@pytest.mark.devices(8)
def test_peft_export_of_an_unscanned_model_equals_its_scanned_twins(tmp_path):
    """The same adapters exported from an unscanned model and from its scanned twin: the
    same PEFT tensors and config (the scanned test above checks the values)."""
    mesh = sharding.make_mesh({"fsdp": 2, "tensor": 2, "data": 2})
    scanned = apply_lora(placed_model(get_config("qwen3-tiny", scan_layers=True), mesh), mesh, LORA)
    randomise_adapters(scanned)
    save_adapter(scanned, tmp_path / "adapter")
    plain = apply_lora(placed_model(get_config("qwen3-tiny"), mesh), mesh, LORA)
    load_adapter(plain, tmp_path / "adapter")
    for name, model in (("scanned", scanned), ("plain", plain)):
        export_peft(model, tmp_path / name)
    want = safetensors.numpy.load_file(str(tmp_path / "scanned" / "adapter_model.safetensors"))
    got = safetensors.numpy.load_file(str(tmp_path / "plain" / "adapter_model.safetensors"))
    adapted = 7  # q, k, v, o, gate, up and down in each layer, an A and a B each
    assert got.keys() == want.keys()
    assert len(got) == 2 * adapted * get_config("qwen3-tiny").num_layers
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    config = "adapter_config.json"
    assert (tmp_path / "plain" / config).read_text() == (tmp_path / "scanned" / config).read_text()


@pytest.mark.devices(8)
def test_peft_export_names_the_modules_when_a_target_covers_some_layers_only(tmp_path):
    """q_proj adapted in layer 1 only and v_proj in every layer: PEFT's target_modules
    names layer 1's q_proj by its path (a bare "q_proj" would adapt every layer's) and v_proj
    by its short name. Mutation survivors."""
    mesh = sharding.make_mesh({"fsdp": 8})
    lora = LORA.replace(target=r"model/layers/1/self_attn/q_proj|.*/v_proj")
    model = apply_lora(placed_model(get_config("qwen3-tiny"), mesh), mesh, lora)
    export_peft(model, tmp_path / "peft")
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["model.layers.1.self_attn.q_proj", "v_proj"]


@pytest.mark.devices(8)
def test_peft_export_rejects_expert_adapters(tmp_path):
    """Adapters on routed experts have no PEFT nn.Linear, and a family without a conversion
    table has no HF names: export says so, writing nothing."""
    cfg = get_config("mixtral-tiny")
    cfg = cfg.replace(moe=dataclasses.replace(cfg.moe, algorithm="dense"))
    mesh = sharding.make_mesh({"fsdp": 8})
    lora_model = apply_lora(placed_model(cfg, mesh), mesh, LORA.replace(experts=True))
    with pytest.raises(
        ValueError,
        match=r"PEFT export supports adapters on attention and dense MLP projections "
        r"\(HF nn\.Linear\); model\.layers\.0\.mlp\.experts\.down_proj has transform "
        r"experts_stack_transpose in the mixtral table$",
    ):
        export_peft(lora_model, tmp_path / "peft")
    custom = get_config("qwen3-tiny").replace(family="custom")  # no conversion table
    lora_model = apply_lora(placed_model(custom, mesh), mesh, LORA)
    with pytest.raises(
        ValueError, match=r"^family 'custom' has no conversion table; PEFT export needs one$"
    ):
        export_peft(lora_model, tmp_path / "peft")
    assert not (tmp_path / "peft").exists()


# --- PEFT on transformers (reference env: torch, transformers, peft) --------------------------

# KL(PEFT-on-transformers || native LoRA) per token, fp32 on both sides: the same bound
# as the conversion parity tests; observed ~1e-12.
PEFT_MAX_KL = 1e-6


@pytest.mark.reference
@pytest.mark.devices(8)
# peft 0.21.2 calls transformers' `is_gradient_checkpointing`, which transformers 5.12.1
# deprecates for v6 (FutureWarning); peft's code, not ours.
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.parametrize(
    ("family", "scan"),
    [("llama3", True), pytest.param("gpt_oss", False, marks=pytest.mark.slow)],
    ids=["llama3-scanned", "gpt_oss-unscanned"],
)
def test_peft_adapter_on_transformers_matches_native_lora(tmp_path, family, scan):
    """The exported adapter, loaded by peft onto the transformers model, gives the native
    LoRA model's logits (KL <= 1e-6) on full, right- and left-padded rows."""
    peft = pytest.importorskip("peft", reason="the PEFT comparison needs peft")
    import torch

    from posttrain.conversion import convert_hf_to_native, load_native
    from posttrain.conversion.parity import compare, make_batch, native_logits, positions_for
    from tests import hf_tiny

    hf_dir = hf_tiny.save(hf_tiny.build(family), tmp_path / "hf")
    convert_hf_to_native(hf_dir, tmp_path / "native", fsync=False)
    mesh = sharding.make_mesh({"fsdp": 2, "tensor": 4})
    base = sharding.shard_model(load_native(tmp_path / "native", scan_layers=scan), mesh)
    lora_model = apply_lora(base, mesh, LORA)
    randomise_adapters(lora_model)
    export_peft(lora_model, tmp_path / "peft")

    tokens, mask = make_batch(lora_model.config.vocab_size)
    native = native_logits(lora_model, tokens, mask)
    hf = hf_tiny.build(family)  # same seed: the weights saved above
    model = peft.PeftModel.from_pretrained(hf, tmp_path / "peft").eval()
    with torch.no_grad():
        out = model(
            input_ids=torch.as_tensor(tokens, dtype=torch.long),
            attention_mask=torch.as_tensor(mask, dtype=torch.long),
            position_ids=torch.as_tensor(positions_for(mask), dtype=torch.long),
            use_cache=False,
        )
    parity = compare(out.logits.float().numpy(), native, mask)
    assert parity.mean_kl <= PEFT_MAX_KL, parity.line()
    base_parity = compare(out.logits.float().numpy(), native_logits(base, tokens, mask), mask)
    assert base_parity.mean_kl > 100 * PEFT_MAX_KL, "the adapter should change the logits"


def test_iter_adapters_skips_non_string_attribute_keys(monkeypatch):
    """flax 0.12.0's nnx.List keeps items under int keys (found by the matrix, tunix-0.1.1)."""
    import types

    from posttrain.lora import layout

    list_like = types.SimpleNamespace()
    vars(list_like)[0] = "an item"  # what vars(nnx.List) holds in flax 0.12.0
    monkeypatch.setattr(layout._compat, "iter_modules", lambda model: [(("layers",), list_like)])
    assert list(layout.iter_adapters(object())) == []


@pytest.mark.devices(8)
def test_merge_refuses_a_model_without_adapters_and_unmerge_a_foreign_one():
    """merge_lora of a model apply_lora did not build names the fix; unmerge_lora with the
    adapters of another model names (up to 4 of) the adapted weights the merged one lacks."""
    mesh = sharding.make_mesh({"fsdp": 8})
    base = placed_model(get_config("llama3-tiny"), mesh)
    with pytest.raises(ValueError, match=r"^model has no lora_config; build it with posttrain"):
        merge_lora(base)
    tiny = get_config("llama3-tiny")
    deeper = tiny.replace(
        num_layers=tiny.num_layers + 1, layer_types=(*tiny.layer_types, tiny.layer_types[-1])
    )
    other = apply_lora(placed_model(deeper, mesh), mesh, LORA)  # its last layer's are extra
    with pytest.raises(ValueError) as caught:
        unmerge_lora(base, other)
    message = str(caught.value)
    assert re.fullmatch(r"adapted weights \[.*\] are not in the model", message), message
    assert message.count("'") == 2 * 4  # the first 4 of them
