"""The Tunix side of one GRPO run: its training, rollout and algorithm configs, and the
cluster and learner built over the policy (what ``posttrain grpo`` trains, and what the
contracts of ``contracts/test_tunix_rl.py`` drive)."""

from __future__ import annotations

import contextlib
import pathlib

import jax
import jax.numpy as jnp

from posttrain import _compat, distributed, sharding
from posttrain.rl import tunix_cluster, tunix_rl
from posttrain.rl.options import GRPORunConfig
from posttrain.training.optimizer import run_adam
from posttrain.training.policy import TunixPolicy, reference_of


def configs(cfg: GRPORunConfig, out: pathlib.Path, mesh, eos_ids):
    """Tunix's ``(training config, rollout config, algorithm config)`` of the run; the
    rollout stops at any of ``eos_ids``."""
    from tunix.sft import metrics_logger

    batch = batch_size(cfg, mesh)
    training = tunix_rl.training_config(
        actor_optimizer=run_adam(cfg, cfg.learning_rate, b2=0.99),
        eval_every_n_steps=cfg.steps + 1,
        max_steps=min(cfg.steps, cfg.stop_after or cfg.steps),
        mini_batch_size=batch,
        micro_batch_size=batch // cfg.grad_accum,
        # one rollout (and one logps pass) over the whole batch, whatever the
        # accumulation: Tunix's default is the train micro-batch, which would sample
        # another batch shape and so other completions
        rollout_micro_batch_size=batch,
        compute_logps_micro_batch_size=batch,
        checkpoint_root_directory=str((out / "checkpoints").resolve()),
        checkpointing_options=_compat.interval_checkpoint_options(
            min(cfg.save_every, cfg.stop_after or cfg.save_every),
            max_to_keep=2,
            enable_async_checkpointing=False,
        ),
        # One TensorBoard file, process 0's: Tunix's logger opens one in every process
        # it is given options in (and only process 0's gets the scalars).
        metrics_logging_options=metrics_logger.MetricsLoggerOptions(
            log_dir=str(out / "tensorboard"), flush_every_n_steps=10
        )
        if distributed.is_writer()
        else None,
        data_sharding_axis=tuple(sharding.batch_spec(mesh))[:1] or ("fsdp",),
    )
    rollout = tunix_rl.rollout_config(
        max_tokens_to_generate=cfg.max_new_tokens,
        max_prompt_length=cfg.max_prompt_length,
        kv_cache_size=pow2(cfg.max_prompt_length) + cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_p=1.0,
        top_k=None,
        seed=cfg.seed,
        eos_tokens=list(eos_ids),
        **({"data_type": jnp.dtype(cfg.rollout_dtype)} if cfg.rollout_dtype else {}),
    )
    algo = tunix_rl.algo_config(
        cfg.algorithm, num_generations=cfg.num_generations, beta=cfg.beta, epsilon=cfg.epsilon
    )
    return training, rollout, algo


def build_learner(cfg: GRPORunConfig, model, tok, meshes, fns):
    """Tunix's cluster and learner over ``model`` with the run's configs
    (:func:`configs`): the actor and its reference (:func:`posttrain.training.policy.reference_of`),
    the actor's optimizer placed on ``meshes[0]``, the MoE load-balancing term in the
    actor's loss. ``meshes``: ``(actor mesh, rollout mesh)``; ``fns``: the reward
    functions. Returns ``(cluster, learner, (actor, reference))``.

    Raises:
      ValueError: an algorithm the installed Tunix does not have (one line naming it).
    """
    mesh, rollout_mesh = meshes
    training, rollout, algo = configs(cfg, pathlib.Path(cfg.output), mesh, tok.stop_ids)
    actor, reference = TunixPolicy(model), TunixPolicy(reference_of(model))
    cluster = tunix_rl.cluster(
        actor=actor,
        reference=reference,
        tokenizer=tok,
        meshes={"actor": mesh, "reference": mesh, "rollout": rollout_mesh},
        training=training,
        rollout=rollout,
    )
    learner = tunix_rl.learner(cfg.algorithm, cluster, algo, fns, seed=None)
    tunix_cluster.place_actor_optimizer(cluster, mesh)
    moe = model.config.moe
    tunix_rl.with_moe_aux_loss(cluster.actor_trainer, moe.aux_loss_weight if moe else 0.0)
    return cluster, learner, (actor, reference)


def batch_size(cfg: GRPORunConfig, mesh) -> int:
    """Prompts per GRPO step: ``per_device_batch_size`` x the mesh's data-parallel size."""
    return cfg.per_device_batch_size * sharding.data_parallel_size(mesh)


def saves():
    """Orbax writes each replicated array from one replica in one CPU process (its
    replica-parallel slicing is pure overhead there, and on jax 0.7 its eager slices fail
    inside Tunix's ``with mesh:``; :func:`posttrain._compat.single_replica_array_saves`)."""
    if jax.default_backend() == "cpu" and jax.process_count() == 1:
        return _compat.single_replica_array_saves()
    return contextlib.nullcontext()


def pow2(n: int) -> int:
    """Tunix's sampler pads prompts to the next power of two of the longest."""
    return 1 << max(0, (n - 1).bit_length())
