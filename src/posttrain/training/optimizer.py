"""A run's optimizer and schedule, and the Tunix ``TrainingConfig`` fields every
``PeftTrainer`` run sets."""

from __future__ import annotations

import pathlib

import jax
import optax

from posttrain import _compat, distributed, sharding
from posttrain.training.trainer import SFTOptions


def adam_schedule(cfg):
    """``(schedule, optimizer)`` of a run config with ``learning_rate``, ``warmup_steps``,
    ``steps`` and ``max_grad_norm``: linear warm-up to the peak, cosine to 10% of it, under
    :func:`run_adam` with b2 0.95. ``posttrain sft``, ``dpo`` and ``distill``."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0,
        cfg.learning_rate,
        min(cfg.warmup_steps, cfg.steps - 1),
        cfg.steps,
        end_value=cfg.learning_rate * 0.1,
    )
    return schedule, run_adam(cfg, schedule, b2=0.95)


def run_adam(cfg, learning_rate, *, b2: float):
    """The optimizer of every workflow: Adam at ``learning_rate`` (a float, or a schedule
    of the step) with ``b2``, after clipping the gradient's global norm at
    ``cfg.max_grad_norm`` (:func:`clipped`). SFT, DPO and distill: b2 0.95 over
    :func:`adam_schedule`; GRPO's actor: b2 0.99 at a constant rate. A new optimizer
    option of the runs is read here, once.

    Adam, not ``optax.adamw(weight_decay=0.0)``: the same updates, except that optax 0.2.6
    (the google-tunix 0.1.6 era's) still adds ``0 * parameter``, which turns a parameter
    of +-inf into NaN. The vision tower's clip bounds are +-inf until a checkpoint sets
    them (no clamp), and Tunix's optimizer holds them even while the tower is frozen."""
    return clipped(optax.adam(learning_rate, b2=b2), cfg.max_grad_norm)


def clipped(tx, max_grad_norm: float):
    """``tx`` after clipping the gradient's global norm at ``max_grad_norm`` (the run's
    ``--max-grad-norm``; every workflow's optimizer goes through here); ``tx`` itself at
    0, no clipping. Under accumulation the clip sees the step's accumulated gradient
    (Tunix's ``optax.MultiSteps`` wraps the whole chain)."""
    if max_grad_norm == 0:
        return tx
    return optax.chain(optax.clip_by_global_norm(max_grad_norm), tx)


def peft_training_fields(cfg, out: pathlib.Path, mesh, *, async_saves: bool = True) -> dict:
    """Tunix ``TrainingConfig`` fields of a run config with ``steps``, ``stop_after``,
    ``grad_accum`` and ``save_every``: checkpoints in ``out/checkpoints`` (2 kept),
    TensorBoard in ``out/tensorboard``, batches on the mesh's first batch axis, no eval."""
    from tunix.sft import metrics_logger

    batch_axes = tuple(sharding.batch_spec(mesh))[:1]
    return dict(
        # No eval dataset; google-tunix <= 0.1.2 still requires a multiple of the GA steps.
        eval_every_n_steps=(cfg.steps + 1) * cfg.grad_accum,
        max_steps=min(cfg.steps, cfg.stop_after or cfg.steps),
        gradient_accumulation_steps=cfg.grad_accum if cfg.grad_accum > 1 else None,
        checkpoint_root_directory=str((out / "checkpoints").resolve()),
        checkpointing_options=_compat.interval_checkpoint_options(
            cfg.save_every, max_to_keep=2, enable_async_checkpointing=async_saves
        ),
        # One TensorBoard file, process 0's: Tunix's logger opens one in every process
        # it is given options in (and only process 0's gets the scalars).
        metrics_logging_options=metrics_logger.MetricsLoggerOptions(
            log_dir=str(out / "tensorboard"), flush_every_n_steps=10
        )
        if distributed.is_writer()
        else None,
        data_sharding_axis=batch_axes or ("fsdp",),
    )


def single_process_cpu() -> bool:
    """One process on the CPU backend: Orbax saves each replicated array from one replica
    there (nobody to share the writes with; ``posttrain sft``'s ``auto``)."""
    return jax.default_backend() == "cpu" and jax.process_count() == 1


def trainer_options(mesh, schedule, out: pathlib.Path, log_every, *, single_replica_saves: bool):
    """Our trainer options (:class:`posttrain.training.trainer.SFTOptions`) of a
    ``PeftTrainer`` run: its mesh and schedule, ``metrics.jsonl`` written by the writer
    process only, each process's share of every batch (``process_local_batches``)."""
    return SFTOptions(
        mesh=mesh,
        learning_rate_fn=schedule,
        metrics_path=out / "metrics.jsonl" if distributed.is_writer() else None,
        log_every=log_every,
        single_replica_saves=single_replica_saves,
        process_local_batches=True,
    )
