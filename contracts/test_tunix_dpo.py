"""Contracts on Tunix's DPO/ORPO trainer around our policy (``posttrain.preference``): the
matrix's dpo cells. Each release row runs them against its installed Tunix; facts from
``shared/research/tunix-rl.md`` 4 and 7, as observed here."""

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
from posttrain import sharding  # noqa: E402
from posttrain.models import build_model, get_config  # noqa: E402
from posttrain.preference import data as pdata  # noqa: E402
from posttrain.preference import tunix_dpo  # noqa: E402
from posttrain.preference.default_data import pydoc_pairs  # noqa: E402
from posttrain.preference.trainer import DPOTrainer, dpo_trainer_class  # noqa: E402
from posttrain.tokenizer import byte_tokenizer  # noqa: E402
from posttrain.training import data as sft_data  # noqa: E402
from posttrain.training import tunix_compat  # noqa: E402
from posttrain.training.policy import TunixPolicy, reference_of  # noqa: E402
from posttrain.training.trainer import SFTOptions  # noqa: E402
from tests import transcendentals  # noqa: E402
from tests.meshes import fitted  # noqa: E402

# The conventions the gradient-accumulation contract runs under (as the SFT ones).
BASES = te.contract_bases()
by_convention = te.by_convention
MESH = fitted({"fsdp": 4, "tensor": 2})
PROMPT, RESPONSE = 24, 40  # tokens: short rows keep the contracts fast


@functools.cache
def pairs() -> dict[str, np.ndarray]:
    train, _ = pydoc_pairs()
    return pdata.encode_pairs(
        train[:48], byte_tokenizer(), max_prompt_length=PROMPT, max_response_length=RESPONSE
    )


def config(*, ga=1, steps=2, algorithm="dpo", beta=0.1, label_smoothing=0.0):
    return tunix_dpo.training_config(
        algorithm=algorithm,
        beta=beta,
        label_smoothing=label_smoothing,
        lambda_orpo=0.1,
        eval_every_n_steps=ga * 1000,
        max_steps=steps,
        gradient_accumulation_steps=ga if ga > 1 else None,
    )


def make_trainer(base=None, *, ga=1, steps=2, algorithm="dpo", lora=False, seed=0):
    mesh = sharding.make_mesh(MESH)
    model = build_model(get_config("qwen3-tiny"), mesh, seed=seed)
    if lora:
        from posttrain.lora import LoraConfig, apply_lora

        model = apply_lora(model, mesh, LoraConfig(rank=4, alpha=8.0, seed=seed))
    policy = TunixPolicy(model)
    reference = None if algorithm == "orpo" else reference_of(policy)
    cls = DPOTrainer if base is None else dpo_trainer_class_over(base)
    trainer = cls(
        policy,
        reference,
        optax.sgd(0.5),
        config(ga=ga, steps=steps, algorithm=algorithm),
        options=SFTOptions(mesh=mesh),
    )
    return trainer, mesh


def dpo_trainer_class_over(peft_base: type) -> type:
    """Our trainer over the installed DPO trainer over an emulated ``PeftTrainer``.

    The emulated loops replace the installed ``train`` and its metric buffers, which the
    installed DPO trainer's metric hooks append to (0.1.6+); those hooks are the
    ``PeftTrainer`` base's here (our step records come from our own hook either way)."""
    dpo = tunix_dpo.trainer_class()
    hooks = {
        name: getattr(tunix.PeftTrainer, name)
        for name in ("_post_process_train_step", "_post_process_eval_step")
    }
    return dpo_trainer_class(type(f"{dpo.__name__}[{peft_base.__name__}]", (dpo, peft_base), hooks))


def params(model, which=nnx.Param) -> dict[str, np.ndarray]:
    return {
        "/".join(map(str, p)): np.asarray(v[...])
        for p, v in nnx.to_flat_state(nnx.state(model, which))
    }


BASE = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))  # LoRAParam subclasses Param


# --- the surface --------------------------------------------------------------------


@pytest.mark.contract("tunix.sft.dpo DPOTrainer constructor and config")
def test_the_trainer_and_config_have_the_fields_we_pass():
    params_ = tuple(inspect.signature(tunix_dpo.trainer_class().__init__).parameters)[1:5]
    assert params_ == ("model", "ref_model", "optimizer", "training_config")
    fields = tunix_dpo.config_fields()
    assert {"beta", "label_smoothing", "gradient_accumulation_steps", "max_steps"} <= fields
    # ORPO and its weight arrive together (0.1.4); the adapter offers it exactly then.
    assert ("orpo" in tunix_dpo.available_algorithms()) == ("lambda_orpo" in fields)
    assert (
        tunix_dpo.training_config(
            algorithm="dpo", beta=0.3, label_smoothing=0.1, lambda_orpo=0.2, eval_every_n_steps=10
        ).beta
        == 0.3
    )
    if "orpo" not in tunix_dpo.available_algorithms():
        with pytest.raises(ValueError, match="ORPO arrives in google-tunix 0.1.4"):
            config(algorithm="orpo")


@pytest.mark.contract("tunix.sft.dpo TrainExample and input keys")
@pytest.mark.slow  # the matrix runs it in every row
def test_tokenized_inputs_become_one_stacked_batch_with_reference_logps():
    trainer, mesh = make_trainer()
    batch = {k: v[:8] for k, v in pairs().items()}
    with sharding.use_mesh(mesh, jax_context=False):
        example = trainer._prepare_inputs(batch)
    assert example.input_ids.shape == (16, PROMPT + RESPONSE)
    assert example.completion_mask.shape == (16, RESPONSE)
    assert example.logits_to_keep == RESPONSE
    assert example.ref_chosen_logps.shape == example.ref_rejected_logps.shape == (8,)
    np.testing.assert_array_equal(
        np.asarray(example.input_ids[8:, :PROMPT]), np.asarray(example.input_ids[:8, :PROMPT])
    )


# --- the losses, by hand --------------------------------------------------------------


class FixedLogits(nnx.Module):
    """Tunix's calling convention over fixed logits ``[batch, seq, vocab]``."""

    def __init__(self, logits):
        self.logits = nnx.Param(jnp.asarray(logits, jnp.float32))

    def __call__(self, input_tokens, positions=None, cache=None, attention_mask=None):
        return self.logits[...], None


def _hand_case(seed=0):
    """One pair, prompt 1 token, completions 2 tokens (vocab 3); the summed completion
    log-probabilities by hand in NumPy."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(2, 3, 3)).astype(np.float32)
    ids = np.array([[2, 0, 1], [2, 1, 1]], np.int32)  # [chosen; rejected] rows
    mask = np.ones((2, 2), np.int32)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    picked = np.take_along_axis(logp[:, :-1], ids[:, 1:, None], -1)[..., 0].sum(-1)
    return logits, ids, mask, picked[0], picked[1]


def _example(ids, mask, ref=(0.0, 0.0)):
    return tunix_dpo.train_example(
        input_ids=jnp.asarray(ids),
        positions=jnp.tile(jnp.arange(ids.shape[1], dtype=jnp.int32), (2, 1)),
        attention_mask=jnp.tril(jnp.ones((2, ids.shape[1], ids.shape[1]), bool)),
        ref_chosen_logps=jnp.asarray([ref[0]], jnp.float32),
        ref_rejected_logps=jnp.asarray([ref[1]], jnp.float32),
        completion_mask=jnp.asarray(mask),
        logits_to_keep=mask.shape[1],
    )


def _log_sigmoid(x):
    return -np.log1p(np.exp(-x))


@pytest.mark.contract("tunix.sft.dpo dpo_loss_fn")
@pytest.mark.parametrize("beta, smoothing", [(0.1, 0.0), (0.5, 0.2)])
def test_the_dpo_loss_is_the_smoothed_sigmoid_of_beta_times_the_log_ratio_margin(beta, smoothing):
    logits, ids, mask, chosen, rejected = _hand_case()
    ref = (-1.3, -2.9)
    delta = (chosen - ref[0]) - (rejected - ref[1])
    want = -(_log_sigmoid(beta * delta) * (1 - smoothing) + _log_sigmoid(-beta * delta) * smoothing)
    hyper = tunix_dpo._hyper(beta=beta, label_smoothing=smoothing, algorithm="dpo")
    loss, metrics = tunix_dpo.loss_and_metrics(
        tunix_dpo.loss_fn()(FixedLogits(logits), train_example=_example(ids, mask, ref), **hyper)
    )
    # float32 on the backend against float64: the log-softmax's log and log-sigmoid's log1p
    # are within 4,034 ulp on a TPU v2-v5e (tests/transcendentals.py), a few on the CPU
    rtol = transcendentals.rtol(1e-5, "log", "log1p")
    np.testing.assert_allclose(float(loss), want, rtol=rtol)
    np.testing.assert_allclose(float(metrics["log_probs/chosen"]), chosen, rtol=rtol)
    scale = beta if tunix_dpo.rewards_are_scaled() else 1.0
    np.testing.assert_allclose(
        float(metrics["rewards/chosen"]), scale * (chosen - ref[0]), rtol=rtol
    )


@pytest.mark.contract("tunix.sft.dpo dpo_loss_fn (ORPO)")
@pytest.mark.skipif(
    "orpo" not in tunix_dpo.available_algorithms(), reason="ORPO arrives in google-tunix 0.1.4"
)
def test_the_orpo_loss_is_the_nll_plus_lambda_times_the_odds_ratio_loss():
    """google-tunix 0.1.4-0.1.7: the completion's NLL averaged over its length, plus
    lambda x the odds-ratio loss of the *summed* log-probabilities. Main (beaf9f3b,
    bc24e57f) rewrote it: the loss function's ``average_log_prob_orpo`` (default False)
    averages both terms or neither, so its defaults give the *summed* NLL, and no flag
    gives the older mix; ``enable_prompt_loss_orpo`` adds the prompt to the NLL (its
    trainer config defaults both to True). Pinned per release, by feature."""
    logits, ids, mask, chosen, rejected = _hand_case(seed=1)
    lam, smoothing, length = 0.25, 0.1, mask[0].sum()

    def orpo(nll, chosen, rejected):
        log_odds = (chosen - rejected) - (np.log1p(-np.exp(chosen)) - np.log1p(-np.exp(rejected)))
        odds = -(_log_sigmoid(log_odds) * (1 - smoothing) + _log_sigmoid(-log_odds) * smoothing)
        return nll + lam * odds

    def loss_with(**flags):
        hyper = tunix_dpo._hyper(
            lambda_orpo=lam, label_smoothing=smoothing, algorithm="orpo", **flags
        )
        return tunix_dpo.loss_and_metrics(
            tunix_dpo.loss_fn()(FixedLogits(logits), train_example=_example(ids, mask), **hyper)
        )

    loss, metrics = loss_with()
    if "average_log_prob_orpo" in inspect.signature(tunix_dpo.loss_fn()).parameters:
        np.testing.assert_allclose(float(loss), orpo(-chosen, chosen, rejected), rtol=1e-5)
        averaged, _ = loss_with(average_log_prob_orpo=True)
        want = orpo(-chosen / length, chosen / length, rejected / length)
        np.testing.assert_allclose(float(averaged), want, rtol=1e-5)
    else:
        want = orpo(-chosen / length, chosen, rejected)
        np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["rewards/chosen"]), lam * chosen, rtol=1e-5)


# --- the trainer around our policy ----------------------------------------------------


@pytest.mark.contract("tunix.sft.dpo eval loss")
@pytest.mark.slow  # the matrix runs it in every row
def test_the_eval_step_runs_the_preference_loss():
    """google-tunix <= 0.1.2 set only ``loss_fn``: its eval ran PeftTrainer's default
    loss on DPO inputs (``shared/research/tunix-rl.md`` 7, bug 3)."""
    trainer, mesh = make_trainer()
    batch = {k: v[:8] for k, v in pairs().items()}
    with sharding.use_mesh(mesh, jax_context=False):
        example = trainer._prepare_inputs(batch)
        eval_step = trainer.create_eval_step_fn()
        inputs = trainer.gen_model_input_fn(example)
        want, _ = tunix_dpo.loss_and_metrics(tunix_dpo.loss_fn()(trainer.model, **inputs))
        if (
            tunix_compat.detect().name == "positional3"
            or "model" in inspect.signature(eval_step).parameters
        ):
            out = eval_step(trainer.model, example)
        else:
            out = eval_step(example)
    loss, aux = out
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-6)
    assert set(tunix_dpo.METRICS) <= set(aux)


@functools.cache
def one_large_batch():
    trainer, _ = make_trainer(ga=1)
    trainer.train(sft_data.batches(pairs(), 24, 1))
    return params(trainer.model), [r["loss"] for r in trainer.history]


@pytest.mark.contract("tunix.sft.dpo gradient accumulation")
@pytest.mark.slow  # the matrix runs it in every row
@pytest.mark.parametrize("name", by_convention(BASES))
def test_accumulated_dpo_steps_equal_one_large_batch(name):
    """3 micro-batches of 8 pairs == one batch of 24, for 2 optimizer steps: the same
    params and the same logged loss, under the installed and the emulated conventions."""
    want, want_loss = one_large_batch()
    trainer, _ = make_trainer(BASES[name], ga=3)
    trainer.train(sft_data.batches(pairs(), 8, 3))
    got = params(trainer.model)
    assert len(trainer.history) == 2
    np.testing.assert_allclose([r["loss"] for r in trainer.history], want_loss, rtol=1e-6)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], atol=1e-6, rtol=0, err_msg=k)
    initial = params(TunixPolicy(build_model(get_config("qwen3-tiny"), seed=0)))
    assert any(not np.allclose(want[k], initial[k]) for k in want)  # training moved them


@pytest.mark.contract("tunix.sft.dpo gradient accumulation")
@pytest.mark.convention("installed")
def test_an_accumulated_lora_dpo_step_equals_one_large_batch():
    """The gate's cut of the contract above (the installed convention, LoRA, one step):
    2 micro-batches of 4 pairs == one batch of 8, the same adapters and the same logged
    loss. A gradient not divided by the accumulation (or divided twice) moves the
    adapters twice (or half) as far."""
    runs = {}
    for ga, size in ((1, 8), (2, 4)):
        trainer, _ = make_trainer(lora=True, steps=1, ga=ga)
        before = params(trainer.model, nnx.LoRAParam)
        trainer.train(sft_data.batches({k: v[:8] for k, v in pairs().items()}, size, ga))
        after = params(trainer.model, nnx.LoRAParam)
        runs[ga] = after, [r["loss"] for r in trainer.history]
    (want, want_loss), (got, got_loss) = runs[1], runs[2]
    assert len(got_loss) == 1
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], atol=1e-6, rtol=0, err_msg=k)
    assert any(not np.allclose(want[k], before[k]) for k in want)  # the step moved them


@pytest.mark.contract("tunix.sft.dpo metrics")
def test_each_logged_metric_equals_its_computation_from_the_same_batch():
    """One DPO step on 8 pairs, the adapters moved off zero first (so the policy is not
    the reference): every logged figure equals its definition (``PreferenceMetrics``)
    computed here from the same batch, the summed completion log-probabilities of the
    policy and the reference from Tunix's ``compute_logps``: rewards ``beta x`` the
    log-ratio (whatever the release reports), their margin and accuracy, the
    log-probabilities, the loss ``-log sigmoid(margin)``, the tokens through the policy.
    A figure scaled or averaged twice, or summed instead of averaged, differs."""
    beta = 0.1  # config()'s
    trainer, mesh = make_trainer(lora=True, steps=1)
    lora = nnx.state(trainer.model, nnx.LoRAParam)
    nnx.update(trainer.model, jax.tree.map(lambda x: x + 0.05, lora))
    batch = {k: v[:8] for k, v in pairs().items()}
    with sharding.use_mesh(mesh, jax_context=False):
        example = trainer._prepare_inputs(batch)
        chosen, rejected = tunix_dpo.example_logps(trainer.model, example)
    chosen, rejected = np.asarray(chosen, np.float64), np.asarray(rejected, np.float64)
    reward_c = beta * (chosen - np.asarray(example.ref_chosen_logps, np.float64))
    reward_r = beta * (rejected - np.asarray(example.ref_rejected_logps, np.float64))
    assert np.ptp(reward_c - reward_r) > 1e-3  # the pairs differ: a real check below
    trainer.train(sft_data.batches(batch, 8, 1))
    (record,) = trainer.history
    margin = reward_c - reward_r
    want = {
        "rewards_chosen": reward_c.mean(),
        "rewards_rejected": reward_r.mean(),
        "reward_margin": margin.mean(),
        "preference_accuracy": (margin > 0).mean(),
        "logps_chosen": chosen.mean(),
        "logps_rejected": rejected.mean(),
        "loss": np.mean(np.logaddexp(0.0, -margin)),  # -log sigmoid(margin)
    }
    for key, value in want.items():
        np.testing.assert_allclose(record[key], value, rtol=2e-5, atol=1e-6, err_msg=key)
    tokens = 2 * batch["prompt_mask"].sum() + batch["chosen_mask"].sum()
    assert record["tokens"] == tokens + batch["rejected_mask"].sum()


@pytest.mark.contract("tunix.sft.dpo DPOTrainer over our policy")
@pytest.mark.parametrize(
    "algorithm",
    ["dpo", pytest.param("orpo", marks=pytest.mark.slow)],  # the gate: one run
)
def test_a_short_run_logs_every_metric_and_the_lora_reference_stays_the_base(algorithm):
    if algorithm not in tunix_dpo.available_algorithms():
        pytest.skip("ORPO arrives in google-tunix 0.1.4")  # the contract cell reads skip
    trainer, mesh = make_trainer(lora=True, steps=3, algorithm=algorithm)
    base = params(trainer.model, BASE)
    batch = {k: v[:8] for k, v in pairs().items()}
    reference = trainer.ref_model
    if reference is not None:
        with sharding.use_mesh(mesh, jax_context=False):
            before = trainer._prepare_inputs(batch)
    trainer.train(sft_data.batches(pairs(), 8, 1))
    records = trainer.history
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        for key in ("loss", "rewards_chosen", "reward_margin", "preference_accuracy", "tokens"):
            assert np.isfinite(r[key]), (key, r)
    after = params(trainer.model, BASE)
    assert base and all(
        np.array_equal(base[k], after[k]) for k in base
    )  # LoRA leaves the base alone
    lora = nnx.state(trainer.model, nnx.LoRAParam)
    assert any(np.any(np.asarray(x) != 0) for x in jax.tree.leaves(lora))
    if reference is not None:
        with sharding.use_mesh(mesh, jax_context=False):
            again = trainer._prepare_inputs(batch)
        np.testing.assert_allclose(
            np.asarray(again.ref_chosen_logps), np.asarray(before.ref_chosen_logps), atol=1e-6
        )
        # ... and they are the base model's (no adapters at all), through Tunix's logps
        base_model = TunixPolicy(build_model(get_config("qwen3-tiny"), mesh, seed=0))
        with sharding.use_mesh(mesh, jax_context=False):
            chosen, rejected = tunix_dpo.compute_logps()(
                base_model,
                again.input_ids,
                again.positions,
                again.attention_mask,
                again.logits_to_keep,
                again.completion_mask,
            )[:2]
        np.testing.assert_allclose(np.asarray(again.ref_chosen_logps), chosen, atol=1e-5)
        np.testing.assert_allclose(np.asarray(again.ref_rejected_logps), rejected, atol=1e-5)
