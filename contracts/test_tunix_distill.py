"""Contracts on Tunix's distillation trainer and logit strategy around our models
(``posttrain.distill``): each release row runs them against its installed Tunix. Facts
read from google-tunix 0.1.5 and 0.1.7's ``tunix/distillation`` sources."""

from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

pytestmark = pytest.mark.matmul_precision("highest")

pytest.importorskip("tunix.distillation", reason="the installed Tunix has no tunix.distillation")

from posttrain import sharding, tokenizer  # noqa: E402
from posttrain.distill import loss as distill_loss  # noqa: E402
from posttrain.distill import tunix_distill  # noqa: E402
from posttrain.distill.trainer import (  # noqa: E402
    distill_trainer_class,
    held_out_kl,
    labels_fn,
    model_logits,
    shallower,
)
from posttrain.models import build_model, get_config  # noqa: E402
from posttrain.training import data, default_data  # noqa: E402
from posttrain.training.trainer import SFTOptions  # noqa: E402
from tests.meshes import fitted  # noqa: E402

MESH = fitted({"fsdp": 4, "tensor": 2})
TOP_K = 5 if tunix_distill.has_top_k() else 0


def strategy(*, temperature=2.0, alpha=0.3, distill_top_k=0, cls=None):
    if cls is None:
        return tunix_distill.logit_strategy(
            model_logits,
            model_logits,
            labels_fn(264),
            temperature=temperature,
            alpha=alpha,
            distill_top_k=distill_top_k,
        )
    extra = {"distill_top_k": distill_top_k} if tunix_distill.has_top_k() else {}
    return cls(
        model_logits, model_logits, labels_fn(264), temperature=temperature, alpha=alpha, **extra
    )


# --- the surface --------------------------------------------------------------------


@pytest.mark.contract("tunix.distillation.DistillationTrainer constructor")
def test_the_trainer_takes_student_teacher_strategy_optimizer_config():
    params = tuple(inspect.signature(tunix_distill.trainer_class().__init__).parameters)[1:]
    assert params == ("student_model", "teacher_model", "strategy", "optimizer", "training_config")
    # the teacher runs in _prepare_inputs (through the strategy), outside the step
    source = inspect.getsource(tunix_distill.trainer_class()._prepare_inputs)
    assert "get_teacher_outputs" in source


@pytest.mark.contract("tunix.distillation.strategies.LogitStrategy arguments")
def test_the_logit_strategy_takes_the_arguments_we_pass():
    params = tunix_distill.strategy_parameters("logit")
    assert params[:3] == ("student_forward_fn", "teacher_forward_fn", "labels_fn")
    assert {"temperature", "alpha"} <= set(params)
    assert tunix_distill.has_top_k() == ("distill_top_k" in params)
    s = strategy(temperature=3.0, alpha=0.25)
    assert (s.temperature, s.alpha) == (3.0, 0.25)
    for name in tunix_distill.STRATEGIES:  # every strategy the CLI names exists
        assert tunix_distill.strategy_class(name).__name__ == tunix_distill.STRATEGIES[name]


def test_top_k_is_refused_in_one_line_where_the_release_lacks_it():
    if tunix_distill.has_top_k():
        assert strategy(distill_top_k=3).distill_top_k == 3
    else:
        with pytest.raises(ValueError, match=r"^--distill-top-k 3: .*0\.1\.7"):
            strategy(distill_top_k=3)
    with pytest.raises(ValueError, match="^--distill-top-k 3: only --strategy logit truncates"):
        tunix_distill.check_strategy("feature-pooling", 3)


@pytest.mark.contract("tunix.distillation loss output convention")
def test_the_loss_output_convention_matches_the_trainer():
    """0.1.5: strategies return a scalar; 0.1.7: ``(loss, metrics)``, with the trainer's
    ``_standardize_loss_output`` arriving in the same release."""
    convention = tunix_distill.loss_convention()
    standardizes = hasattr(tunix_distill.trainer_class(), "_standardize_loss_output")
    assert convention == ("(loss, metrics)" if standardizes else "scalar")


# --- the loss, by hand --------------------------------------------------------------


def batch(seed=0, b=2, t=6, v=11):
    rng = np.random.default_rng(seed)
    student = jnp.asarray(rng.normal(size=(b, t, v)) * 2, jnp.float32)
    teacher = jnp.asarray(rng.normal(size=(b, t, v)) * 2, jnp.float32)
    tokens = jnp.asarray(rng.integers(0, v, size=(b, t)), jnp.int32)
    mask = jnp.asarray([[0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0]], jnp.int32)
    segments = jnp.asarray([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]], jnp.int32)
    return student, teacher, tokens, mask, segments


def by_hand(student, teacher, tokens, mask, segments, *, temperature, alpha, top_k):
    """sum over targets of alpha T^2 KL(p_T || q_T) + (1 - alpha) CE(q, next token), in
    float64 numpy; top-k: both distributions renormalised over the teacher's top k."""
    s, te, y = (np.asarray(x, np.float64) for x in (student, teacher, tokens))
    total = 0.0
    for i in range(s.shape[0]):
        for t in range(s.shape[1] - 1):
            target = mask[i, t + 1] and segments[i, t + 1] == segments[i, t] and segments[i, t + 1]
            if not target:
                continue
            si, ti = s[i, t], te[i, t]
            if top_k:
                keep = np.argsort(-ti)[:top_k]
                si, ti = si[keep], ti[keep]
            p = np.exp(ti / temperature - np.logaddexp.reduce(ti / temperature))
            log_q = si / temperature - np.logaddexp.reduce(si / temperature)
            kl = np.sum(p * (np.log(p) - log_q))
            ce = -(s[i, t, int(y[i, t + 1])] - np.logaddexp.reduce(s[i, t]))
            total += alpha * temperature**2 * kl + (1 - alpha) * ce
    return total


class TemperatureNotSquared(tunix_distill.strategy_class("logit")):
    """A broken variant: the KL not scaled by T^2."""

    def compute_loss(self, student_output, teacher_output, labels):
        loss, metrics = tunix_distill.loss_and_metrics(
            super().compute_loss(student_output, teacher_output, labels)
        )
        ce = jnp.mean(optax.softmax_cross_entropy(student_output, labels))
        kl_scaled = (loss - (1 - self.alpha) * ce) / self.alpha
        return self.alpha * kl_scaled / self.temperature**2 + (1 - self.alpha) * ce, metrics


@functools.cache
def jitted_terms(cls=None, *, temperature, alpha, top_k=0):
    """``distill_terms`` of the strategy with these settings, as one jitted program (as the
    trainer runs it; on a chip each eager op is a compile of its own)."""
    st = strategy(temperature=temperature, alpha=alpha, distill_top_k=top_k, cls=cls)
    return jax.jit(functools.partial(distill_loss.distill_terms, st))


def ours(s, t, tokens, mask, segments, *, cls=None, temperature, alpha, top_k):
    terms = jitted_terms(cls, temperature=temperature, alpha=alpha, top_k=top_k)
    return float(terms(s, t, tokens, mask, segments)["distill_sum"])


@pytest.mark.contract("tunix.distillation.strategies.LogitStrategy.compute_loss")
@pytest.mark.parametrize(
    # top-k's own case is slow-tier: test_the_written_out_logit_loss_is_tunix_s's top5
    # case holds the top-k loss to Tunix's in the gate
    "top_k",
    [0] + ([pytest.param(TOP_K, marks=pytest.mark.slow, id=str(TOP_K))] if TOP_K else []),
)
def test_the_masked_loss_is_the_hand_computed_one(top_k):
    """Temperature 2, alpha 0.3 (and top-k 5 where the release has it): our masked sum of
    Tunix's per-position loss equals the hand computation; each broken variant does not."""
    s, t, tokens, mask, segments = batch()
    hyper = dict(temperature=2.0, alpha=0.3, top_k=top_k)
    want = by_hand(s, t, tokens, mask, segments, **hyper)
    np.testing.assert_allclose(ours(s, t, tokens, mask, segments, **hyper), want, rtol=1e-5)
    broken = {
        "temperature not squared": ours(
            s, t, tokens, mask, segments, cls=TemperatureNotSquared, **hyper
        ),
        "labels shifted by one": ours(s, t, np.roll(tokens, 1, axis=1), mask, segments, **hyper),
        "prompt and padding in": ours(
            s, t, tokens, np.ones(mask.shape, np.int32), np.ones(segments.shape, np.int32), **hyper
        ),
    }
    for name, value in broken.items():
        assert not np.isclose(value, want, rtol=1e-3), name


#: a teacher with almost no mass on two tokens and a uniform student: KL(p || q) 0.66 and
#: KL(q || p) 2.01 at T 1; 0.45 and 0.73 at T 2 (a temperature evens the two out)
TEACHER_P = np.array([0.497, 0.497, 0.005, 0.001])
STUDENT_Q = np.full(4, 0.25)


def kl_np(p, q):
    return float(np.sum(p * (np.log(p) - np.log(q))))


def tempered(probs, temperature):
    z = np.log(probs) / temperature
    return np.exp(z - np.logaddexp.reduce(z))


@pytest.mark.contract("tunix.distillation.strategies.LogitStrategy.compute_loss")
@pytest.mark.parametrize("temperature", [1.0, 2.0], ids=["T1", "T2"])
@pytest.mark.parametrize("written_out", [True, False], ids=["written-out", "tunix-own"])
def test_the_kl_is_teacher_to_student_on_an_asymmetric_pair(temperature, written_out):
    """On one target position whose teacher and student distributions give KL(p || q) !=
    KL(q || p) by 60% or more, alpha 1: the objective is ``T^2 KL(p_T || q_T)`` (teacher first,
    hand-computed in numpy), through the written-out loss and Tunix's own
    ``compute_loss`` alike; the reported ``kl_sum`` and :func:`kl_to_teacher` are
    ``KL(p || q)`` at temperature 1. The reverse direction is far from each."""
    p_t, q_t = tempered(TEACHER_P, temperature), tempered(STUDENT_Q, temperature)
    forward, reverse = kl_np(p_t, q_t), kl_np(q_t, p_t)
    assert reverse > 1.5 * forward  # the pair is asymmetric
    # [batch 1, seq 2, vocab 4]: position 0 predicts token 1, a target
    s = jnp.asarray(np.log(STUDENT_Q)[None, None].repeat(2, axis=1), jnp.float32)
    t = jnp.asarray(np.log(TEACHER_P)[None, None].repeat(2, axis=1), jnp.float32)
    tokens = jnp.asarray([[0, 2]], jnp.int32)
    mask, segments = jnp.asarray([[0, 1]], jnp.int32), jnp.asarray([[1, 1]], jnp.int32)
    st = strategy(temperature=temperature, alpha=1.0)
    if not written_out:  # a subclass: its own compute_loss, vmapped per position
        st = strategy(temperature=temperature, alpha=1.0, cls=type("Own", (type(st),), {}))

    @jax.jit
    def terms_and_kl(s, t, tokens, mask, segments):
        terms = distill_loss.distill_terms(st, s, t, tokens, mask, segments)
        return terms, distill_loss.kl_to_teacher(s[0, 0], t[0, 0])

    terms, kl_to_teacher = terms_and_kl(s, t, tokens, mask, segments)
    got = float(terms["distill_sum"])
    np.testing.assert_allclose(got, temperature**2 * forward, rtol=1e-5)
    assert not np.isclose(got, temperature**2 * reverse, rtol=0.1)
    kl_1 = kl_np(TEACHER_P, STUDENT_Q)
    for name, value in {
        "kl_sum": float(terms["kl_sum"]),
        "kl_to_teacher": float(kl_to_teacher),
    }.items():
        np.testing.assert_allclose(value, kl_1, rtol=1e-5, err_msg=name)
        assert not np.isclose(value, kl_np(STUDENT_Q, TEACHER_P), rtol=0.1), name


def test_with_every_position_a_target_it_is_tunix_mean_times_the_count():
    """Tunix's own ``compute_loss`` on the whole batch (its mean over every position) x the
    count of positions == our sum when every position is a target."""
    s, t, tokens, _, _ = batch(seed=1)
    st = strategy(temperature=1.5, alpha=0.6, distill_top_k=TOP_K)

    @jax.jit
    def ours_and_tunix_mean(s, t, tokens):
        ones = jnp.ones_like(tokens)
        got = distill_loss.distill_terms(st, s, t, tokens, ones, ones)
        labels = jax.nn.one_hot(tokens[:, 1:], s.shape[-1])
        mean, _ = tunix_distill.loss_and_metrics(st.compute_loss(s[:, :-1], t[:, :-1], labels))
        return got, mean

    got, mean = ours_and_tunix_mean(s, t, tokens)
    np.testing.assert_allclose(
        float(got["distill_sum"]), float(mean) * got["target_tokens"], rtol=1e-5
    )


def test_no_gradient_reaches_the_teacher_logits(monkeypatch):
    s, t, tokens, mask, segments = batch()
    st = strategy(temperature=2.0, alpha=0.5)

    def grad_wrt_teacher():
        def f(teacher):
            return distill_loss.distill_terms(st, s, teacher, tokens, mask, segments)["distill_sum"]

        return np.abs(np.asarray(jax.jit(jax.grad(f))(t))).max()

    assert grad_wrt_teacher() == 0.0
    monkeypatch.setattr(distill_loss, "frozen", lambda x: x)  # broken: not stopped
    assert grad_wrt_teacher() > 1e-3


# --- a real run ---------------------------------------------------------------------


@functools.cache
def rows():
    conversations = [
        [{"role": "user", "content": user["content"][: 8 + 4 * (i % 7)]}, assistant]
        for i, (user, assistant) in enumerate(default_data.pydoc_conversations()[:48])
    ]
    examples = data.encode_dataset(conversations, tokenizer.byte_tokenizer(), 64)
    return data.to_rows(examples, 64, packing=True)


def params(model) -> dict[str, np.ndarray]:
    return {
        "/".join(map(str, p)): np.asarray(v[...])
        for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


def make_trainer(*, ga=1, steps=2, student="qwen3-tiny", teacher="llama3-tiny", tx=None, alpha=1.0):
    mesh = sharding.make_mesh(MESH)
    student_cfg = shallower(get_config(student), 1)
    student_model = build_model(student_cfg, mesh, seed=0)
    teacher_model = build_model(get_config(teacher), mesh, seed=1)
    config = tunix_distill.config_class()(
        eval_every_n_steps=ga * 1000,
        max_steps=steps,
        gradient_accumulation_steps=ga if ga > 1 else None,
    )
    cls = distill_trainer_class()
    trainer = cls(
        student_model,
        teacher_model,
        strategy(temperature=2.0, alpha=alpha),
        tx or optax.adam(1e-2),
        config,
        options=SFTOptions(mesh=mesh),
    )
    return trainer


@pytest.mark.contract("tunix.distillation.DistillationTrainer.train")
# the matrix runs it in every row; the gate's real distillation through the same trainer is
# tests/test_distill_run.py's short run (the held-out KL falls, the teacher bit-identical)
@pytest.mark.slow
def test_a_real_run_moves_the_student_not_the_teacher():
    """4 steps of pure distillation (alpha 1: the random teacher's soft targets, not the
    data, are what the student should move to): the held-out KL to the teacher falls;
    the teacher is bit-identical."""
    trainer = make_trainer(steps=4)
    teacher_before = params(trainer.teacher_model)
    student_before = params(trainer.model)
    held_out = {k: v[-8:] for k, v in rows().items()}
    before = held_out_kl(trainer.model, trainer.teacher_model, held_out)
    trainer.train(data.batches({k: v[:-8] for k, v in rows().items()}, 8, 1))
    after = held_out_kl(trainer.model, trainer.teacher_model, held_out)
    assert len(trainer.history) == 4 and all(np.isfinite(r["loss"]) for r in trainer.history)
    assert after < 0.8 * before, (before, after)
    teacher_after = params(trainer.teacher_model)
    for k, v in teacher_before.items():
        assert np.array_equal(v, teacher_after[k]), k  # bit-identical
    assert any(not np.array_equal(v, params(trainer.model)[k]) for k, v in student_before.items())


def test_another_vocabulary_is_refused():
    mesh = sharding.make_mesh(MESH)
    student = build_model(
        dataclasses.replace(shallower(get_config("qwen3-tiny"), 1), vocab_size=300), mesh
    )
    teacher = build_model(get_config("llama3-tiny"), mesh)
    with pytest.raises(ValueError, match=r"^student vocab_size 300 and teacher vocab_size 264"):
        distill_trainer_class()(
            student,
            teacher,
            strategy(),
            optax.sgd(0.1),
            tunix_distill.config_class()(eval_every_n_steps=10, max_steps=1),
            options=SFTOptions(mesh=mesh),
        )


def one_large_batch_or_accumulated(ga):
    trainer = make_trainer(ga=ga, steps=2, tx=optax.sgd(0.5), alpha=0.5)
    trainer.train(data.batches(rows(), 8 // ga, ga))
    return params(trainer.model), [r["loss"] for r in trainer.history]


@pytest.mark.contract("tunix gradient accumulation (optax.MultiSteps / GradientAccumulator)")
def test_accumulated_steps_equal_one_large_batch():
    """2 micro-batches of 4 rows (their target counts differ) == 1 batch of 8 rows: the
    same student and the same logged loss after 2 optimizer steps."""
    want, want_loss = one_large_batch_or_accumulated(1)
    got, got_loss = one_large_batch_or_accumulated(2)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], atol=1e-6, rtol=0, err_msg=k)


def objective_and_terms(trainer, weight):
    trainer.moe_aux_loss_weight = weight
    with sharding.use_mesh(trainer.mesh):
        inputs = trainer._prepare_inputs(next(data.batches(rows(), 8, 1)))
        objective, terms = trainer._objective(trainer.model, inputs)
    return float(objective), {k: float(v) for k, v in terms.items()}


@pytest.mark.slow  # 8 s; the matrix runs it in every row, the gate runs test_sft_objective
def test_the_students_load_balancing_term_enters_the_objective():
    """A routed student: the objective is the distillation loss + weight x its MoE term."""
    trainer = make_trainer(student="qwen3_moe-tiny")
    plain, terms = objective_and_terms(trainer, 0.0)
    weighted, _ = objective_and_terms(trainer, 0.5)
    assert terms["moe_aux_loss"] > 0
    np.testing.assert_allclose(weighted - plain, 0.5 * terms["moe_aux_loss"], rtol=1e-5)


@pytest.mark.slow  # by construction today (the teacher's forward returns logits only)
def test_the_teachers_load_balancing_term_does_not():
    """A routed teacher, a dense student: no MoE term reaches the objective."""
    trainer = make_trainer(teacher="qwen3_moe-tiny")
    plain, terms = objective_and_terms(trainer, 0.0)
    weighted, _ = objective_and_terms(trainer, 0.5)
    assert terms["moe_aux_loss"] == 0.0 and weighted == plain


@pytest.mark.slow
def test_a_lora_student_moves_only_its_adapters():
    """LoRA on the student: after 2 steps only its adapters moved; the teacher and the
    student's base weights are bit-identical."""
    from posttrain.lora import LoraConfig, apply_lora

    mesh = sharding.make_mesh(MESH)
    student = build_model(shallower(get_config("qwen3-tiny"), 1), mesh, seed=0)
    student = apply_lora(student, mesh, LoraConfig(rank=4, alpha=8.0))
    teacher = build_model(get_config("llama3-tiny"), mesh, seed=1)
    trainer = make_trainer_over(student, teacher, mesh)
    base = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))  # LoRAParam subclasses Param
    before = params_of(trainer.model, base)
    adapters = params_of(trainer.model, nnx.LoRAParam)
    teacher = params(trainer.teacher_model)
    trainer.train(data.batches(rows(), 8, 1))
    assert len(trainer.history) == 2
    assert all(np.array_equal(v, params_of(trainer.model, base)[k]) for k, v in before.items())
    assert all(np.array_equal(v, params(trainer.teacher_model)[k]) for k, v in teacher.items())
    moved = params_of(trainer.model, nnx.LoRAParam)
    assert any(not np.array_equal(v, moved[k]) for k, v in adapters.items())


def params_of(model, which) -> dict[str, np.ndarray]:
    return {
        "/".join(map(str, p)): np.asarray(v[...])
        for p, v in nnx.to_flat_state(nnx.state(model, which))
    }


def make_trainer_over(student, teacher, mesh):
    config = tunix_distill.config_class()(eval_every_n_steps=1000, max_steps=2)
    return distill_trainer_class()(
        student,
        teacher,
        strategy(temperature=2.0, alpha=0.5),
        optax.adam(1e-2),
        config,
        options=SFTOptions(mesh=mesh),
    )


def _identity(*args, **kwargs):
    return args[0] if args else None


@pytest.mark.contract("tunix.distillation.strategies.LogitStrategy.compute_loss formula")
@pytest.mark.parametrize(
    ("temperature", "alpha", "top_k"),
    [(1.0, 0.5, 0), (2.0, 0.0, 0), (3.0, 1.0, 0), (2.0, 0.25, TOP_K)],
    ids=["T1-a.5", "T2-a0", "T3-a1", f"T2-a.25-top{TOP_K}"],
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_written_out_logit_loss_is_tunix_s(temperature, alpha, top_k, dtype):
    """:mod:`posttrain.distill.logit_loss` equals this release's ``compute_loss`` at each
    position (7 positions, vocab 40), and the objective takes it: its per-position call
    returns no metrics, while a subclass of the strategy (which may compute otherwise)
    keeps going through its own ``compute_loss``. bf16 logits are compared with the
    release's formula on them cast to float32: we compute in float32 as 0.1.7 does
    (0.1.5 computed in the logits' dtype)."""
    from posttrain.distill import logit_loss

    strategy = tunix_distill.logit_strategy(
        _identity,
        _identity,
        _identity,
        temperature=temperature,
        alpha=alpha,
        distill_top_k=top_k,
    )
    known = logit_loss.settings(strategy)
    assert known == (temperature, alpha, top_k)
    rng = np.random.default_rng(3)
    student = jnp.asarray(rng.normal(0, 3, (7, 40)), dtype)
    teacher = jnp.asarray(rng.normal(0, 3, (7, 40)), dtype)
    tokens = jnp.asarray(rng.integers(0, 40, 7), jnp.int32)

    @jax.jit  # one program (on a chip each eager op is a compile of its own)
    def theirs_ours_and_objective(student, teacher, tokens):
        f32 = (student.astype(jnp.float32), teacher.astype(jnp.float32))
        theirs, metrics = distill_loss._vmapped(strategy, *f32, tokens)
        ours = logit_loss.per_position(student, teacher, tokens, *known)
        return theirs, metrics, ours, distill_loss.per_position(strategy, student, teacher, tokens)

    theirs, metrics, ours, (values, none) = theirs_ours_and_objective(student, teacher, tokens)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    assert logit_loss.agrees(strategy, known, distill_loss._vmapped)
    np.testing.assert_allclose(values, theirs, rtol=1e-5, atol=1e-6)
    assert none == {} and (metrics or tunix_distill.loss_convention() == "scalar")
    subclass = type("Custom", (type(strategy),), {})
    assert logit_loss.settings(object.__new__(subclass)) is None


def test_a_written_out_loss_that_disagrees_is_not_used(monkeypatch):
    """Where the written-out formula differs from the release's (here: the temperature not
    squared), the check finds it and the strategy's own ``compute_loss`` is used."""
    from posttrain.distill import logit_loss

    right = logit_loss.per_position
    monkeypatch.setattr(
        logit_loss,
        "per_position",
        lambda s, t, y, temperature, alpha, top_k=0: (
            right(s, t, y, temperature, alpha, top_k) / temperature**2
            if alpha == 1.0
            else right(s, t, y, temperature, alpha, top_k)
        ),
    )
    monkeypatch.setattr(logit_loss, "_AGREES", {})
    strategy = tunix_distill.logit_strategy(
        _identity, _identity, _identity, temperature=2.0, alpha=1.0
    )
    rng = np.random.default_rng(4)
    student, teacher = (jnp.asarray(rng.normal(0, 3, (5, 32)), jnp.float32) for _ in "st")
    tokens = jnp.asarray(rng.integers(0, 32, 5), jnp.int32)
    assert not logit_loss.agrees(strategy, logit_loss.settings(strategy), distill_loss._vmapped)

    @jax.jit
    def objective_and_theirs(student, teacher, tokens):
        values, _ = distill_loss.per_position(strategy, student, teacher, tokens)
        return values, distill_loss._vmapped(strategy, student, teacher, tokens)[0]

    values, theirs = objective_and_theirs(student, teacher, tokens)
    np.testing.assert_array_equal(values, theirs)
