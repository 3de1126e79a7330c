"""The programs of DPO and GRPO, built the way their trainers build them, on an abstract
policy (google-tunix 0.1.7; the same abstract optimizer as SFT's, :mod:`posttrain.plan.steps`).

DPO (``posttrain dpo``: our :class:`~posttrain.preference.trainer.DPOTrainer` over Tunix's):
  - ``train step``: the trainer's own step (``jit_train_step``: ``nnx.jit`` donating the
    policy and the optimizer, as the trainer runs it) on Tunix's prepared ``TrainExample``:
    the chosen and rejected completions stacked into one ``[2 x pairs, prompt + response]``
    batch, its ``[2 x pairs, T, T]`` attention mask and the reference log-probabilities;
  - ``reference forward``: Tunix's jitted ``compute_logps`` on the reference, which
    ``DPOTrainer._prepare_inputs`` runs before each step.

GRPO (``posttrain grpo``: Tunix's ``RLCluster`` actor trainer, ``tunix.rl.trainer.Trainer``,
with the loss ``GRPOLearner`` installs and our MoE term):
  - ``rollout``: prefill + decode with the KV cache on the rollout mesh
    (``posttrain generate``'s loop, :func:`posttrain.plan.steps.generate_program`; Tunix's
    sampler runs the same model calls through :mod:`posttrain.tunix_sampler`);
  - ``reference forward``: Tunix's jitted ``compute_per_token_logps`` on the reference;
  - ``train step``: the actor trainer's ``_train_step`` on the learner's ``TrainExample``,
    jitted donating what Tunix's ``jit_train_and_eval_step`` donates (read from its source:
    the optimizer; the actor's model is shared with the sampler).
  - ``old-policy forward``, only with ``num_iterations > 1`` (Tunix's
    ``GRPOLearner._generate_and_compute_advantage`` calls
    ``RLCluster.get_old_per_token_logps``: the same ``compute_per_token_logps`` on the
    rollout's model, under the rollout mesh, before the step; the step's
    ``TrainExample`` then carries its ``[rows, completion]`` float32 log-probabilities).
    With 1 (Tunix's default, which ``posttrain grpo`` keeps) the loss takes the step's
    own log-probabilities, stop-gradient, and no such forward runs.

What stays on the device between programs (``Program.resident``): the policy, its
optimizer state and the reference. With LoRA the reference is the policy with its
``lora_b`` zeroed (:func:`posttrain.training.policy.reference_of`): only those are its own
bytes; without, a full copy. A rollout mesh other than the trainer's holds its own copy
of the policy.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from posttrain import sharding
from posttrain.layers import splash_costs
from posttrain.plan import abstract
from posttrain.plan.steps import Program, abstract_init, generate_program, make_optimizer
from posttrain.preference import tunix_dpo
from posttrain.rl import tunix_rl
from posttrain.training import tunix_compat

#: the steps' Tunix configs: learning rate and loss hyperparameters change no shape
_PEFT = {"eval_every_n_steps": 10**9, "max_steps": 10**9}


def _rows(mesh: Mesh, rules, shape: tuple[int, ...], dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding.batch_sharding(mesh, rules))


def _check_batch(mesh: Mesh, rules, rows: int) -> None:
    dp = sharding.data_parallel_size(mesh, rules)
    if rows % dp:
        raise ValueError(f"batch={rows} rows must divide by the data-parallel size {dp}")


def _reference(policy) -> tuple[nnx.Module, int]:
    """``(abstract reference, bytes one device holds for it beyond the policy)``: a copy
    of the placed ``policy``; with LoRA its own bytes are the zeroed ``lora_b``
    (:func:`posttrain.training.policy.reference_of`), else all of it."""
    from posttrain.lora.layout import LORA_B  # Qwix (train extra): DPO and GRPO plans only
    from posttrain.training.policy import has_lora

    reference = nnx.clone(policy)
    if not has_lora(policy):
        return reference, abstract.device_bytes(nnx.state(reference))
    own = [
        v.get_value()
        for path, v in nnx.to_flat_state(nnx.state(reference, nnx.LoRAParam))
        if str(path[-1]).endswith(LORA_B)
    ]
    return reference, abstract.device_bytes(own)


def _trained_kinds(trainer, inputs) -> dict:
    trained = nnx.LoRAParam if trainer._lora_enabled else nnx.Param
    return {
        "parameters": abstract.device_bytes(nnx.state(trainer.model)),
        "optimizer state": abstract.device_bytes(nnx.state(trainer.optimizer)),
        "gradients": abstract.device_bytes(nnx.state(trainer.model, trained)),
        "inputs": abstract.device_bytes(inputs),
    }


def _step_flops(policy, lora: bool, tokens: int) -> float:
    """Model FLOPs of a train step over ``tokens`` tokens (``6 N``, ``4 N`` with LoRA)."""
    return 2 * abstract.active_matmul_params(policy.model) * (2 if lora else 3) * tokens


def _splash(cfg, mesh: Mesh, rules, rows: int, seq: int, *, backward: bool) -> dict:
    """``Program`` keywords: splash's kernels' costs over ``[rows, seq]``
    (:func:`posttrain.layers.splash_costs.uncounted_costs`) and the cost source saying so."""
    costs = splash_costs.uncounted_costs(cfg, rows, seq, dict(mesh.shape), rules, backward=backward)
    return {"uncounted": costs, "cost_source": f"compiled, {splash_costs.COST_SOURCE}"}


def dpo_programs(
    model, mesh: Mesh, *, optimizer: str, pairs: int, prompt: int, response: int, rules
) -> dict[str, Program]:
    """``{"reference forward": ..., "train step": ...}`` of one DPO micro-step on the
    abstract ``model`` (LoRA or not): ``pairs`` preference pairs of ``prompt + response``
    tokens, each completion ``response`` tokens.

    Raises:
      ValueError: ``2 x pairs`` rows do not divide by the data-parallel size.
    """
    from posttrain.preference.trainer import DPOTrainer
    from posttrain.training.policy import TunixPolicy
    from posttrain.training.trainer import SFTOptions

    rows, seq = 2 * pairs, prompt + response
    _check_batch(mesh, rules, rows)
    policy = TunixPolicy(model)
    config = tunix_dpo.training_config(
        algorithm="dpo", beta=0.1, label_smoothing=0.0, lambda_orpo=0.1, **_PEFT
    )
    tx = abstract_init(make_optimizer(optimizer))
    options = SFTOptions(mesh=mesh, rules=rules)
    trainer = DPOTrainer(policy, None, tx, config, options=options)
    try:
        abstract.place(trainer.model, mesh, rules)
        abstract.place(trainer.optimizer, mesh, rules)
        reference, own = _reference(trainer.model)
        logps = _rows(mesh, rules, (pairs,), jnp.float32)
        example = tunix_dpo.train_example(
            input_ids=_rows(mesh, rules, (rows, seq), jnp.int32),
            positions=_rows(mesh, rules, (rows, seq), jnp.int32),
            attention_mask=_rows(mesh, rules, (rows, seq, seq), jnp.bool_),
            ref_chosen_logps=logps,
            ref_rejected_logps=logps,
            completion_mask=_rows(mesh, rules, (rows, response), jnp.int32),
            logits_to_keep=response,
        )
        kinds = _trained_kinds(trainer, example)
        step = Program(
            trainer.jit_train_step(),
            (trainer.model, trainer.optimizer, example),
            {},
            kinds,
            _step_flops(policy, trainer._lora_enabled, rows * seq),
            abstract.attention_flops(model.config, rows, seq, backward=True),
            resident=own,
            **_splash(model.config, mesh, rules, rows, seq, backward=True),
        )
        ref_args = (example.input_ids, example.positions, example.attention_mask, response)
        ref_kinds = {"parameters": abstract.device_bytes(nnx.state(reference))}
        ref_kinds["inputs"] = abstract.device_bytes(ref_args[:3] + (example.completion_mask,))
        forward = Program(
            tunix_dpo.compute_logps(),
            (reference, *ref_args, example.completion_mask),
            {},
            ref_kinds,
            2 * abstract.active_matmul_params(policy.model) * rows * seq,
            abstract.attention_flops(model.config, rows, seq, backward=False),
            resident=kinds["parameters"] + kinds["optimizer state"] + own - ref_kinds["parameters"],
            **_splash(model.config, mesh, rules, rows, seq, backward=False),
        )
        return {"reference forward": forward, "train step": step}
    finally:
        trainer.abandon()


def grpo_programs(
    model,
    mesh: Mesh,
    rollout_mesh: Mesh,
    *,
    optimizer: str,
    rows: int,
    prompt: int,
    completion: int,
    rules,
    num_iterations: int = 1,
) -> dict[str, Program]:
    """``{"rollout": ..., "reference forward": ..., "train step": ...}`` of one GRPO step
    on the abstract ``model``: ``rows`` completions (prompts x generations) of
    ``completion`` tokens after ``prompt``-token prompts, Tunix's default GRPO config
    (beta 0.04: the reference forward runs) with ``num_iterations`` (> 1 adds the
    ``"old-policy forward"`` on the rollout's model).

    Raises:
      ValueError: ``rows`` does not divide by either mesh's data-parallel size.
      NotImplementedError: a Tunix without ``function_registry.get_policy_loss_fn``
        (google-tunix < 0.1.7), whose learner wires its loss otherwise.
    """
    from tunix.rl import function_registry

    from posttrain.training.policy import TunixPolicy

    if not hasattr(function_registry, "get_policy_loss_fn"):
        raise NotImplementedError("plan builds GRPO's loss as google-tunix 0.1.7 does")
    _check_batch(mesh, rules, rows)
    _check_batch(rollout_mesh, rules, rows)
    algo = tunix_rl.algo_config(
        "grpo", num_generations=2, epsilon=0.2, num_iterations=num_iterations
    )
    algo.temperature = 1.0  # GRPOLearner sets it to the rollout's (a value, not a shape)
    trainer = _grpo_trainer(model, optimizer, algo)
    try:
        abstract.place(trainer.model, mesh, rules)
        abstract.place(trainer.optimizer, mesh, rules)
        reference, own = _reference(trainer.model)
        example = _grpo_example(mesh, rules, rows, prompt, completion, algo)
        kinds = _trained_kinds(trainer, example)
        donated = tunix_compat.donated_by(type(trainer))
        step = Program(
            nnx.jit(trainer.create_train_step_fn(), donate_argnames=donated),
            (trainer.model, trainer.optimizer, example),
            {},
            kinds,
            _step_flops(trainer.model, trainer._lora_enabled, rows * (prompt + completion)),
            abstract.attention_flops(model.config, rows, prompt + completion, backward=True),
        )
        sampled = trainer.model.model if rollout_mesh is mesh else nnx.clone(trainer.model.model)
        rollout = generate_program(
            sampled, rollout_mesh, batch=rows, prompt=prompt, new_tokens=completion, rules=rules
        )
        # a rollout on the trainer's mesh shares the actor's model; another holds a copy
        copy = rollout.kinds["parameters"] if rollout_mesh is not mesh else 0
        held = kinds["parameters"] + kinds["optimizer state"] + own + copy
        forwards = {"reference forward": _logps_program(reference, mesh, rules, example)}
        if algo.num_iterations > 1:
            old = _grpo_example(rollout_mesh, rules, rows, prompt, completion, algo)
            forwards["old-policy forward"] = _logps_program(
                TunixPolicy(sampled), rollout_mesh, rules, old
            )
        programs = {"rollout": rollout, **forwards}
        beside = {n: _with_resident(p, held - p.kinds["parameters"]) for n, p in programs.items()}
        return {**beside, "train step": _with_resident(step, own + copy)}
    finally:
        trainer.checkpoint_manager.close()
        trainer.metrics_logger.close()


def _grpo_trainer(model, optimizer: str, algo):
    """Tunix's actor trainer (``tunix.rl.trainer.Trainer``) on ``TunixPolicy(model)``
    with what ``GRPOLearner.__init__`` installs (google-tunix 0.1.7: its policy loss,
    pad 0 and eos 1, values rather than shapes) and our MoE term."""
    from tunix.rl import function_registry
    from tunix.rl import trainer as rl_trainer
    from tunix.sft import peft_trainer

    from posttrain.training.policy import TunixPolicy
    from posttrain.training.trainer import default_moe_aux_loss_weight

    loss = function_registry.get_policy_loss_fn(algo.policy_loss_fn)
    trainer = rl_trainer.Trainer(
        TunixPolicy(model),
        abstract_init(make_optimizer(optimizer)),
        peft_trainer.TrainingConfig(**_PEFT),
        custom_checkpoint_metadata_fn=dict,
    )
    trainer.with_loss_fn(
        lambda model, train_example, algo_config: loss(
            model, train_example, algo_config=algo, pad_id=0, eos_id=1
        ),
        has_aux=True,
    )
    trainer.with_gen_model_input_fn(lambda x: {"train_example": x, "algo_config": algo})
    tunix_rl.with_moe_aux_loss(trainer, default_moe_aux_loss_weight(model))
    return trainer


def _grpo_example(mesh: Mesh, rules, rows: int, prompt: int, completion: int, algo):
    """The learner's abstract ``TrainExample`` on ``mesh``: ``[rows, prompt]`` prompt and
    ``[rows, completion]`` completion ids and masks, ``[rows]`` advantages, the
    reference's (and, with ``num_iterations > 1``, the old policy's) float32 logps."""
    from tunix.rl.grpo import grpo_learner

    logps = _rows(mesh, rules, (rows, completion), jnp.float32)
    return grpo_learner.TrainExample(
        prompt_ids=_rows(mesh, rules, (rows, prompt), jnp.int32),
        prompt_mask=_rows(mesh, rules, (rows, prompt), jnp.bool_),
        completion_ids=_rows(mesh, rules, (rows, completion), jnp.int32),
        completion_mask=_rows(mesh, rules, (rows, completion), jnp.bool_),
        advantages=_rows(mesh, rules, (rows,), jnp.float32),
        ref_per_token_logps=logps,
        old_per_token_logps=logps if algo.num_iterations > 1 else None,
    )


def _logps_program(policy, mesh: Mesh, rules, example) -> Program:
    """Tunix's ``compute_per_token_logps`` (google-tunix 0.1.7) on ``policy`` (a
    ``TunixPolicy``: the reference, or the rollout's model for the old policy's
    ``get_old_per_token_logps``) over ``example``'s prompt and completion ids on ``mesh``."""
    from tunix.rl import common

    graphdef, state = nnx.split(policy)
    ids = (example.prompt_ids, example.completion_ids)
    rows, seq = ids[0].shape[0], ids[0].shape[1] + ids[1].shape[1]
    return Program(
        common.compute_per_token_logps,
        (graphdef, state, *ids),
        {"pad_id": 0, "eos_id": 1, "stop_gradient": True, "return_logits": False},
        {"parameters": abstract.device_bytes(state), "inputs": abstract.device_bytes(ids)},
        2 * abstract.active_matmul_params(policy.model) * rows * seq,
        abstract.attention_flops(policy.model.config, rows, seq, backward=False),
    )


def _with_resident(program: Program, resident: int) -> Program:

    return dataclasses.replace(program, resident=resident)
