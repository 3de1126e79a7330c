"""What a Tunix loss function returns, in each release's shape: ``(loss, aux)``, a
scalar, or (main) a ``LossOutput`` of weighted metrics. Read by every workflow that
wraps a Tunix loss (``preference.tunix_dpo``, ``rl.tunix_rl``); no Tunix import."""

from __future__ import annotations

import jax.numpy as jnp


class UnknownLossShapeError(RuntimeError):
    """A Tunix loss function returned neither ``(loss, aux)``, an array nor ``LossOutput``."""


def loss_and_metrics(result) -> tuple:
    """``(mean loss, {metric: mean})`` of what a Tunix loss function returned.

    ``(loss, aux)`` up to google-tunix 0.1.7; main's ``LossOutput`` (``tunix.sft.utils``,
    from 2026-08): ``primary_loss`` and ``aux_metrics`` are ``WeightedMetric`` sums with
    their denominators, reduced here with the metric's own ``compute()`` (its ``eps`` and
    ``min_denom`` bounds included).

    Raises:
      UnknownLossShapeError: neither shape.
    """
    if isinstance(result, tuple) and len(result) == 2:
        loss, aux = result
        return loss, dict(aux)
    if hasattr(result, "primary_loss") and hasattr(result, "aux_metrics"):
        return _reduced(result.primary_loss), {
            k: _reduced(v) for k, v in result.aux_metrics.items()
        }
    raise UnknownLossShapeError(
        f"a Tunix loss returned {type(result).__name__}; expected (loss, aux) or LossOutput"
    )


def _reduced(metric):
    if hasattr(metric, "compute") and hasattr(metric, "unreduced_sum"):
        return metric.compute()
    return metric


def add_to_loss(result, term):
    """What a Tunix loss function returned, with ``term`` (a scalar) added to the loss it
    optimizes: ``(loss + term, aux)``, ``loss + term``, or a ``LossOutput`` whose primary
    ``WeightedMetric`` computes to its mean plus ``term`` (``term / scale`` added to the
    unreduced sum; unchanged where the denominator is 0 and the metric computes to 0).

    Raises:
      UnknownLossShapeError: none of those shapes.
    """
    if isinstance(result, tuple) and len(result) == 2:
        return result[0] + term, result[1]
    if hasattr(result, "primary_loss") and hasattr(result, "replace"):
        primary = result.primary_loss
        scale = primary.compute_scale()
        shift = jnp.where(scale > 0, term / jnp.where(scale > 0, scale, 1.0), 0.0)
        return result.replace(
            primary_loss=primary.replace(unreduced_sum=primary.unreduced_sum + shift)
        )
    if hasattr(result, "shape") and not getattr(result, "shape", None):
        return result + term
    raise UnknownLossShapeError(
        f"a Tunix loss returned {type(result).__name__}; expected (loss, aux), a scalar "
        "or LossOutput"
    )
