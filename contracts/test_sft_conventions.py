"""SFTTrainer under every Tunix train-step convention: the installed release for real,
the others through emulated ``PeftTrainer`` classes (``tunix_emulation.py``) that call
the step exactly as those releases' ``train()`` does."""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

pytestmark = pytest.mark.matmul_precision("highest")

tunix = pytest.importorskip("tunix.sft.peft_trainer", reason="google-tunix is not installed")

from contracts import tunix_emulation as te  # noqa: E402
from posttrain import sharding, tokenizer  # noqa: E402
from posttrain.models import build_model, get_config  # noqa: E402
from posttrain.training import data, default_data, tunix_compat  # noqa: E402
from posttrain.training.trainer import SFTOptions, SFTTrainer, sft_trainer_class  # noqa: E402
from posttrain.training.tunix_compat import OptimizerStateCheckpoints  # noqa: E402
from tests.meshes import fitted  # noqa: E402

EMULATED = te.EMULATED
# installed: the installed release's own train() (bound2 on 0.1.6/0.1.7, positional3
# before); the other conventions are emulated, so all of them run whatever is installed.
BASES = te.contract_bases()
by_convention = te.by_convention
MESH = fitted({"fsdp": 4, "tensor": 2})  # as at 8 devices, the default


@functools.cache
def rows():
    """60 rows of 64 tokens whose target counts differ from row to row (6 to 37) and so
    from micro-batch to micro-batch (293 and 312 in the first step). The questions are
    cut to 8-32 characters: whole pydoc questions fill the 64 tokens and leave every row
    one target token, and with equal counts per micro-batch a step that divides each
    micro-batch by its own count (not the step's) gives the same update."""
    conversations = [
        [{"role": "user", "content": user["content"][: 8 + 4 * (i % 7)]}, assistant]
        for i, (user, assistant) in enumerate(default_data.pydoc_conversations()[:60])
    ]
    examples = data.encode_dataset(conversations, tokenizer.byte_tokenizer(), 64)
    return data.to_rows(examples, 64, packing=True)


def make_trainer(base, ga, *, tx=None, steps=2, seed=0, checkpoint_root=None):
    mesh = sharding.make_mesh(MESH)
    model = build_model(get_config("qwen3-tiny"), mesh, seed=seed)
    cls = SFTTrainer if base is None else sft_trainer_class(base)
    # eval_every_n_steps: google-tunix <= 0.1.2 requires a multiple of GA (no eval runs).
    config = tunix.TrainingConfig(
        eval_every_n_steps=ga * 1000,
        max_steps=steps,
        gradient_accumulation_steps=ga if ga > 1 else None,
        checkpoint_root_directory=checkpoint_root,
    )
    return cls(model, tx or optax.sgd(0.1), config, options=SFTOptions(mesh=mesh)), mesh


def params(model) -> dict[str, np.ndarray]:
    return {
        "/".join(map(str, p)): np.asarray(v[...])
        for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


@pytest.mark.contract("tunix.sft.peft_trainer.PeftTrainer.create_train_step_fn")
@pytest.mark.parametrize("name", by_convention(BASES))
def test_step_parameters_are_the_names_tunix_donates(name):
    """nnx.jit donates by name: (model, optimizer[, grad_accumulator], inputs[, is_update_step])."""
    base = BASES[name] or tunix.PeftTrainer
    convention = tunix_compat.detect(base)
    trainer = object.__new__(sft_trainer_class(base))
    trainer.convention = convention
    trainer._step_body = None
    step = trainer.create_train_step_fn()
    assert tuple(inspect.signature(step).parameters) == convention.step_parameters
    own = tuple(inspect.signature(base._train_step).parameters)[1:]  # Tunix's own step
    assert own == convention.step_parameters


@pytest.mark.contract("tunix.sft.peft_trainer.PeftTrainer.train")
# the emulated conventions' real runs in the slow tier (gate budget); the matrix runs them
@pytest.mark.parametrize("name", by_convention(BASES, emulated_slow=True))
@pytest.mark.wiring
def test_steps_run_and_params_change_only_on_update_steps(name):
    # GA 2 over 12-row micro-batches: the step program of accumulated() below, so the
    # gate's persistent compilation cache compiles it once for both tests.
    trainer, mesh = make_trainer(BASES[name], ga=2)
    convention = trainer.convention
    traces = []  # one entry per trace of the step body
    body = trainer._step_body

    def counted(*args):
        traces.append(None)
        return body(*args)

    trainer._step_body = counted
    batches = data.batches(rows(), 12, 2)
    snapshots = [params(trainer.model)]
    with sharding.use_mesh(mesh):
        step, _ = trainer.jit_train_and_eval_step()
        for micro in range(6):
            batch = trainer._prepare_inputs(next(batches))
            if convention.name == "positional3":
                out = step(trainer.model, trainer.optimizer, batch)
            elif convention.name == "bound2":
                out = step(batch)
            else:
                out = step(batch, is_update_step=jnp.array(micro % 2 == 1, jnp.bool_))
            assert len(out) == convention.returns
            assert np.isfinite(float(out[0]))
            snapshots.append(params(trainer.model))

    def changed(a, b):
        return any(not np.array_equal(a[k], b[k]) for k in a)

    updates = [changed(a, b) for a, b in zip(snapshots, snapshots[1:], strict=False)]
    assert updates == [False, True, False, True, False, True]
    # Traced (so compiled) once: a state array that comes back from the first step
    # with another sharding than it went in with makes every run compile the step twice.
    assert len(traces) == 1, f"the step was traced {len(traces)} times in 6 micro-steps"


ALL_BASES = {"installed": None, **EMULATED}


@functools.cache
def one_large_batch(name="installed"):
    """Reference: 2 optimizer steps of one 24-row batch each (no accumulation, so every
    convention runs the same step; the installed release's train() computes it)."""
    trainer, _ = make_trainer(ALL_BASES[name], ga=1)
    trainer.train(data.batches(rows(), 24, 1))  # train() makes the mesh current
    return params(trainer.model), logged(trainer)


def accumulated(name, accumulator=None):
    """2 optimizer steps of 2 micro-batches of 12 rows (the same rows, in the same order).
    Two, the smallest window: a step that mistakes 2 for 1 (or 1 for 2) applies the
    wrong sum here."""
    trainer, _ = make_trainer(ALL_BASES[name], ga=2)
    if accumulator is not None:
        trainer.grad_accumulator = accumulator(trainer.model, nnx.Param)
    trainer.train(data.batches(rows(), 12, 2))
    return params(trainer.model), logged(trainer)


def logged(trainer) -> dict[str, list[float]]:
    """The logged ``loss`` and ``grad_norm`` of each optimizer step."""
    return {k: [r[k] for r in trainer.history] for k in ("loss", "grad_norm")}


@pytest.mark.contract("tunix gradient accumulation (optax.MultiSteps / GradientAccumulator)")
# main's accumulator stays in the gate: the installed release (MultiSteps) never takes the
# step's GradientAccumulator branch, and a bug there passed the gate (mutation testing)
@pytest.mark.parametrize(
    "name", by_convention(BASES, emulated_slow=True, in_gate=("bound3_update",))
)
def test_accumulated_steps_equal_one_large_batch(name):
    """k micro-steps == one step on the concatenated batch, from the first micro-step on:
    the same params, the same logged loss and the same logged grad_norm (the norm of the
    applied gradient, not of the last micro-step's share)."""
    want, want_logged = one_large_batch()
    got, got_logged = accumulated(name)
    assert len(got_logged["loss"]) == len(want_logged["loss"]) == 2
    np.testing.assert_allclose(got_logged["loss"], want_logged["loss"], rtol=1e-6)
    np.testing.assert_allclose(got_logged["grad_norm"], want_logged["grad_norm"], rtol=1e-5)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], atol=1e-6, rtol=0, err_msg=k)
    assert any(
        not np.allclose(want[k], params(build_model(get_config("qwen3-tiny"), seed=0))[k])
        for k in want
    )  # training moved them


# Defined only where it runs: a skip would rank below pass in the matrix's contract cells.
if "bound3_update" in BASES and te.installed_convention() != "bound3_update":

    @pytest.mark.contract("tunix.sft.peft_trainer.PeftTrainer.train")
    @pytest.mark.slow  # an emulated convention's run (gate budget); the matrix runs it
    def test_main_without_accumulation_steps_as_the_installed_release():
        """Emulated main without accumulation (every call an update step) gives the
        installed release's params and losses (no installable release has main's step)."""
        want, want_logged = one_large_batch()
        got, got_logged = one_large_batch("bound3_update")
        np.testing.assert_allclose(got_logged["loss"], want_logged["loss"], rtol=1e-6)
        for k in want:
            np.testing.assert_allclose(got[k], want[k], atol=1e-6, rtol=0, err_msg=k)


class SkipsWhenEmpty(te.GradientAccumulator):
    """The old bypass: ``add`` does nothing while the accumulator looks empty."""

    def add(self, grads, denom=None):
        empty = self.denom[...] == 0
        for buf, g in zip(self.grads, jax.tree.leaves(grads), strict=True):
            buf[...] = jnp.where(empty, buf[...], buf[...] + g.astype(buf[...].dtype))
        self.denom[...] = self.denom[...] + (1.0 if denom is None else denom)


@pytest.mark.contract("tunix.sft.peft_trainer.GradientAccumulator (main)")
@pytest.mark.convention("bound3_update")
@pytest.mark.slow  # an emulated convention's run (gate budget); the matrix runs it
@pytest.mark.skipif(
    te.not_applicable("bound3_update") is not None,
    reason=str(te.not_applicable("bound3_update")),
)
def test_the_equality_check_catches_the_empty_accumulator_bypass():
    want, _ = one_large_batch()
    got, _ = accumulated("bound3_update", accumulator=SkipsWhenEmpty)
    worst = max(float(np.abs(got[k] - want[k]).max()) for k in want)
    assert worst > 1e-4, worst


class FourthConvention(tunix.PeftTrainer):
    """A made-up future release: the step gets a step counter as a second argument."""

    def train(self, train_ds, eval_ds=None, skip_jit=False):
        train_step, _ = self.jit_train_and_eval_step(skip_jit)
        for train_example in train_ds:
            train_loss, aux, grad_norm, stats = train_step(train_example, self._iter_steps)


@pytest.mark.contract("tunix.sft.peft_trainer.PeftTrainer.train")
def test_an_unknown_convention_fails_at_construction_naming_what_was_found():
    cls = sft_trainer_class(FourthConvention)
    with pytest.raises(tunix_compat.UnknownConventionError) as e:
        cls(
            None,
            optax.sgd(0.1),
            tunix.TrainingConfig(eval_every_n_steps=1),
            options=SFTOptions(mesh=None),
        )
    message = str(e.value)
    assert "calls step(train_example, self._iter_steps)" in message
    assert "unpacks 4 values" in message and "\n" not in message


@pytest.mark.contract("tunix.sft.checkpoint_manager.CheckpointManager.save")
@pytest.mark.slow  # gate budget; the matrix runs it in every row (it matters up to 0.1.5)
def test_optimizer_state_checkpoints_fill_in_for_releases_that_skip_it(tmp_path):
    """google-tunix <= 0.1.5 checkpoints params only; the wrapper saves and restores OptState."""
    root = str(tmp_path / "checkpoints")
    first, _ = make_trainer(None, ga=2, tx=optax.adam(1e-2), checkpoint_root=root)
    checked = first.checkpoint_manager  # CheckedSaves around what the release needs
    if not isinstance(checked._inner, OptimizerStateCheckpoints):  # 0.1.6+: force it
        checked._inner = OptimizerStateCheckpoints(checked._inner, root, lambda: first.optimizer)
    first.train(data.batches(rows(), 8, 2))  # 2 steps, saved at close()

    def opt_state(trainer):
        return nnx.state(trainer.optimizer, nnx.optimizer.OptState)

    want = [np.asarray(x) for x in jax.tree.leaves(opt_state(first))]
    second, _ = make_trainer(None, ga=2, tx=optax.adam(1e-2), checkpoint_root=root)
    assert second.train_steps == 2
    wrapper = OptimizerStateCheckpoints(second.checkpoint_manager, root, lambda: second.optimizer)
    nnx.update(second.optimizer, jax.tree.map(jnp.zeros_like, opt_state(second)))
    wrapper.restore(2)
    got = [np.asarray(x) for x in jax.tree.leaves(opt_state(second))]
    assert len(got) == len(want) and any(np.abs(w).sum() > 0 for w in want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    with pytest.raises(RuntimeError, match="has no optimizer state for it"):
        wrapper.restore(7)
