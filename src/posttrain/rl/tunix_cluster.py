"""What a GRPO run does to Tunix's cluster once it is built: the rollout's weight syncs
kept on device, a fresh rollout seed per step, the step metrics tapped, the actor's
optimizer state placed. Feature-detected as in :mod:`posttrain.rl.tunix_rl`, whose
:class:`~posttrain.rl.tunix_rl.UnknownRLShapeError` names a shape none of these covers."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import time

import jax
import numpy as np
from flax import nnx

from posttrain.rl.tunix_rl import UnknownRLShapeError
from posttrain.training.policy import has_lora
from posttrain.training.trainer import replicate_unplaced


def _update_filter(rl_cluster):
    return (nnx.LoRAParam if has_lora(rl_cluster.actor_trainer.model) else nnx.Param,)


def syncs_weights(learner) -> bool:
    """Whether the learner copies the actor's weights into the rollout after each step:
    Tunix's own decision (``learner.should_sync_weights``, every release), false when the
    rollout holds the actor's own parameters (one mesh). ``rollout.model()`` is a fresh
    ``nnx.merge`` on every call, so identity says nothing.

    Raises:
      UnknownRLShapeError: the learner has no ``should_sync_weights``.
    """
    if not hasattr(learner, "should_sync_weights"):
        raise UnknownRLShapeError(f"{type(learner).__name__} has no should_sync_weights")
    return bool(learner.should_sync_weights)


def reshard_syncs_on_device(learner) -> None:
    """Makes weight syncs into a rollout on another mesh a device-to-device reshard.

    Tunix's ``sync_weights`` hands the actor's parameters to ``rollout.update_params``,
    which ``jax.device_put``s them onto the rollout's shardings under
    ``jax.transfer_guard(... "disallow_explicit")`` on CPU (every release). On the CPU
    backend a ``device_put`` between two layouts of the same devices goes through the
    host, so the guard stops it ("Disallowed host-to-device transfer"): split meshes
    cannot sync there. Wrapped here: the parameters are first moved by a jitted identity
    with the rollout's shardings as ``out_shardings`` (an XLA collective, which the guard
    allows), and Tunix's own put then finds them in place (and casts them to a
    ``RolloutConfig.data_type`` copy's dtype itself, 0.1.2+). No-op when the learner does
    not sync (:func:`syncs_weights`: the rollout shares the actor's parameters).
    """
    if not syncs_weights(learner):
        return
    rl_cluster = learner.rl_cluster
    rollout = rl_cluster.rollout
    inner = rollout.update_params

    @functools.wraps(inner)
    def update_params(params, *args, **kwargs):
        target = nnx.state(rollout.model(), _update_filter(rl_cluster))
        shardings = jax.tree.map(lambda x: x.sharding, target)
        moved = jax.jit(lambda p: p, out_shardings=shardings)(params)
        return inner(moved, *args, **kwargs)

    rollout.update_params = update_params


def vary_rollout_seed(rl_cluster, base_seed: int) -> None:
    """Gives each rollout call its own sampling seed.

    Every release's vanilla rollout passes ``RolloutConfig.seed`` to the sampler on every
    call, and the sampler makes ``PRNGKey(seed)`` of it (``PRNGKey(0)`` when None): each
    GRPO step draws the same random numbers, so a prompt sampled in the same batch slot
    twice gets the same completions from an unchanged policy, and exploration is
    correlated across steps. Wrapped here: the rollout's ``generate`` gets a copy of the
    config whose seed is ``base_seed``, Tunix's global step and the call's index within
    the step, mixed (a resumed run draws what the uninterrupted one would have).
    """
    rollout = rl_cluster.rollout
    inner = rollout.generate
    calls = {"step": None, "index": 0}

    @functools.wraps(inner)
    def generate(prompts, rollout_config, *args, **kwargs):
        step = int(rl_cluster.global_steps)
        calls["index"] = calls["index"] + 1 if calls["step"] == step else 0
        calls["step"] = step
        seed = (base_seed * 1_000_003 + step * 1_009 + calls["index"]) % (2**31 - 1)
        config = dataclasses.replace(rollout_config, seed=seed)
        return inner(prompts, config, *args, **kwargs)

    rollout.generate = generate


def sync_rollout(learner) -> None:
    """Copies the actor's trained parameters into a rollout on another mesh, as
    ``sync_weights`` does but without advancing Tunix's global step: for right after a
    restore, which Tunix does not follow with a sync (MaxText ad9a01ffd). No-op when the
    rollout shares the actor's parameters (:func:`syncs_weights`): an update there would
    replace the sampler's live parameters by a snapshot, and the rollout would sample
    from it for the rest of the run (``contracts/test_tunix_rl.py`` checks both)."""
    if not syncs_weights(learner):
        return
    rl_cluster = learner.rl_cluster
    kinds = _update_filter(rl_cluster)
    rl_cluster.rollout.update_params(nnx.state(rl_cluster.actor_trainer.model, kinds), kinds)


class MetricsTap:
    """Every scalar Tunix logs during a run, by step: ``records[step][name] = value``.

    Tunix logs through ``MetricsLogger.log`` (rollout metrics from the cluster, train
    metrics from the actor trainer), whose signature gained a leading
    ``metrics_prefix`` in 0.1.4; each logger's ``log`` is wrapped and its arguments are
    bound by name, so both shapes are read the same way. Names keep Tunix's spelling
    (``rewards/...``, ``completions/mean_length``, ``kl``, ``pg_clipfrac``, ``loss``);
    only the ``train`` mode is kept.
    """

    def __init__(self):
        self.records: dict[int, dict[str, float]] = {}
        self.rollout_seconds: dict[int, float] = {}
        self.rollout_tokens: dict[int, int] = {}

    def attach(self, rl_cluster) -> None:
        loggers = [rl_cluster.actor_trainer.metrics_logger]
        inner = getattr(rl_cluster, "_rl_metrics_logger", None)  # the cluster's own
        if inner is not None and inner is not loggers[0]:
            loggers.append(inner)
        for logger in loggers:
            self._wrap(logger)
        self._time_rollouts(rl_cluster)

    def _wrap(self, logger) -> None:
        original = logger.log
        signature = inspect.signature(original)
        if not {"metric_name", "scalar_value", "mode", "step"} <= set(signature.parameters):
            raise UnknownRLShapeError(f"MetricsLogger.log{signature}")

        def log(*args, **kwargs):
            bound = signature.bind(*args, **kwargs).arguments
            if str(bound["mode"]) == "train":
                prefix = bound.get("metrics_prefix")
                name = bound["metric_name"]
                if prefix and prefix != "global":
                    name = f"{prefix}/{name}"
                value = np.asarray(bound["scalar_value"])
                if value.size == 1 and value.dtype.kind in "fiub":
                    self.records.setdefault(int(bound["step"]), {})[name] = float(value)
            return original(*args, **kwargs)

        logger.log = log

    def _time_rollouts(self, rl_cluster) -> None:
        generate = rl_cluster.generate

        @functools.wraps(generate)
        def timed(*args, **kwargs):
            started = time.perf_counter()
            out = generate(*args, **kwargs)
            step = int(rl_cluster.global_steps)
            mode = kwargs.get("mode")
            if mode is None or str(mode).lower().endswith("train"):
                tokens = sum(len(t) for t in out.tokens)
                self.rollout_seconds[step] = self.rollout_seconds.get(step, 0.0) + (
                    time.perf_counter() - started
                )
                self.rollout_tokens[step] = self.rollout_tokens.get(step, 0) + tokens
            return out

        rl_cluster.generate = timed


def place_actor_optimizer(cluster, mesh) -> None:
    """Places the actor's optimizer state on ``mesh`` ourselves, in every process.

    Tunix's ``PeftTrainer._shard_optimizer`` (called from ``jit_train_and_eval_step``)
    applies an eager ``jax.lax.with_sharding_constraint`` to the optimizer state under
    the ``with mesh:`` the RL cluster enters: one program per leaf, dispatched without
    waiting. Across 2 CPU processes (google-tunix 0.1.7, jax 0.10.2, gloo) both ranks wait
    inside it forever at the first update. In one process on 8 fake CPU devices, those
    programs' all-gathers in flight together can leave XLA:CPU's executor without a thread
    for the last device (seen once: the README's matrix hung in its GRPO cell until the
    collective timeout), and the train step still compiled twice. As for SFT
    (``posttrain.training.trainer.replicate_unplaced``), arrays not yet on a named sharding
    are replicated on the mesh with ``jax.device_put``, and ``_shard_optimizer`` becomes a
    no-op on this trainer: the step compiles once, with the same losses to the last bit
    (a 3-step ``posttrain grpo`` on qwen3-tiny, LoRA 4, 8 devices).
    """
    trainer = cluster.actor_trainer
    replicate_unplaced(trainer.optimizer, mesh)
    trainer._shard_optimizer = lambda mesh: None
