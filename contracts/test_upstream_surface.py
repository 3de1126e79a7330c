"""Contracts on the upstream surface posttrain uses: Tunix, Qwix, Flax NNX, Orbax.

Each test names the symbol it pins (``contract`` marker), so that a rename or a
changed behaviour in a new release is one readable failing cell in the matrix,
not an AttributeError deep inside training.
"""

from __future__ import annotations

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from posttrain import _compat, sharding


# --- Tunix -----------------------------------------------------------------------------
@pytest.mark.contract("tunix.sft.peft_trainer.TrainingConfig")
def test_tunix_training_config_has_the_fields_we_set():
    peft_trainer = pytest.importorskip("tunix.sft.peft_trainer")
    fields = {f.name for f in dataclasses.fields(peft_trainer.TrainingConfig)}
    used = {
        "eval_every_n_steps",
        "max_steps",
        "gradient_accumulation_steps",
        "checkpoint_root_directory",
        "checkpointing_options",
        "metrics_logging_options",
        "data_sharding_axis",
    }
    assert used <= fields, sorted(used - fields)
    config = peft_trainer.TrainingConfig(eval_every_n_steps=2)
    assert config.get_with_default("gradient_accumulation_steps", 1) == 1


@pytest.mark.contract("tunix.sft.peft_trainer.PeftTrainer")
def test_tunix_peft_trainer_methods_we_call_or_override():
    peft_trainer = pytest.importorskip("tunix.sft.peft_trainer")
    cls = peft_trainer.PeftTrainer
    for name in (
        "train",
        "jit_train_and_eval_step",
        "create_train_step_fn",
        "create_eval_step_fn",
        "_prepare_inputs",
        "_post_process_train_step",
        "close",
        "with_loss_fn",
        "with_gen_model_input_fn",
        "train_steps",
    ):
        assert hasattr(cls, name), name
    assert tuple(inspect.signature(cls.__init__).parameters)[1:4] == (
        "model",
        "optimizer",
        "training_config",
    )
    for name in ("_prepare_inputs", "_post_process_train_step"):
        assert len(inspect.signature(getattr(cls, name)).parameters) == 2, name


@pytest.mark.contract("tunix.sft.peft_trainer.PeftTrainer.__init__")
def test_tunix_trainer_state_we_read_and_lora_detection(tmp_path):
    peft_trainer = pytest.importorskip("tunix.sft.peft_trainer")
    model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    trainer = peft_trainer.PeftTrainer(
        model, optax.sgd(0.1), peft_trainer.TrainingConfig(eval_every_n_steps=2)
    )
    for name in (
        "model",
        "optimizer",
        "config",
        "checkpoint_manager",
        "metrics_logger",
        "_lora_enabled",
        "_train_steps",
        "_iter_steps",
        "loss_fn",
        "eval_loss_fn",
        "gen_model_input_fn",
        "_has_aux",
    ):
        assert hasattr(trainer, name), name
    assert trainer._lora_enabled is False and trainer.train_steps == 0
    assert trainer.with_loss_fn(lambda m, **kw: 0.0, has_aux=True) is trainer


@pytest.mark.contract("optax.MultiSteps (mini_step, acc_grads: the window's running mean)")
def test_multisteps_window_gradient_is_what_multisteps_applies():
    """_compat.multisteps_window_gradient reads MultiSteps' state: at the window's last
    micro-step it equals the mean of the window's gradients, the gradient MultiSteps hands
    the inner optimizer (plain SGD with lr 1 shows it as the parameter change)."""
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.MultiSteps(optax.sgd(1.0), 3), wrt=nnx.Param)
    before = jax.tree.map(lambda x: np.asarray(x), nnx.state(model, nnx.Param))
    grads = [
        jax.tree.map(lambda p, i=i: jnp.full_like(p, i + 1.0), nnx.state(model, nnx.Param))
        for i in range(3)
    ]
    for g in grads[:2]:
        optimizer.update(model, g)
    window = _compat.multisteps_window_gradient(optimizer.opt_state, grads[2])
    assert window is not None
    optimizer.update(model, grads[2])
    after = nnx.state(model, nnx.Param)
    for w, b, a in zip(
        jax.tree.leaves(window), jax.tree.leaves(before), jax.tree.leaves(after), strict=True
    ):
        np.testing.assert_allclose(np.asarray(w), 2.0)  # mean of 1, 2, 3
        np.testing.assert_allclose(np.asarray(b) - np.asarray(a), np.asarray(w), rtol=1e-6)
    plain = nnx.Optimizer(model, optax.sgd(1.0), wrt=nnx.Param)
    assert _compat.multisteps_window_gradient(plain.opt_state, grads[0]) is None


@pytest.mark.contract("optax: the run optimizer keeps a +-inf parameter that gets no gradient")
def test_the_run_optimizer_keeps_an_infinite_parameter_with_no_gradient():
    """The SFT/DPO optimizer (``training.optimizer.adam_schedule``) leaves a parameter of +-inf
    with a zero gradient at +-inf through its schedule (the vision tower's clip bounds
    until a checkpoint sets them, frozen or not), and moves a finite one against its
    gradient. optax 0.2.6's ``adamw(weight_decay=0.0)`` added ``0 * inf``: NaN from the
    first step (seen in the google-tunix 0.1.6 era row's vision run)."""
    from posttrain.sft.options import SFTConfig
    from posttrain.training.optimizer import adam_schedule

    _, tx = adam_schedule(SFTConfig(steps=4, warmup_steps=1))
    params = {"bound": jnp.array([-jnp.inf, jnp.inf]), "w": jnp.array([1.0, -2.0])}
    grads = {"bound": jnp.zeros(2), "w": jnp.array([0.5, -0.5])}
    state = tx.init(params)
    for _ in range(3):
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    np.testing.assert_array_equal(params["bound"], [-np.inf, np.inf])
    assert params["w"][0] < 1.0 and params["w"][1] > -2.0


@pytest.mark.contract("orbax.checkpoint.CheckpointManagerOptions(enable_async_checkpointing)")
def test_orbax_sync_saves_option():
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(save_interval_steps=2, enable_async_checkpointing=False)
    assert options.enable_async_checkpointing is False


@pytest.mark.contract("orbax.checkpoint.checkpoint_managers.save_decision_policy")
def test_checkpoints_follow_the_interval_without_a_first_step_save(tmp_path):
    """Our options save every N steps and not also the first (Orbax's default adds an
    InitialSavePolicy); an Orbax without the policies would fall back to saving step 1,
    which this test reports."""
    import orbax.checkpoint as ocp

    options = _compat.interval_checkpoint_options(3, max_to_keep=2)
    manager = ocp.CheckpointManager(tmp_path, options=options)
    assert [step for step in range(1, 8) if manager.should_save(step)] == [3, 6]


@pytest.mark.contract("tunix.sft.checkpoint_manager.CheckpointManager")
def test_tunix_checkpoint_manager_surface():
    checkpoint_manager = pytest.importorskip("tunix.sft.checkpoint_manager")
    cls = checkpoint_manager.CheckpointManager
    assert tuple(inspect.signature(cls.__init__).parameters)[1:3] == ("root_directory", "options")
    for name in ("save", "maybe_restore", "latest_step", "close"):
        assert hasattr(cls, name), name
    save = tuple(inspect.signature(cls.save).parameters)
    assert save[1:3] == ("step", "model") and "save_only_lora_params" in save


@pytest.mark.contract("tunix.sft.metrics_logger.MetricsLoggerOptions")
def test_tunix_metrics_logger_options():
    metrics_logger = pytest.importorskip("tunix.sft.metrics_logger")
    options = metrics_logger.MetricsLoggerOptions(log_dir="/tmp/x", flush_every_n_steps=3)
    assert options.log_dir == "/tmp/x" and options.flush_every_n_steps == 3


# --- Qwix ------------------------------------------------------------------------------
@pytest.mark.contract("qwix.LoraRule / qwix.apply_lora_to_model")
def test_qwix_lora_creates_lora_params_on_the_targeted_module():
    qwix = pytest.importorskip("qwix")
    rule = inspect.signature(qwix.LoraRule).parameters
    assert {"module_path", "rank", "alpha", "weight_qtype", "tile_size"} <= set(rule)

    class Tiny(nnx.Module):
        def __init__(self):
            self.a = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
            self.b = nnx.Linear(8, 4, rngs=nnx.Rngs(1))

        def __call__(self, x):
            return self.b(self.a(x))

    provider = qwix.LoraProvider([qwix.LoraRule(module_path="a", rank=2, alpha=2.0)])
    kwargs = {"rngs": nnx.Rngs(0)} if _compat.qwix_takes_rngs(qwix.apply_lora_to_model) else {}
    model = qwix.apply_lora_to_model(Tiny(), provider, jnp.ones((2, 8)), **kwargs)
    lora = {"/".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))}
    assert sorted(lora) == ["a/kernel_lora_a", "a/kernel_lora_b"], sorted(lora)
    shapes = {k: _compat.variable_value(v).shape for k, v in lora.items()}
    assert shapes == {"a/kernel_lora_a": (8, 2), "a/kernel_lora_b": (2, 8)}


@pytest.mark.contract("qwix QLoRA weight_qtype")
def test_qwix_qlora_weight_types_we_offer():
    """Each offered type round-trips through Qwix's quantiser as ``apply_lora`` calls it
    (``qwix.quantize`` from qwix 0.1.4, the internal ``qarray.quantize`` before, via
    ``_compat``), per channel and in tiles."""
    pytest.importorskip("qwix")
    from qwix._src.core.qarray import HowToQuantize

    from posttrain.lora.config import WEIGHT_QTYPES

    x = jnp.asarray(np.random.default_rng(0).normal(size=(16, 8)), jnp.float32)
    for qtype in WEIGHT_QTYPES:
        for tiled_axes in ({}, {0: 4}):  # qwix 0.1.0 has no defaults for the last two
            how = HowToQuantize(
                qtype=qtype,
                channelwise_axes=(1,),
                tiled_axes=tiled_axes,
                calibration_method="absmax",
            )
            back = _compat.qwix_dequantize(_compat.qwix_quantize(x, how))
            # 4-bit types: half a level step over [-absmax, absmax] per channel; NF4's
            # outer step is 0.28 of absmax (Dettmers et al. 2023, QLoRA, appendix E).
            absmax = jnp.abs(x).max(axis=0)
            assert back.shape == x.shape and bool((jnp.abs(back - x) <= 0.15 * absmax).all()), (
                qtype,
                how.tiled_axes,
                float(jnp.abs(back - x).max()),
            )


@pytest.mark.contract("qwix QLoRA weight_qtype")
def test_the_offered_fp8_base_type_is_e4m3fn():
    """The FP8 QLoRA type we offer quantises to OCP's E4M3FN (no infinity, max 448), the
    ``--qlora float8_e4m3fn`` the CLI names, not the IEEE-style E4M3 (max 240): absmax
    calibration puts each channel's largest value at the type's max, 448."""
    pytest.importorskip("qwix")
    from qwix._src.core.qarray import HowToQuantize

    from posttrain.lora.config import WEIGHT_QTYPES

    x = jnp.asarray(np.random.default_rng(0).normal(size=(16, 8)), jnp.float32)
    fp8 = [qtype for qtype in WEIGHT_QTYPES if qtype.startswith("float8")]
    assert fp8
    for qtype in fp8:
        how = HowToQuantize(
            qtype=qtype, channelwise_axes=(1,), tiled_axes={}, calibration_method="absmax"
        )
        q = _compat.qwix_quantize(x, how).qvalue
        assert q.dtype == jnp.float8_e4m3fn, qtype
        assert float(jnp.abs(q.astype(jnp.float32)).max()) == 448.0, qtype


@pytest.mark.contract("qwix QLoRA weight_qtype")
# the matrix runs it in every row; the gate's QLoRA model is tests/test_lora.py's (every
# adapted weight quantised, B = 0 logits near the float model's, dequantised near float)
@pytest.mark.slow
def test_qwix_qlora_applies_to_our_model():
    """``apply_lora(weight_qtype=...)``: Qwix quantises every adapted base weight of a
    tiny model and adds adapters; the dequantised weights are the float ones and the
    model's logits are near the float model's (B = 0)."""
    pytest.importorskip("qwix")
    from posttrain.lora import LoraConfig, apply_lora, base_weights
    from posttrain.models import build_model, flat_params, get_config

    devices = jax.devices()[:2]  # two where there are, the one chip of a single-TPU host
    mesh = sharding.make_mesh({"fsdp": len(devices)}, devices=devices)
    base = build_model(get_config("qwen3-tiny"), mesh)
    want = flat_params(base)
    model = apply_lora(base, mesh, LoraConfig(rank=2, alpha=4.0, weight_qtype="int8"))
    assert [p for p, _ in nnx.to_flat_state(nnx.state(model)) if "qvalue" in p]
    got = {".".join(map(str, p)): np.asarray(v) for p, v in base_weights(model).items()}
    assert got.keys() == want.keys(), sorted(got.keys() ^ want.keys())
    for key, w in want.items():  # int8 per channel: half a step is absmax / 254
        np.testing.assert_allclose(got[key], w, atol=np.abs(w).max() / 200, err_msg=key)
    tokens = jnp.arange(16, dtype=jnp.int32).reshape(2, 8)
    forward = nnx.jit(lambda m, t: m(t)[0])  # eager, each op of Qwix's einsum would dispatch
    with sharding.use_mesh(mesh):
        logits, quantised_logits = (np.asarray(forward(m, tokens)) for m in (base, model))
    np.testing.assert_allclose(quantised_logits, logits, atol=0.05 * np.abs(logits).max())


# --- Flax NNX --------------------------------------------------------------------------
@pytest.mark.contract("flax.nnx split/merge/Optimizer(wrt=)/LoRAParam")
def test_nnx_split_merge_and_optimizer_wrt_lora_only():
    class WithLora(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((3, 3)))
            self.lora = nnx.LoRAParam(jnp.zeros((3, 3)))

    assert issubclass(nnx.LoRAParam, nnx.Param)
    model = WithLora()
    graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
    assert len(jax.tree.leaves(lora)) == 1 and len(jax.tree.leaves(rest)) == 1
    merged = nnx.merge(graphdef, lora, rest)
    assert np.array_equal(np.asarray(merged.w[...]), np.ones((3, 3)))
    optimizer = nnx.Optimizer(model, optax.sgd(1.0), wrt=nnx.LoRAParam)
    grads = jax.tree.map(jnp.ones_like, nnx.state(model, nnx.LoRAParam))
    optimizer.update(model, grads)
    assert np.array_equal(np.asarray(model.lora[...]), -np.ones((3, 3)))
    assert np.array_equal(np.asarray(model.w[...]), np.ones((3, 3)))


@pytest.mark.contract("flax.nnx.cond / nnx.jit donate_argnames")
def test_nnx_cond_mutates_graph_state_inside_a_donating_jit():
    class Counter(nnx.Module):
        def __init__(self):
            self.n = nnx.Variable(jnp.zeros((), jnp.float32))

    def step(optimizer, flag):
        def bump(c):
            c.n[...] = c.n[...] + 1.0
            return jnp.ones(())

        def keep(c):
            return jnp.zeros(())

        return nnx.cond(flag, bump, keep, optimizer)

    counter = Counter()
    jitted = nnx.jit(step, donate_argnames=("optimizer",))
    for flag in (False, True, True, False):
        jitted(counter, jnp.array(flag))
    assert float(counter.n[...]) == 2.0


# --- Orbax -----------------------------------------------------------------------------
@pytest.mark.contract("orbax.checkpoint PyTreeSave/PyTreeRestore of sharded NNX state")
def test_orbax_round_trip_keeps_values_and_shardings(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    mesh = sharding.make_mesh({"fsdp": jax.device_count()})
    spec = jax.sharding.PartitionSpec("fsdp")
    model = nnx.Linear(jax.device_count() * 2, 3, rngs=nnx.Rngs(0))
    state = nnx.state(model)
    state = jax.tree.map(
        lambda x: jax.device_put(
            x,
            jax.sharding.NamedSharding(mesh, spec if x.ndim == 2 else jax.sharding.PartitionSpec()),
        ),
        state,
    )
    manager = ocp.CheckpointManager(
        tmp_path / "ckpt", options=ocp.CheckpointManagerOptions(create=True)
    )
    manager.save(1, args=ocp.args.PyTreeSave(state))
    manager.wait_until_finished()
    target = jax.tree.map(jnp.zeros_like, state)
    restored = manager.restore(
        1,
        args=ocp.args.PyTreeRestore(
            item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target=target)
        ),
    )
    manager.close()
    for want, got in zip(jax.tree.leaves(state), jax.tree.leaves(restored), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert got.sharding.is_equivalent_to(want.sharding, want.ndim)


@pytest.mark.contract(
    "orbax.checkpoint ArrayHandler._use_replica_parallel (_compat.single_replica_array_saves)"
)
@pytest.mark.devices(2)  # two replicas of each shard: the slices a replica-parallel save makes
def test_orbax_single_replica_saves_slice_nothing_and_restore_the_same(tmp_path, monkeypatch):
    """Replica-parallel Orbax splits a replicated array between its replicas (one eager
    ``jax.lax.slice_in_dim`` each); inside ``single_replica_array_saves`` it slices
    nothing, and both checkpoints restore the same values and shardings."""
    ocp = pytest.importorskip("orbax.checkpoint")
    mesh = sharding.make_mesh({"data": 2, "fsdp": jax.device_count() // 2})
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
    # Replicated over `data`; each shard [8, 256] has axes the 2 replicas divide.
    state = {"w": jax.device_put(jnp.arange(8 * mesh.shape["fsdp"] * 256.0).reshape(-1, 256), spec)}
    target = jax.tree.map(jnp.zeros_like, state)
    manager = ocp.CheckpointManager(
        tmp_path / "ckpt", options=ocp.CheckpointManagerOptions(create=True)
    )
    slices, slice_in_dim = [], jax.lax.slice_in_dim

    def counted(*args, **kwargs):
        slices.append(kwargs.get("axis"))
        return slice_in_dim(*args, **kwargs)

    def save_and_count(step) -> int:
        start = len(slices)
        with monkeypatch.context() as patch:
            patch.setattr(jax.lax, "slice_in_dim", counted)
            manager.save(step, args=ocp.args.PyTreeSave(state))
            manager.wait_until_finished()
        return len(slices) - start

    handler = ocp.type_handlers.get_type_handler(jax.Array)
    assert isinstance(handler._use_replica_parallel, bool)  # the attribute the shim switches
    # Orbax's default on CPU and TPU (off when JAX_PLATFORMS names gpu/cuda): set here.
    monkeypatch.setattr(handler, "_use_replica_parallel", True)
    assert save_and_count(1) >= 2  # replica-parallel: one slice per replica
    with _compat.single_replica_array_saves():
        with _compat.single_replica_array_saves():  # nested (or another thread's) use
            assert handler._use_replica_parallel is False
        assert handler._use_replica_parallel is False  # the outer one still holds it
        assert save_and_count(2) == 0
    assert handler._use_replica_parallel is True  # restored by the last one out
    restore_args = ocp.checkpoint_utils.construct_restore_args(target=target)
    for step in (1, 2):
        got = manager.restore(
            step, args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args)
        )
        np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(state["w"]))
        assert got["w"].sharding.is_equivalent_to(spec, 2)
    manager.close()


@pytest.mark.contract("jax.stages.Compiled.memory_analysis")
def test_jax_memory_analysis_has_the_fields_the_plan_reads_and_a_live_peak_within_them():
    """``Compiled.memory_analysis()`` (XLA's CompiledMemoryStats) has every field
    ``posttrain.plan.report.MEMORY_FIELDS`` reads, and its ``peak_memory_in_bytes`` (the
    plan's peak, issue 54) counts the arguments: at least them, and on the CPU at most
    arguments + outputs + temporaries (every buffer live at once)."""
    from posttrain.plan import report

    def step(x, w):
        h = jnp.tanh(x @ w)
        return jnp.sin(h @ w) @ h.T

    x, w = jnp.ones((256, 512)), jnp.ones((512, 512))
    compiled = jax.jit(step).lower(x, w).compile()
    memory, figures = compiled.memory_analysis(), report.memory_of(compiled)
    assert set(figures) == set(report.MEMORY_FIELDS)
    assert figures["live_peak"] == memory.peak_memory_in_bytes
    assert figures["arguments"] == x.nbytes + w.nbytes
    assert figures["arguments"] <= figures["live_peak"], figures
    if jax.default_backend() == "cpu":  # XLA:CPU's heap simulation: every buffer at most
        everything = figures["arguments"] + figures["outputs"] + figures["temporaries"]
        assert figures["live_peak"] <= everything, figures
    # On the v5e (the tier, 2026-12-06) this step's peak was 3 MiB beside 1.5 MiB of
    # arguments, 0.25 MiB of outputs and no temporaries: the TPU's figure is not bounded by
    # the sum. What it is worth there is checked against the runtime (tests/test_plan_chip.py).
