"""Tunix's DPO/ORPO trainer as the installed release has it, detected by feature.

What differs across google-tunix 0.0.2-0.1.7 and main (``shared/research/tunix-rl.md``
4), and how each is absorbed here, never by version string:

=======================================  ==============================================
drift                                    read from
=======================================  ==============================================
``DpoTrainer`` / ``DPOTrainer`` and      the names the module defines
their configs (0.1.0 renames)
``algorithm``, ``lambda_orpo`` (0.1.4),  the config's dataclass fields
``enable_prompt_loss_orpo``,
``average_log_prob_orpo`` (main)
``dpo_loss_fn``'s keywords               its signature
the loss's return: ``(mean, aux)`` up    the returned object (:func:`loss_and_metrics`)
to 0.1.7, ``LossOutput`` of weighted
sums on main
``rewards/*``: raw log-ratios (0.0.2),   running the loss once on a two-token example
beta-scaled (0.1.3+)                     (:func:`rewards_are_scaled`)
=======================================  ==============================================

The eval-loss bug of <= 0.1.2 (``eval_loss_fn`` never set, so eval ran PeftTrainer's
default loss on DPO inputs) is absorbed by the trainer, which sets both losses
(:class:`posttrain.preference.trainer.DPOTrainer`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect

import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain.training import tunix_loss

#: The metrics every release's loss reports, by their Tunix names.
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margin",
    "rewards/accuracy",
    "log_probs/chosen",
    "log_probs/rejected",
)


class UnknownPreferenceShapeError(RuntimeError):
    """The installed Tunix's DPO trainer has a shape this package does not know."""


def _module():
    try:
        return importlib.import_module("tunix.sft.dpo.dpo_trainer")
    except ImportError as e:
        raise UnknownPreferenceShapeError(
            f"tunix.sft.dpo.dpo_trainer does not import ({e}); expected in every release"
        ) from None


def _first(module, names: tuple[str, ...]):
    for name in names:
        if hasattr(module, name):
            return getattr(module, name)
    raise UnknownPreferenceShapeError(f"{module.__name__} defines none of {', '.join(names)}")


def trainer_class() -> type:
    """Tunix's DPO trainer class (``DPOTrainer``, ``DpoTrainer`` in 0.0.2)."""
    return _first(_module(), ("DPOTrainer", "DpoTrainer"))


def config_class() -> type:
    """Tunix's DPO training config (``DPOTrainingConfig``, ``DpoTrainingConfig`` in 0.0.2)."""
    return _first(_module(), ("DPOTrainingConfig", "DpoTrainingConfig"))


def loss_fn():
    """Tunix's ``dpo_loss_fn(model, train_example, **hyperparameters)``."""
    return _first(_module(), ("dpo_loss_fn",))


def compute_logps():
    """Tunix's jitted ``compute_logps(model, input_ids, positions, attention_mask,
    logits_to_keep, completion_mask, ...)`` -> ``(chosen [pairs], rejected [pairs], ...)``
    summed completion log-probabilities (main adds a third value)."""
    return _first(_module(), ("compute_logps",))


def example_logps(model, example) -> tuple:
    """``(chosen [pairs], rejected [pairs])`` summed completion log-probabilities of
    ``model`` on one Tunix ``TrainExample`` (a trainer's ``_prepare_inputs`` of a batch),
    through :func:`compute_logps`."""
    return compute_logps()(
        model,
        example.input_ids,
        example.positions,
        example.attention_mask,
        example.logits_to_keep,
        example.completion_mask,
    )[:2]


def config_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(config_class())}


def available_algorithms() -> tuple[str, ...]:
    """``("dpo",)``, plus ``"orpo"`` where the config has ``algorithm`` and
    ``lambda_orpo`` (google-tunix >= 0.1.4)."""
    fields = config_fields()
    return ("dpo", "orpo") if {"algorithm", "lambda_orpo"} <= fields else ("dpo",)


def check_algorithm(algorithm: str) -> None:
    """Raises ValueError (one line) unless the installed release has ``algorithm``."""
    algorithms = available_algorithms()
    if algorithm not in algorithms:
        raise ValueError(
            f"--algorithm {algorithm!r}: the installed Tunix has {', '.join(algorithms)} "
            "(ORPO arrives in google-tunix 0.1.4)"
        )


def training_config(
    *, algorithm: str, beta: float, label_smoothing: float, lambda_orpo: float, **peft
):
    """Tunix's DPO config with ``peft`` (``PeftTrainer``'s ``TrainingConfig`` fields).

    ``algorithm`` and ``lambda_orpo`` are passed only where the release has them; main's
    ORPO options keep Tunix's defaults.

    Raises:
      ValueError: ``algorithm`` is not one the release has (:func:`available_algorithms`).
    """
    check_algorithm(algorithm)
    values = {"beta": beta, "label_smoothing": label_smoothing, **peft}
    if "algorithm" in config_fields():
        values.update(algorithm=algorithm, lambda_orpo=lambda_orpo)
    return config_class()(**values)


def loss_and_metrics(result) -> tuple:
    """``(mean loss, {metric: mean})`` of what Tunix's DPO loss returned
    (:func:`posttrain.sft.tunix_loss.loss_and_metrics`: ``(loss, aux)`` up to
    google-tunix 0.1.7, main's ``LossOutput``).

    Raises:
      UnknownPreferenceShapeError: neither shape.
    """
    try:
        return tunix_loss.loss_and_metrics(result)
    except tunix_loss.UnknownLossShapeError as error:
        raise UnknownPreferenceShapeError(f"dpo_loss_fn: {error}") from None


def train_example(**values):
    """Tunix's ``TrainExample`` from ``values``, the fields the release does not have
    dropped (``images``, main's ``full_mask``).

    Raises:
      UnknownPreferenceShapeError: the release requires a field not in ``values``.
    """
    cls = _first(_module(), ("TrainExample",))
    fields = dataclasses.fields(cls)
    missing = [
        f.name
        for f in fields
        if f.name not in values
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise UnknownPreferenceShapeError(f"Tunix's TrainExample needs {missing}")
    return cls(**{f.name: values[f.name] for f in fields if f.name in values})


@functools.cache
def rewards_are_scaled() -> bool:
    """Whether the installed loss reports ``rewards/*`` as ``beta x`` log-ratio
    (google-tunix >= 0.1.3) rather than the raw log-ratio (0.0.2).

    Found by running Tunix's ``dpo_loss_fn`` once, with beta 2, on a one-pair example
    whose policy gives each completion token log-probability log(1/2) and whose
    reference log-probabilities are 0: the chosen reward is then ``-log 2`` raw or
    ``-2 log 2`` scaled.
    """
    example = train_example(
        input_ids=jnp.zeros((2, 2), jnp.int32),
        positions=jnp.tile(jnp.arange(2, dtype=jnp.int32), (2, 1)),
        attention_mask=jnp.tril(jnp.ones((2, 2, 2), bool)),
        ref_chosen_logps=jnp.zeros((1,), jnp.float32),
        ref_rejected_logps=jnp.zeros((1,), jnp.float32),
        completion_mask=jnp.ones((2, 1), jnp.int32),
        logits_to_keep=1,
    )
    _, metrics = loss_and_metrics(
        loss_fn()(
            _UniformModel(),
            train_example=example,
            **_hyper(beta=2.0, label_smoothing=0.0, algorithm="dpo"),
        )
    )
    chosen = float(metrics["rewards/chosen"])
    if np.isclose(chosen, -2 * np.log(2.0), atol=1e-5):
        return True
    if np.isclose(chosen, -np.log(2.0), atol=1e-5):
        return False
    raise UnknownPreferenceShapeError(
        f"Tunix's dpo_loss_fn reported rewards/chosen {chosen} on the probe; expected "
        f"{-2 * np.log(2.0):.4f} (scaled by beta 2) or {-np.log(2.0):.4f} (raw)"
    )


def _hyper(**values) -> dict:
    """``values`` restricted to the keywords the installed ``dpo_loss_fn`` takes."""
    params = inspect.signature(loss_fn()).parameters
    return {k: v for k, v in values.items() if k in params}


class _UniformModel(nnx.Module):
    """Tunix's calling convention over a two-token vocabulary with equal logits: every
    token has log-probability log(1/2). The probe of :func:`rewards_are_scaled`."""

    def __call__(self, input_tokens, positions=None, cache=None, attention_mask=None):
        batch, seq = input_tokens.shape
        return jnp.zeros((batch, seq, 2), jnp.float32), None


def surface() -> dict[str, str]:
    """What the installed release offers, by feature (the matrix and docs print it)."""
    params = inspect.signature(trainer_class().__init__).parameters
    return {
        "trainer": trainer_class().__name__,
        "config": config_class().__name__,
        "algorithms": ",".join(available_algorithms()),
        "config_fields": ",".join(
            sorted(
                config_fields()
                & {
                    "algorithm",
                    "lambda_orpo",
                    "enable_prompt_loss_orpo",
                    "average_log_prob_orpo",
                    "max_prompt_length",
                    "max_response_length",
                    "beta",
                    "label_smoothing",
                }
            )
        ),
        "constructor": ",".join(p for p in params if p != "self"),
        "loss_keywords": ",".join(p for p in inspect.signature(loss_fn()).parameters),
        "rewards": "beta-scaled" if rewards_are_scaled() else "raw log-ratio",
    }
