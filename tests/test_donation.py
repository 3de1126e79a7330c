"""The SFT step donates the model with the optimizer (issues 54, 55): Tunix's ``nnx.jit``
donates the optimizer only, so each step wrote the parameters (LoRA: the frozen base too) to
new buffers beside the old ones. :meth:`posttrain.training.step.SFTStep.jit_train_step` is
the one definition of what is donated, run by the trainer and compiled by the plan."""

from __future__ import annotations

import functools
import importlib.util
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from posttrain import _compat, sharding, tokenizer
from posttrain.lora import LoraConfig, apply_lora
from posttrain.models import build_model, get_config
from posttrain.plan import abstract, steps
from posttrain.training import data, default_data, tunix_compat
from posttrain.training.policy import TunixPolicy, reference_of
from posttrain.training.step import arrays_held_beside
from tests.meshes import fitted

pytestmark = pytest.mark.matmul_precision("highest")

tunix = pytest.importorskip("tunix.sft.peft_trainer", reason="google-tunix is not installed")

from posttrain.training.trainer import SFTOptions, SFTTrainer  # noqa: E402

MESH = fitted({"fsdp": 4, "tensor": 2})
LORA = LoraConfig(rank=4, alpha=8.0)
BATCH, SEQ = 8, 64
# what the step returns beside the state (loss, its terms, the gradient norm: float32
# scalars): 676 bytes on the CPU, one 4 KiB tile on a v5e; the model is 368 KiB and more
RESULT_BYTES = 64 * 1024


class Undonated(SFTTrainer):
    """The trainer with Tunix's own donation (the optimizer only): the reference."""

    def donated_argnames(self):
        return self.convention.donated


@functools.cache
def rows():
    """Packed 64-token rows with short questions, so every row has many target tokens."""
    conversations = [
        [{"role": "user", "content": user["content"][: 8 + 4 * (i % 7)]}, assistant]
        for i, (user, assistant) in enumerate(default_data.pydoc_conversations()[:60])
    ]
    examples = data.encode_dataset(conversations, tokenizer.byte_tokenizer(), SEQ)
    return data.to_rows(examples, SEQ, packing=True)


def make_trainer(lora: bool, cls=SFTTrainer, *, ga: int = 1, steps: int = 2):
    mesh = sharding.make_mesh(MESH)
    model = build_model(get_config("qwen3-tiny"), mesh, seed=0)
    if lora:
        model = apply_lora(model, mesh, LORA)
    config = tunix.TrainingConfig(
        eval_every_n_steps=1000,
        max_steps=steps,
        gradient_accumulation_steps=ga if ga > 1 else None,
    )
    return cls(model, optax.adamw(1e-2), config, options=SFTOptions(mesh=mesh)), mesh


def arrays(holder) -> list[jax.Array]:
    """Every array ``holder``'s Variables hold now."""
    return [
        _compat.variable_value(v) for _, v in nnx.iter_graph(holder) if isinstance(v, nnx.Variable)
    ]


def device_bytes(holder) -> int:
    """Bytes of ``holder``'s arrays on one device (each array's shard)."""
    return sum(
        int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize for x in arrays(holder)
    )


def unaliased_output_bytes(jitted, trainer, mesh) -> int:
    """Per-device output bytes of the compiled step that are not its donated inputs'."""
    inputs = steps.sft_inputs(mesh, BATCH, SEQ)
    with sharding.use_mesh(mesh):
        compiled = jitted.lower(trainer.model, trainer.optimizer, inputs).compile()
    memory = compiled.memory_analysis()
    return memory.output_size_in_bytes - memory.alias_size_in_bytes


@pytest.mark.parametrize(
    "lora",
    # the gate compiles the full model's step (every parameter aliased); LoRA's frozen base
    # donated is test_donating_the_model_changes_no_result[lora]'s (all its arrays deleted)
    [False, pytest.param(True, marks=pytest.mark.slow)],
    ids=["full", "lora"],
)
def test_the_compiled_step_writes_the_model_into_its_own_buffers(lora):
    """Against Tunix's donation in the same test, the step's outputs that need new buffers
    shrink by the model's bytes: every parameter, LoRA's frozen base included (nnx.jit
    returns it too, so undonated it was copied every step)."""
    trainer, mesh = make_trainer(lora)
    try:
        assert trainer.donated_argnames() == ("model", *trainer.convention.donated)
        tunix_only = nnx.jit(
            trainer.create_train_step_fn(), donate_argnames=trainer.convention.donated
        )
        before = unaliased_output_bytes(tunix_only, trainer, mesh)
        after = unaliased_output_bytes(trainer.jit_train_step(), trainer, mesh)
        # exactly the model's bytes on the CPU; a TPU lays small arrays out in whole tiles
        # (v5e: 582144 for 367936, 4096 left), so padding can only add
        assert before - after >= device_bytes(trainer.model), (before, after)
        assert after <= RESULT_BYTES, (before, after)
    finally:
        trainer.abandon()


def train(lora: bool, cls) -> tuple[list[dict], list[np.ndarray], list[bool]]:
    """Three optimizer steps of two micro-batches through Tunix's ``train``: the records,
    the final parameters, and which of the model's arrays before training were deleted."""
    trainer, _ = make_trainer(lora, cls, ga=2, steps=3)
    before = arrays(trainer.model)
    trainer.train(data.batches(rows(), BATCH, 2))
    params = [np.asarray(x) for x in arrays(trainer.model)]
    return trainer.history, params, [x.is_deleted() for x in before]


@pytest.mark.parametrize(
    "lora",
    # the gate trains the LoRA model (its frozen base donated too); the full model's
    # donation is the compiled step's above and test_the_plan_compiles_what_the_trainer_runs'
    [pytest.param(False, marks=pytest.mark.slow), True],
    ids=["full", "lora"],
)
def test_donating_the_model_changes_no_result(lora):
    """Bit for bit the same losses, gradient norms and parameters as Tunix's donation, with
    gradient accumulation; the model's arrays are donated (deleted) only by ours."""
    history, params, deleted = train(lora, SFTTrainer)
    history_ref, params_ref, deleted_ref = train(lora, Undonated)
    assert all(deleted) and not any(deleted_ref)
    keys = ("step", "loss", "grad_norm", "target_tokens")
    assert [{k: r[k] for k in keys} for r in history] == [
        {k: r[k] for k in keys} for r in history_ref
    ]
    assert len(history) == 3
    for got, want in zip(params, params_ref, strict=True):
        np.testing.assert_array_equal(got, want)


def plan_donated(program) -> set[str]:
    """The step arguments (model, optimizer) whose every leaf the plan's program donates."""
    lowered = program.jitted.lower(*program.args, **program.kwargs)
    pure_args, _ = lowered.args_info
    return {
        name
        for name, info in zip(("model", "optimizer"), pure_args, strict=False)
        if all(a.donated for a in jax.tree.leaves(info))
    }


def test_the_plan_compiles_what_the_trainer_runs():
    """The plan's step donates the arguments whose arrays the trainer's real step (Tunix's
    ``train``, its binding) deletes: changing either side alone fails here."""
    trainer, mesh = make_trainer(lora=False, steps=1)
    holders = {"model": trainer.model, "optimizer": trainer.optimizer}
    before = {name: arrays(holder) for name, holder in holders.items()}
    trainer.train(data.batches(rows(), BATCH, 1))
    ran = {name for name, xs in before.items() if all(x.is_deleted() for x in xs)}
    assert not any(x.is_deleted() for name in holders.keys() - ran for x in before[name])

    model = abstract.abstract_model(get_config("qwen3-tiny"))
    program = steps.sft_program(model, mesh, optimizer="adamw", batch=BATCH, seq=SEQ, grad_accum=1)
    assert plan_donated(program) == ran == {"model", "optimizer"}


def test_the_plan_jits_grpo_as_tunix_does():
    """GRPO's actor is Tunix's trainer, whose model the sampler shares: its plan donates
    what Tunix's ``jit_train_and_eval_step`` does (read from its source), the optimizer."""
    from tunix.rl import trainer as rl_trainer

    assert tunix_compat.donated_by(rl_trainer.Trainer) == tunix_compat.detect().donated
    assert "model" not in tunix_compat.donated_by(rl_trainer.Trainer)


JIT = """
def jit_train_and_eval_step(self, skip_jit=False):
    self._jitted_train_step_fn = nnx.jit(train_step{donate})
    return self._jitted_train_step_fn, None
"""


def _trainer_class(tmp_path, donate: str) -> type:
    """A class whose ``jit_train_and_eval_step`` jits the step with ``donate`` (its source
    in a file: ``donated_by`` reads it as it reads Tunix's)."""
    source = textwrap.indent(textwrap.dedent(JIT.format(donate=donate)), "    ")
    path = tmp_path / "fake_trainer.py"
    path.write_text(f"class Trainer:\n{source}")
    spec = importlib.util.spec_from_file_location("fake_trainer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Trainer


@pytest.mark.parametrize(
    ("donate", "names"),
    [
        (', donate_argnames=("optimizer",)', ("optimizer",)),
        (', donate_argnames=("optimizer", "grad_accumulator")', ("optimizer", "grad_accumulator")),
        (', donate_argnames="optimizer"', ("optimizer",)),
        ("", ()),
    ],
    ids=["release", "main", "one-string", "none"],
)
def test_what_tunix_donates_is_read_from_its_source(donate, names, tmp_path):
    assert tunix_compat.donated_by(_trainer_class(tmp_path, donate)) == names


def test_donated_names_that_are_not_a_literal_are_an_error(tmp_path):
    cls = _trainer_class(tmp_path, ", donate_argnames=names")
    with pytest.raises(tunix_compat.UnknownConventionError, match="names is not a literal"):
        tunix_compat.donated_by(cls)


def test_installed_tunix_donates_the_optimizer():
    """The installed release's own jit (google-tunix 0.0.2-0.1.7: the optimizer; main adds
    its gradient accumulator) is what the convention records."""
    convention = tunix_compat.detect()
    assert convention.donated == tunix_compat.donated_by(tunix.PeftTrainer)
    assert convention.donated[0] == "optimizer"


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_dpo_reference_keeps_no_array_the_step_donates(lora):
    """reference_of: with LoRA the reference shares the policy's base Variables (it reads
    the step's new arrays), without it has its own copies: neither loses an array."""
    mesh = sharding.make_mesh(MESH)
    model = build_model(get_config("qwen3-tiny"), mesh, seed=0)
    if lora:
        model = apply_lora(model, mesh, LORA)
    policy = TunixPolicy(model)
    assert arrays_held_beside(policy, [reference_of(policy)]) == []


def test_arrays_held_beside_names_each_array_by_its_path():
    """Another module's own Variables over the model's arrays are named by the model's
    paths ('/'-joined); one sharing the model's Variables holds nothing beside it."""

    class Inner(nnx.Module):
        def __init__(self):
            self.kernel = nnx.Param(jnp.ones((2, 3)))

    class Pair(nnx.Module):
        def __init__(self):
            self.inner = Inner()
            self.bias = nnx.Param(jnp.zeros(3))

    model = Pair()
    graphdef, state = nnx.split(model)
    copied = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))  # new Variables, same arrays
    assert sorted(arrays_held_beside(model, [copied])) == ["bias", "inner/kernel"]
    assert arrays_held_beside(model, [nnx.merge(graphdef, state)]) == []


def test_a_module_holding_the_model_arrays_elsewhere_stops_the_donation():
    """A module beside the model holding its arrays in Variables of its own (a reference
    copied as nnx.merge did before flax 0.12) would lose them: the model is not donated,
    and that module stays readable after training."""
    trainer, _ = make_trainer(lora=False, steps=1)
    graphdef, state = nnx.split(trainer.model)
    trainer.shadow = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))  # new Variables
    held = arrays_held_beside(trainer.model, [trainer.shadow])
    assert len(held) == len(arrays(trainer.model))
    assert trainer.donated_argnames() == trainer.convention.donated
    trainer.train(data.batches(rows(), BATCH, 1))
    assert not any(x.is_deleted() for x in arrays(trainer.shadow))


def train_dpo(lora: bool, undonated: bool):
    """Two DPO steps of two micro-batches (the policy and its reference_of): the records,
    the final policy, whether each of the policy's own arrays (not the reference's) before
    training was deleted, whether each array the reference holds after training is, and
    what the step donated."""
    from posttrain.preference import data as pdata
    from posttrain.preference import tunix_dpo
    from posttrain.preference.default_data import pydoc_pairs
    from posttrain.preference.trainer import DPOTrainer

    class UndonatedDPO(DPOTrainer):
        def donated_argnames(self):
            return self.convention.donated

    mesh = sharding.make_mesh(MESH)
    model = build_model(get_config("qwen3-tiny"), mesh, seed=0)
    if lora:
        model = apply_lora(model, mesh, LORA)
    policy = TunixPolicy(model)
    reference = reference_of(policy)
    config = tunix_dpo.training_config(
        algorithm="dpo",
        beta=0.1,
        label_smoothing=0.0,
        lambda_orpo=0.1,
        eval_every_n_steps=1000,
        max_steps=2,
        gradient_accumulation_steps=2,
    )
    cls = UndonatedDPO if undonated else DPOTrainer
    trainer = cls(policy, reference, optax.sgd(0.5), config, options=SFTOptions(mesh=mesh))
    donated = trainer.donated_argnames()
    # the reference's forward (Tunix's nnx.jit) writes new arrays into the Variables it
    # shares with a LoRA policy before each step: only the policy's own are the step's
    shared = {id(v) for _, v in nnx.iter_graph(reference) if isinstance(v, nnx.Variable)}
    own = [
        _compat.variable_value(v)
        for _, v in nnx.iter_graph(trainer.model)
        if isinstance(v, nnx.Variable) and id(v) not in shared
    ]
    pairs = pdata.encode_pairs(
        pydoc_pairs()[0][:16],
        tokenizer.byte_tokenizer(),
        max_prompt_length=24,
        max_response_length=40,
    )
    trainer.train(data.batches(pairs, 4, 2))
    deleted = ([x.is_deleted() for x in own], [x.is_deleted() for x in arrays(reference)])
    return trainer.history, [np.asarray(x) for x in arrays(trainer.model)], deleted, donated


# slow tier: DPO's step is SFT's (SFTStep.jit_train_step, the one definition of what is
# donated), whose bit-for-bit run against Tunix's donation is the gate's above; the gate's
# real LoRA DPO runs donate the policy and read the reference after every step
# (contracts/test_tunix_dpo.py), and the reference holds no donated array
# (test_dpo_reference_keeps_no_array_the_step_donates, both cases)
@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_dpo_donates_the_policy_and_its_reference_stays_readable(lora):
    """DPO shares the step: the policy is donated, the reference never (with LoRA it shares
    the policy's base Variables and reads their new arrays; without, it is a copy), and the
    records and the policy are bit for bit those of Tunix's donation."""
    history, params, (policy_deleted, reference_deleted), donated = train_dpo(lora, False)
    history_ref, params_ref, (kept, _), _ = train_dpo(lora, True)
    assert "model" in donated
    assert policy_deleted and all(policy_deleted) and not any(kept)
    assert not any(reference_deleted)
    assert len(history) == 2
    assert [(r["loss"], r["grad_norm"]) for r in history] == [
        (r["loss"], r["grad_norm"]) for r in history_ref
    ]
    for got, want in zip(params, params_ref, strict=True):
        np.testing.assert_array_equal(got, want)


def test_our_step_is_bound_as_tunix_bound_its_own():
    """Unbound (google-tunix <= 0.1.5), ``partial(jitted, model, optimizer)``, and the
    cached partial (``cache_nnx_graph``), each with ``jitted_fn`` where Tunix's ``train``
    reads it; a partial of other objects than the convention's is an error."""
    model, other = nnx.Linear(2, 3, rngs=nnx.Rngs(0)), nnx.Linear(2, 3, rngs=nnx.Rngs(1))
    jitted = nnx.jit(lambda model, x: model(x))
    tunix_step = nnx.jit(lambda model, x: model(x))
    assert tunix_compat.bind_like(tunix_step, jitted, ()) is jitted
    bound = tunix_compat.bind_like(functools.partial(tunix_step, model), jitted, (model,))
    assert bound.func is jitted and bound.args == (model,)
    cached = tunix_compat.bind_like(functools.partial(lambda x: x), jitted, (model,))
    assert cached.func.jitted_fn is jitted.jitted_fn
    x = np.ones((1, 2), np.float32)
    np.testing.assert_array_equal(cached(x), model(x))
    with pytest.raises(tunix_compat.UnknownConventionError, match="bound 1 objects"):
        tunix_compat.bind_like(functools.partial(tunix_step, other), jitted, (model,))
