"""Tunix's distillation surface as the installed release has it, detected by feature.

``tunix.distillation`` (google-tunix 0.1.5, 0.1.7; read from their sources) offers
``DistillationTrainer(student_model, teacher_model, strategy, optimizer,
training_config)`` over ``PeftTrainer``, and strategies built from
``(student_forward_fn, teacher_forward_fn, labels_fn, ...)``. What differs, and how each is
absorbed here, never by version string:

=======================================  ==============================================
drift                                    read from
=======================================  ==============================================
``LogitStrategy(..., distill_top_k)``    its ``__init__`` signature
(0.1.7); refused in one line where
absent (:func:`logit_strategy`)
a strategy's loss: a scalar (0.1.5) or   the object ``compute_loss`` returns
``(loss, metrics)`` (0.1.7, with the     (:func:`loss_and_metrics`)
trainer's ``_standardize_loss_output``
and ``_has_aux = True``)
=======================================  ==============================================

Where the teacher runs, in every release seen: ``DistillationTrainer._prepare_inputs``,
through ``strategy.get_teacher_outputs`` (its own ``nnx.jit`` of the teacher forward,
then ``jax.lax.stop_gradient``), outside the jitted train step; skipped in eval.
"""

from __future__ import annotations

import importlib
import inspect

import jax.numpy as jnp

#: ``--strategy`` names and Tunix's class names.
STRATEGIES = {
    "logit": "LogitStrategy",
    "feature-pooling": "FeaturePoolingStrategy",
    "feature-projection": "FeatureProjectionStrategy",
    "attention-transfer": "AttentionTransferStrategy",
}


class UnknownDistillationShapeError(RuntimeError):
    """The installed Tunix's distillation surface has a shape this package does not know."""


def available() -> bool:
    """Whether the installed Tunix has ``tunix.distillation`` (with its strategies)."""
    try:
        importlib.import_module("tunix.distillation")
        importlib.import_module("tunix.distillation.strategies")
    except ImportError:
        return False
    return True


def _module(name: str):
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise UnknownDistillationShapeError(f"{name} does not import ({e})") from None


def trainer_class() -> type:
    """Tunix's ``DistillationTrainer``."""
    return _module("tunix.distillation").DistillationTrainer


def config_class() -> type:
    """Tunix's distillation ``TrainingConfig`` (a ``PeftTrainer`` ``TrainingConfig``)."""
    return _module("tunix.distillation").TrainingConfig


def strategy_class(name: str) -> type:
    """Tunix's strategy class for the ``--strategy`` ``name``.

    Raises:
      ValueError: ``name`` is not one of :data:`STRATEGIES`, or the release lacks it.
    """
    if name not in STRATEGIES:
        raise ValueError(f"--strategy {name!r}: expected one of {', '.join(STRATEGIES)}")
    strategies = _module("tunix.distillation.strategies")
    if not hasattr(strategies, STRATEGIES[name]):
        raise ValueError(f"--strategy {name!r}: the installed Tunix has no {STRATEGIES[name]}")
    return getattr(strategies, STRATEGIES[name])


def strategy_parameters(name: str) -> tuple[str, ...]:
    """The keyword parameters of the strategy's ``__init__`` (without ``self``)."""
    return tuple(
        p for p in inspect.signature(strategy_class(name).__init__).parameters if p != "self"
    )


def has_top_k() -> bool:
    """Whether ``LogitStrategy`` takes ``distill_top_k`` (google-tunix >= 0.1.7)."""
    return "distill_top_k" in strategy_parameters("logit")


def check_strategy(name: str, distill_top_k: int) -> None:
    """Raises ValueError (one line) unless the run can use ``name`` with ``distill_top_k``."""
    strategy_class(name)
    if distill_top_k and name != "logit":
        raise ValueError(
            f"--distill-top-k {distill_top_k}: only --strategy logit truncates logits "
            f"(got --strategy {name!r}); use 0"
        )
    if distill_top_k < 0:
        raise ValueError(f"--distill-top-k {distill_top_k}: expected 0 (off) or a positive count")
    if distill_top_k and not has_top_k():
        raise ValueError(
            f"--distill-top-k {distill_top_k}: the installed Tunix's LogitStrategy has no "
            "distill_top_k (google-tunix >= 0.1.7); use 0"
        )


def logit_strategy(
    student_forward_fn, teacher_forward_fn, labels_fn, *, temperature, alpha, distill_top_k=0
):
    """Tunix's ``LogitStrategy``; ``distill_top_k`` passed only where the release has it.

    Raises:
      ValueError: ``distill_top_k`` > 0 where the release lacks it; Tunix's own checks
        (temperature > 0, 0 <= alpha <= 1).
    """
    check_strategy("logit", distill_top_k)
    extra = {"distill_top_k": distill_top_k} if has_top_k() else {}
    return strategy_class("logit")(
        student_forward_fn,
        teacher_forward_fn,
        labels_fn,
        temperature=temperature,
        alpha=alpha,
        **extra,
    )


def loss_and_metrics(result) -> tuple:
    """``(loss, {metric: value})`` of what a strategy's ``compute_loss`` returned: a
    scalar array (0.1.5: no metrics) or ``(loss, metrics)`` (0.1.7).

    Raises:
      UnknownDistillationShapeError: neither.
    """
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict):
        return result[0], dict(result[1])
    if hasattr(result, "shape") and hasattr(result, "dtype"):
        return result, {}
    raise UnknownDistillationShapeError(
        f"a Tunix distillation loss returned {type(result).__name__}; expected an array "
        "or (loss, metrics)"
    )


def loss_convention() -> str:
    """``"(loss, metrics)"`` or ``"scalar"``: what ``LogitStrategy.compute_loss`` returns,
    found by running it once on a two-position, two-token example."""
    strategy = logit_strategy(_identity, _identity, _identity, temperature=1.0, alpha=0.5)
    logits = jnp.zeros((1, 2, 2), jnp.float32)
    result = strategy.compute_loss(
        student_output=logits, teacher_output=logits, labels=jnp.eye(2)[None]
    )
    loss_and_metrics(result)  # raises on an unknown shape
    return "(loss, metrics)" if isinstance(result, tuple) else "scalar"


def _identity(*args, **kwargs):
    return args[0] if args else None


def surface() -> dict[str, str]:
    """What the installed release offers, by feature (the matrix and docs print it)."""
    params = inspect.signature(trainer_class().__init__).parameters
    return {
        "trainer": trainer_class().__name__,
        "constructor": ",".join(p for p in params if p != "self"),
        "strategies": ",".join(n for n in STRATEGIES if _has_strategy(n)),
        "logit_parameters": ",".join(strategy_parameters("logit")),
        "distill_top_k": "yes" if has_top_k() else "no",
        "loss": loss_convention(),
        "standardize_loss_output": "yes"
        if hasattr(trainer_class(), "_standardize_loss_output")
        else "no",
        "teacher": "_prepare_inputs",
    }


def _has_strategy(name: str) -> bool:
    return hasattr(_module("tunix.distillation.strategies"), STRATEGIES[name])
