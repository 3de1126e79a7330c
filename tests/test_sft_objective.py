"""What SFTTrainer differentiates: the NLL share plus the weighted MoE load-balancing loss.

A regression this file exists for: the trainer read the weight as
``getattr(moe, "router_aux_loss_coef", 0.0)`` while ``MoEConfig`` names it
``aux_loss_weight``, so every MoE run trained without load balancing and nothing looked wrong.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

tunix = pytest.importorskip("tunix.sft.peft_trainer", reason="google-tunix is not installed")

from posttrain import sharding  # noqa: E402
from posttrain.models import build_model, get_config  # noqa: E402
from posttrain.training import data  # noqa: E402
from posttrain.training.trainer import SFTOptions, SFTTrainer  # noqa: E402
from tests.meshes import fitted  # noqa: E402

MESH = fitted({"fsdp": 4, "expert": 2})
LEARNING_RATE = 0.1  # plain SGD: a step moves the params by exactly this x the gradient


@functools.cache
def batch():
    rng = np.random.default_rng(0)
    examples = [
        data.Example(rng.integers(1, 250, n).astype(np.int32), rng.random(n) < 0.7)
        for n in (9, 13, 7, 11, 5, 17, 8, 12)
    ]
    rows = data.to_rows(examples, 24, packing=False, pad_id=0)
    return {k: jnp.asarray(v) for k, v in rows.items()}


def trainer_for(aux_loss_weight: float, **kwargs) -> SFTTrainer:
    cfg = get_config("qwen3_moe-tiny")
    cfg = cfg.replace(moe=dataclasses.replace(cfg.moe, aux_loss_weight=aux_loss_weight))
    mesh = sharding.make_mesh(MESH)
    model = build_model(cfg, mesh, seed=3)
    config = tunix.TrainingConfig(eval_every_n_steps=1000, max_steps=1)
    return SFTTrainer(
        model, optax.sgd(LEARNING_RATE), config, options=SFTOptions(mesh=mesh, **kwargs)
    )


@functools.cache
def configured_trainer() -> SFTTrainer:
    return trainer_for(0.25)


@functools.cache
def grads_at(weight: float):
    """The configured trainer's ``_grads`` jitted with its load-balancing weight at
    ``weight`` (read when traced), the model an argument: one program per weight, which a
    later test reuses (on a chip each is seconds of compile). A lambda of its own, as a
    bound method would share JAX's trace cache with the other weights' (equal methods)."""
    trainer = configured_trainer()

    def grads(model, inputs):
        trainer.moe_aux_loss_weight = weight
        try:
            return trainer._grads(model, inputs)
        finally:
            trainer.moe_aux_loss_weight = 0.25

    return jax.jit(grads)


def objective_and_grads(model, weight=0.25):
    with sharding.use_mesh(configured_trainer().mesh, jax_context=False):
        return grads_at(weight)(model, batch())


def objective_and_router_grad(weight=0.25):
    objective, terms, grads = objective_and_grads(configured_trainer().model, weight)
    router = grads["model"]["layers"][0]["mlp"]["router"]["kernel"]
    return float(objective), jax.device_get(terms), np.asarray(router[...])


@pytest.mark.wiring
def test_the_weight_comes_from_the_model_config():
    import types

    from posttrain.training.trainer import default_moe_aux_loss_weight

    assert configured_trainer().moe_aux_loss_weight == 0.25
    assert trainer_for(0.25, moe_aux_loss_weight=0.5).moe_aux_loss_weight == 0.5
    dense = types.SimpleNamespace(config=get_config("qwen3-tiny"))  # no MoE: no weight
    assert default_moe_aux_loss_weight(dense) == 0.0


def test_objective_is_the_nll_share_plus_the_weighted_load_balancing_loss():
    """objective = nll_sum / target_tokens + aux_loss_weight * moe_aux_loss (one micro-step)."""
    objective, terms, _ = objective_and_router_grad()
    nll, targets, aux = (float(terms[k]) for k in ("nll_sum", "target_tokens", "moe_aux_loss"))
    assert targets > 0 and aux > 1.0  # two MoE layers, top-2 of 8: each term near top_k
    assert objective == pytest.approx(nll / targets + 0.25 * aux, rel=1e-6)
    assert objective - nll / targets == pytest.approx(0.25 * aux, rel=1e-5)


@pytest.mark.wiring
def test_the_router_gradient_follows_the_weight():
    """The load-balancing term reaches the router: its gradient moves with the weight
    (0.25, the configured one's program, and 1.0)."""
    _, _, g0 = objective_and_router_grad(0.25)
    _, _, g1 = objective_and_router_grad(1.0)
    assert np.abs(g1 - g0).max() > 1e-4


# one program per input structure, shared by the cases (on a chip each is a compile)
report = jax.jit(lambda terms, inputs: SFTTrainer._report(SFTTrainer, terms, inputs, 1.5))


@pytest.mark.parametrize(
    ("segment_ids", "want_tokens"),
    [([[1, 1, 2, 0], [1, 0, 0, 0]], 4.0), (None, 8.0)],
    ids=["packed-rows", "no-segment-ids"],
)
@pytest.mark.parametrize(("nll_sum", "target_tokens"), [(3.5, 1.0), (0.0, 0.0), (6.0, 4.0)])
def test_the_reported_loss_and_token_count(segment_ids, want_tokens, nll_sum, target_tokens):
    """What a micro-step logs (``_report``): the loss is the mean NLL over its target
    tokens (a single target token divides by 1; none gives 0, not NaN), ``tokens``
    counts the non-padding tokens (segment id > 0; every token without segment ids,
    training.metrics' definition) as float32, and grad_norm and the forward terms pass on."""
    inputs = {"input_tokens": jnp.ones((2, 4), jnp.int32)}
    if segment_ids is not None:
        inputs["segment_ids"] = jnp.asarray(segment_ids, jnp.int32)
    terms = {"nll_sum": jnp.float32(nll_sum), "target_tokens": jnp.float32(target_tokens)}
    loss, aux = report(terms, inputs)
    assert float(loss) == (nll_sum / target_tokens if target_tokens else 0.0)
    assert aux["tokens"].dtype == jnp.float32 and float(aux["tokens"]) == want_tokens
    assert float(aux["grad_norm"]) == 1.5 and float(aux["nll_sum"]) == nll_sum


def test_the_logged_grad_norm_is_the_norm_of_the_applied_gradient():
    """One step without accumulation: the step's grad_norm equals the global norm of the
    gradient of its objective (computed here before the step, by the configured trainer's
    program: the same config and weight), and the step applies it (SGD: params move by
    exactly lr x gradient)."""
    trainer = trainer_for(0.25)
    _, _, grads = objective_and_grads(trainer.model)
    with sharding.use_mesh(trainer.mesh, jax_context=False):
        before = jax.tree.map(np.asarray, nnx.state(trainer.model, nnx.Param))
        step = nnx.jit(lambda m, o, x: trainer._step_body(m, o, None, x, None))
        _, aux, grad_norm = step(trainer.model, trainer.optimizer, batch())
    # in NumPy (optax.global_norm would be eager ops: a compile each on a chip)
    squares = [np.sum(np.square(np.asarray(g, np.float64))) for g in jax.tree.leaves(grads)]
    norm = np.sqrt(sum(squares))
    assert float(grad_norm) == pytest.approx(norm, rel=1e-5)
    assert float(aux["grad_norm"]) == float(grad_norm) > 0
    after = nnx.state(trainer.model, nnx.Param)
    moved = jax.tree.map(
        lambda a, b, g: np.asarray(a) - b + LEARNING_RATE * np.asarray(g), after, before, grads
    )
    assert max(float(np.abs(x).max()) for x in jax.tree.leaves(moved)) < 1e-6
