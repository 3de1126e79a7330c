"""The logit strategy's per-position loss written out, used where it equals Tunix's own.

:func:`posttrain.distill.loss.per_position` runs a strategy's ``compute_loss`` on each
target position alone (``jax.vmap`` over ``[positions, 1, vocab]``), so that prompt and
padding can be masked and micro-batches summed exactly. On CPU that vmap costs about three
times the same values written out (``[8, 256, 264]`` logits, forward and backward: 16.0 ms
against 4.7 ms, docs/benchmarks.md), and it was what kept a distillation step above
Tunix's own. For Tunix's ``LogitStrategy`` (google-tunix 0.1.7
``tunix/distillation/strategies/logit.py``, ``compute_loss``) this module computes

    l_t = alpha * T^2 * KL(softmax(t_t / T) || softmax(s_t / T)) + (1 - alpha) * CE(s_t, y_t)

(Hinton et al. 2015, arXiv:1503.02531), the KL over the teacher's ``distill_top_k``
largest logits when that is > 0, everything in float32. It is used only after
:func:`agrees` has checked, once per strategy class and settings, on a small random
batch, that it equals the strategy's own ``compute_loss`` at every position: a release
whose formula differs keeps running its own (and the contract
``test_the_written_out_logit_loss_is_tunix_s`` fails in its matrix row, saying so).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from posttrain.distill import tunix_distill

#: the tolerance of :func:`agrees` (float32 sums over a small vocabulary)
RTOL, ATOL = 1e-5, 1e-6

_AGREES: dict[tuple, bool] = {}


def settings(strategy) -> tuple[float, float, int] | None:
    """``(temperature, alpha, top_k)`` of Tunix's own ``LogitStrategy`` (not a subclass:
    it may compute otherwise); None for any other strategy or a release whose strategy
    keeps them under other names."""
    if type(strategy) is not tunix_distill.strategy_class("logit"):
        return None
    if not (hasattr(strategy, "temperature") and hasattr(strategy, "alpha")):
        return None
    top_k = strategy.distill_top_k if hasattr(strategy, "distill_top_k") else 0
    return float(strategy.temperature), float(strategy.alpha), int(top_k)


def per_position(
    student: jax.Array,
    teacher: jax.Array,
    tokens: jax.Array,
    temperature: float,
    alpha: float,
    top_k: int = 0,
) -> jax.Array:
    """``[N]`` float32 ``l_t`` (module docstring) from ``[N, vocab]`` student and teacher
    logits (any float dtype) and the ``[N]`` int32 predicted tokens."""
    s, t = student.astype(jnp.float32), teacher.astype(jnp.float32)
    s_soft, t_soft = s, t
    if top_k > 0:  # the teacher's top-k logits and the student's at the same indices
        t_soft, indices = jax.lax.top_k(t, top_k)
        s_soft = jnp.take_along_axis(s, indices, axis=-1)
    log_s = jax.nn.log_softmax(s_soft / temperature, axis=-1)
    t_probs = jax.nn.softmax(t_soft / temperature, axis=-1)
    kl = jnp.sum(jax.scipy.special.xlogy(t_probs, t_probs) - t_probs * log_s, axis=-1)
    ce = -jnp.take_along_axis(jax.nn.log_softmax(s, axis=-1), tokens[:, None], axis=-1)[:, 0]
    return alpha * temperature**2 * kl + (1.0 - alpha) * ce


def agrees(strategy, known: tuple[float, float, int], generic: Callable) -> bool:
    """Whether :func:`per_position` with ``known`` (:func:`settings`) equals
    ``generic(strategy, student, teacher, tokens)`` (the strategy's own ``compute_loss``
    per position) on 6 random positions of a vocabulary of ``max(32, 2 top_k)``, within
    :data:`RTOL` / :data:`ATOL`; computed once per strategy class and settings."""
    key = (type(strategy), *known)
    if key not in _AGREES:
        with jax.ensure_compile_time_eval():  # eager, also when called inside a jit trace
            _AGREES[key] = _check(strategy, known, generic)
    return _AGREES[key]


def _check(strategy, known: tuple[float, float, int], generic: Callable) -> bool:
    rng = np.random.default_rng(0)
    vocab = max(32, 2 * known[2])
    student = jnp.asarray(rng.normal(0.0, 3.0, (6, vocab)), jnp.float32)
    teacher = jnp.asarray(rng.normal(0.0, 3.0, (6, vocab)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, vocab, 6), jnp.int32)
    theirs, _ = generic(strategy, student, teacher, tokens)
    ours = per_position(student, teacher, tokens, *known)
    return bool(np.allclose(np.asarray(ours), np.asarray(theirs), rtol=RTOL, atol=ATOL))
