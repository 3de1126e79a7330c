"""Tunix's RL stack (``RLCluster`` / ``RLEngine``, the GRPO learners, their configs)
around our policy: the one place its drift is absorbed, detected by feature (signatures,
dataclass fields, attributes), never by a version string.

What differs between google-tunix releases, and how each is found
(``shared/research/tunix-rl.md`` 2.1-2.8; pinned on every installable wheel by
``contracts/test_tunix_rl.py``; :func:`surface` reports what was found):

- learner classes: ``GrpoLearner`` (0.0.2), ``GRPOLearner`` (0.1.0+), ``DAPOLearner``
  (0.1.4+), ``DrGRPOLearner`` (0.1.6+); by module attributes;
- the learner's config keyword ``grpo_config`` (<= 0.1.3) or ``algo_config`` (0.1.4+),
  and its cluster keyword ``rl_cluster`` or ``rl_engine`` (main); by the constructor's
  parameters; the cluster class ``RLCluster`` or ``RLEngine`` (main), by attribute;
- the micro-batch field ``training_micro_batch_size`` (<= 0.1.1) or
  ``train_micro_batch_size`` (0.1.2+); by ``RLTrainingConfig``'s fields;
- ``RolloutConfig``'s ``eos_tokens``, ``data_type`` (0.1.2+), ``return_logprobs``
  (0.1.6+); by its fields;
- the metric_fn keyword for advantages, ``advances`` (<= 0.1.5) or ``advantages``
  (0.1.6+); by the learner's source;
- reward_fn kwargs: columns, ``mode``, ``trajectory_ids``, plus matching
  ``algo_config`` fields from 0.1.6; by ``tunix.rl.reward_manager``'s presence;
- trainer logps at the rollout temperature (0.1.7+) and ``compute_per_token_logps``'s
  ``(model, ...)`` (<= 0.1.5) or ``(graphdef, state, ...)`` (0.1.6+); by its parameters;
- ``MetricsLogger.log(name, value, mode, step)`` (<= 0.1.3) or with a leading
  ``metrics_prefix`` (0.1.4+); by its signature.

A shape none of these covers is :class:`UnknownRLShapeError` at construction, naming
what was found.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from posttrain.config import choices
from posttrain.rl.options import GRPOAlgorithm
from posttrain.training import tunix_loss

ALGORITHMS = choices(GRPOAlgorithm)

#: algorithm -> (learner class names, config class names, first release), newest first.
_CLASSES = {
    "grpo": (("GRPOLearner", "GrpoLearner"), ("GRPOConfig", "GrpoConfig"), "0.0.2"),
    "dapo": (("DAPOLearner",), ("DAPOConfig",), "0.1.4"),
    "drgrpo": (("DrGRPOLearner",), ("DrGRPOConfig",), "0.1.6"),
}
_MODULES = {
    "grpo": "tunix.rl.grpo.grpo_learner",
    "dapo": "tunix.rl.grpo.dapo_learner",
    "drgrpo": "tunix.rl.grpo.drgrpo_learner",
}


class UnknownRLShapeError(RuntimeError):
    """The installed Tunix's RL stack has a shape this adapter does not know."""


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _first(names: Sequence[str], available, what: str) -> str:
    for name in names:
        if name in available:
            return name
    raise UnknownRLShapeError(f"{what}: none of {list(names)} in {sorted(available)}")


def learner_and_config(algorithm: str) -> tuple[type, type]:
    """``(learner class, config class)`` of ``algorithm`` in the installed Tunix.

    Raises:
      ValueError: ``algorithm`` is not one of :data:`ALGORITHMS`, or the installed Tunix
        does not have it (the message names the release that added it).
    """
    if algorithm not in _CLASSES:
        raise ValueError(f"algorithm={algorithm!r}: expected one of {', '.join(ALGORITHMS)}")
    learners, configs, since = _CLASSES[algorithm]
    try:
        module = importlib.import_module(_MODULES[algorithm])
    except ImportError:
        raise ValueError(
            f"algorithm={algorithm!r} needs google-tunix >= {since} "
            f"({_MODULES[algorithm]} is not in the installed release)"
        ) from None
    _register_grpo_helpers()
    names = set(vars(module))
    learner = getattr(module, _first(learners, names, f"{module.__name__} learner"))
    config = getattr(module, _first(configs, names, f"{module.__name__} config"))
    return learner, config


def _register_grpo_helpers() -> None:
    """Imports ``tunix.rl.grpo.grpo_helpers`` where it exists (up to google-tunix 0.1.4).

    In 0.1.4 the GRPO learner looks its advantage estimator up in
    ``tunix.rl.function_registry`` by name, but the ``"grpo"`` estimator is registered
    by ``grpo_helpers``, which only the agentic learner imports: a plain ``GRPOLearner``
    fails its first step with ``LookupError: No function named 'grpo' in category
    'advantage_estimator'`` (found by the matrix; 0.1.5 moved the estimator into
    ``grpo_learner``). Importing the module registers it; earlier releases call it
    directly, later ones do not have it."""
    name = "tunix.rl.grpo.grpo_helpers"
    if importlib.util.find_spec(name) is not None:
        importlib.import_module(name)


def available_algorithms() -> tuple[str, ...]:
    """The :data:`ALGORITHMS` the installed Tunix has."""
    out = []
    for name in ALGORITHMS:
        try:
            learner_and_config(name)
        except ValueError:
            continue
        out.append(name)
    return tuple(out)


def algo_config(algorithm: str, **values):
    """The installed release's config of ``algorithm`` (``GRPOConfig`` & co.) with
    ``values``; a value whose field the release lacks is left out only when it is None.

    Raises:
      ValueError: a non-None value names a field the release's config does not have.
    """
    _, config = learner_and_config(algorithm)
    fields = _fields(config)
    unknown = sorted(k for k, v in values.items() if k not in fields and v is not None)
    if unknown:
        raise ValueError(
            f"{config.__name__} of the installed Tunix has no field {', '.join(unknown)}"
        )
    return config(**{k: v for k, v in values.items() if k in fields and v is not None})


def _cluster_module():
    from tunix.rl import rl_cluster

    return rl_cluster


def cluster_class() -> type:
    """``RLEngine`` where the release has it (main), else ``RLCluster``."""
    module = _cluster_module()
    return getattr(module, _first(("RLEngine", "RLCluster"), set(vars(module)), "rl_cluster"))


def training_config(*, micro_batch_size: int, **values):
    """``RLTrainingConfig`` with the micro-batch size under the release's name
    (``training_micro_batch_size`` up to google-tunix 0.1.1, ``train_micro_batch_size``
    from 0.1.2). Integers are plain ``int`` (0.1.6-0.1.7 reject numpy integers)."""
    cls = _cluster_module().RLTrainingConfig
    name = _first(
        ("train_micro_batch_size", "training_micro_batch_size"),
        _fields(cls),
        "RLTrainingConfig micro-batch field",
    )
    plain = {k: int(v) if isinstance(v, np.integer) else v for k, v in values.items()}
    return cls(**plain, **{name: int(micro_batch_size)})


def rollout_config(**values):
    """``RolloutConfig`` with ``values``; ``eos_tokens``, ``data_type`` and
    ``return_logprobs`` are passed only where the release has them (0.1.2+, 0.1.2+,
    0.1.6+); the other fields exist in every release.

    Raises:
      UnknownRLShapeError: a field every release has is missing.
    """
    from tunix.rl.rollout import base_rollout

    cls = base_rollout.RolloutConfig
    fields = _fields(cls)
    optional = {"eos_tokens", "data_type", "return_logprobs"}
    missing = sorted(k for k in values if k not in fields and k not in optional)
    if missing:
        raise UnknownRLShapeError(f"RolloutConfig has no field {', '.join(missing)}")
    return cls(**{k: v for k, v in values.items() if k in fields})


def accumulates_micro_batches() -> bool:
    """Whether the installed GRPO averages a mini-batch's training micro-batches into one
    optimizer update: its ``RLTrainingConfig`` derives ``gradient_accumulation_steps``
    from the mini- and micro-batch sizes (0.1.0+). google-tunix 0.0.2 derives nothing
    (its micro-batch "must be the same as the input batch size"): each micro-batch
    there takes an update of its own. A probe of the release's own config, not its
    version."""
    probe = training_config(
        actor_optimizer=optax.sgd(1.0),
        eval_every_n_steps=1,
        max_steps=1,
        mini_batch_size=2,
        micro_batch_size=1,
    )
    return getattr(probe, "gradient_accumulation_steps", None) == 2  # upstream's config


def rollout_takes_data_type() -> bool:
    """Whether the installed ``RolloutConfig`` has ``data_type`` (0.1.2+): the dtype
    Tunix casts a rollout copy on another mesh to."""
    from tunix.rl.rollout import base_rollout

    return "data_type" in _fields(base_rollout.RolloutConfig)


def cluster(*, actor, reference, tokenizer, meshes: dict[str, Any], training, rollout):
    """Tunix's cluster (``RLCluster`` or ``RLEngine``) on the vanilla rollout engine.

    Args:
      actor, reference: :class:`~posttrain.training.policy.TunixPolicy` modules, each already
        placed on its role's mesh.
      tokenizer: a :class:`~posttrain.tunix_sampler.TunixTokenizer`.
      meshes: ``{"actor": mesh, "reference": mesh, "rollout": mesh}``.
      training, rollout: from :func:`training_config` and :func:`rollout_config`.
    """
    module = _cluster_module()
    role = module.Role
    config = module.ClusterConfig(
        role_to_mesh={
            role.ACTOR: meshes["actor"],
            role.REFERENCE: meshes["reference"],
            role.ROLLOUT: meshes["rollout"],
        },
        rollout_engine="vanilla",
        offload_to_cpu=False,
        training_config=training,
        rollout_config=rollout,
    )
    return cluster_class()(
        actor=actor, reference=reference, tokenizer=tokenizer, cluster_config=config
    )


def learner(algorithm: str, rl_cluster, config, reward_fns, metric_fns=None, seed=None):
    """The learner of ``algorithm`` over ``rl_cluster``, called with the keywords its
    constructor has (``rl_cluster`` or ``rl_engine``; ``grpo_config`` or
    ``algo_config``).

    Raises:
      UnknownRLShapeError: the constructor has neither spelling of one of them.
    """
    cls, _ = learner_and_config(algorithm)
    params = set(inspect.signature(cls.__init__).parameters)
    cluster_kw = _first(("rl_engine", "rl_cluster"), params, f"{cls.__name__}.__init__ cluster")
    config_kw = _first(("algo_config", "grpo_config"), params, f"{cls.__name__}.__init__ config")
    return cls(
        **{cluster_kw: rl_cluster, config_kw: config},
        reward_fns=list(reward_fns),
        metric_fns=list(metric_fns or []),
        data_shuffle_seed=seed,
    )


def surface() -> dict[str, str]:
    """What this adapter found in the installed Tunix, one line per drifting surface
    (``posttrain grpo`` prints it and records it in ``run.json``)."""
    cls, config = learner_and_config("grpo")
    params = set(inspect.signature(cls.__init__).parameters)
    micro = _first(
        ("train_micro_batch_size", "training_micro_batch_size"),
        _fields(_cluster_module().RLTrainingConfig),
        "RLTrainingConfig micro-batch field",
    )
    return {
        "cluster": cluster_class().__name__,
        "learner": f"{cls.__name__}({_first(('rl_engine', 'rl_cluster'), params, 'cluster')}, "
        f"{_first(('algo_config', 'grpo_config'), params, 'config')}) with {config.__name__}",
        "algorithms": ", ".join(available_algorithms()),
        "micro-batch field": micro,
        "accumulates micro-batches": "yes" if accumulates_micro_batches() else "no",
        "metric_fn advantages keyword": advantages_keyword(),
        "reward kwargs from algo_config": "yes" if reward_kwargs_from_algo_config() else "no",
        "trainer logps at rollout temperature": "yes" if logps_follow_temperature() else "no",
    }


def advantages_keyword() -> str:
    """The keyword the installed GRPO learner passes advantages to ``metric_fns`` under:
    ``advances`` up to google-tunix 0.1.5, ``advantages`` from 0.1.6."""
    cls, _ = learner_and_config("grpo")
    source = inspect.getsource(cls._generate_and_compute_advantage)
    return "advances" if "advances=" in source else "advantages"


def metric_fn(fn: Callable[..., dict]) -> Callable[..., dict]:
    """``fn(prompts, completions, rewards, advantages, **columns)`` callable by every
    release: ``advances=`` (<= 0.1.5) arrives as ``advantages``."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if "advances" in kwargs:
            kwargs["advantages"] = kwargs.pop("advances")
        return fn(*args, **kwargs)

    return call


def reward_kwargs_from_algo_config() -> bool:
    """Whether the installed release passes ``algo_config`` fields to reward functions
    whose parameters match them (``tunix.rl.reward_manager``, google-tunix 0.1.6+)."""
    return importlib.util.find_spec("tunix.rl.reward_manager") is not None


def logps_follow_temperature() -> bool:
    """Whether Tunix's trainer logps divide the logits by the rollout temperature
    (google-tunix 0.1.7+: ``compute_per_token_logps`` takes ``temperature``)."""
    from tunix.rl import common

    return "temperature" in inspect.signature(common.compute_per_token_logps).parameters


def per_token_logps(
    model, prompt_tokens, completion_tokens, *, pad_id: int, eos_id: int, temperature=1.0
):
    """Tunix's ``compute_per_token_logps`` of ``completion_tokens`` after
    ``prompt_tokens`` (``[B, P]`` left-padded, ``[B, C]``): ``[B, C]`` float32, under
    whichever calling convention the release has (the model, or its ``nnx.split``; the
    logps alone, where releases up to 0.1.3 return ``(logps, logits)``).
    ``temperature`` divides the logits where the release does so
    (:func:`logps_follow_temperature`), as its trainer does with the rollout's; earlier
    releases ignore it, as their trainers do."""
    from tunix.rl import common

    params = inspect.signature(common.compute_per_token_logps).parameters
    head = (model,) if "model" in params else nnx.split(model)
    extra = {"temperature": temperature} if "temperature" in params else {}
    if "return_logits" in params:
        extra["return_logits"] = False
    out = common.compute_per_token_logps(
        *head, prompt_tokens, completion_tokens, pad_id=pad_id, eos_id=eos_id, **extra
    )
    return out[0] if isinstance(out, tuple) else out  # (logps, logits) up to 0.1.3


def moe_aux_loss(policy, example) -> jax.Array:
    """The unweighted ``moe_aux_loss`` of ``policy`` (a ``TunixPolicy``) on a Tunix
    ``TrainExample``'s prompt + completion, with the positions and the causal x non-pad
    mask Tunix's logps path builds (``shared/research/tunix-rl.md`` 3.4)."""
    tokens = jnp.concatenate([example.prompt_ids, example.completion_ids], axis=1)
    real = jnp.concatenate([example.prompt_mask, example.completion_mask], axis=1).astype(bool)
    positions = jnp.maximum(jnp.cumsum(real, axis=1) - 1, 0).astype(jnp.int32)
    seq = tokens.shape[1]
    causal = jnp.tril(jnp.ones((seq, seq), bool))
    mask = causal[None] & real[:, None, :] & real[:, :, None]
    _, aux = policy.model.forward(tokens, positions, mask)
    return aux["moe_aux_loss"].astype(jnp.float32)


def with_moe_aux_loss(trainer, weight: float) -> None:
    """Adds ``weight x`` the actor's ``moe_aux_loss`` to the loss of Tunix's actor trainer.

    Tunix's policy losses see logits only, so the load-balancing term of an MoE actor
    is lost (``shared/research/tunix-rl.md`` 0.3). The learner installs its loss with
    ``with_loss_fn(fn, has_aux=True)``; this wraps that function: the wrapper runs the
    policy's forward on the same ``TrainExample`` (:func:`moe_aux_loss`) and adds the
    weighted term to the loss only (the logged metrics are Tunix's). The term cannot be
    taken from Tunix's own forward, which runs inside its jitted
    ``compute_per_token_logps`` and returns logits only; so an MoE actor pays one more
    forward per micro-batch (XLA may share it). A no-op when ``weight`` is 0.

    Raises:
      UnknownRLShapeError: the trainer has no ``loss_fn`` / ``with_loss_fn``, or its
        loss is not called with a ``train_example``.
    """
    if not weight:
        return
    if not (hasattr(trainer, "loss_fn") and hasattr(trainer, "with_loss_fn")):
        raise UnknownRLShapeError(f"{type(trainer).__name__} has no loss_fn / with_loss_fn")
    inner = trainer.loss_fn

    @functools.wraps(inner)
    def loss_fn(model, *args, **kwargs):
        out = inner(model, *args, **kwargs)
        example = kwargs.get("train_example", args[0] if args else None)
        if example is None or not hasattr(example, "completion_ids"):
            raise UnknownRLShapeError("the actor's loss is called without a train_example")
        # (loss, aux) up to 0.1.7, main's LossOutput (a weighted sum) after
        return tunix_loss.add_to_loss(out, weight * moe_aux_loss(model, example))

    trainer.with_loss_fn(loss_fn, has_aux=True)
