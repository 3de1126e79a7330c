"""The distillation objective: Tunix's strategy loss per target position, masked.

The same for every strategy (logit, feature and attention: :mod:`posttrain.distill.features`).

Tunix's ``LogitStrategy.compute_loss(student_output, teacher_output, labels)`` averages
its KL and cross-entropy over every position it is given: prompt and padding tokens would
enter the objective, and a micro-batch's mean cannot be summed into one large batch's.
So the strategy's own ``compute_loss`` (its temperature, ``T^2`` scaling, alpha and
``distill_top_k``, whatever the release computes) runs on each position alone
(``jax.vmap`` over ``[positions, 1, vocab]``, where its mean is that position's value), and
the values are summed over target positions only:

    loss = sum_t mask_t * l_t / step_target_tokens

with ``l_t = alpha * T^2 * KL(softmax(teacher_t / T) || softmax(student_t / T)) + (1 -
alpha) * CE(student_t, token_{t+1})`` for Tunix's ``LogitStrategy`` (Hinton et al. 2015,
arXiv:1503.02531), ``mask`` from :func:`posttrain.training.loss.target_mask` (completion
tokens of the same packed segment). Logits at t predict token t+1: the labels are
``input_tokens[:, 1:]``, one-hot (Tunix's ``optax.softmax_cross_entropy`` convention).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from posttrain.distill import logit_loss, tunix_distill
from posttrain.training import loss as sft_loss

#: what keeps the teacher's logits out of the gradient (one name, so a test can break it)
frozen = jax.lax.stop_gradient


def per_position(strategy, student, teacher, tokens: jax.Array):
    """``(loss [N], metrics {name: [N]})``: the strategy's ``compute_loss`` at each position.

    Args:
      strategy: a Tunix strategy with ``compute_loss(student_output, teacher_output, labels)``.
      student: ``[N, vocab]`` logits at the predicting positions (``LogitStrategy``), or
        ``{"logits": [N, vocab], "features": [N, L_s, D_s]}`` (the feature strategies).
      teacher: ``[N, vocab]`` logits, or ``[N, L_t, D_t]`` features.
      tokens: ``[N]`` int32, the predicted tokens.

    Each position is given to ``compute_loss`` as Tunix's arrays with a position axis of 1
    before the last axis (logits ``[1, vocab]``, features ``[L, 1, D]``), so its means are
    that position's values. Tunix's own ``LogitStrategy`` gets the same values written out
    instead, where they were checked equal (:mod:`posttrain.distill.logit_loss`; no
    metrics then: the objective reads none).
    """
    known = logit_loss.settings(strategy)
    if known is not None and logit_loss.agrees(strategy, known, _vmapped):
        return logit_loss.per_position(student, teacher, tokens, *known), {}
    return _vmapped(strategy, student, teacher, tokens)


def check_strategy(strategy) -> None:
    """Runs the check that :func:`per_position` makes of a ``LogitStrategy`` (whether the
    written-out loss equals its ``compute_loss``) now, outside any trace, so that the step
    finds it cached. Inside the step's jit trace, JAX releases older than the one main
    pins (the era environments, google-tunix 0.1.1's) handed the check's eager values back
    as tracers (``TracerArrayConversionError``)."""
    known = logit_loss.settings(strategy)
    if known is not None:
        logit_loss.agrees(strategy, known, _vmapped)


def _vmapped(strategy, student, teacher, tokens: jax.Array):
    """:func:`per_position` through the strategy's own ``compute_loss``, one position at a
    time."""
    logits = student["logits"] if isinstance(student, dict) else student
    labels = jax.nn.one_hot(tokens, logits.shape[-1], dtype=jnp.float32)

    def one(s, t, y):
        result = strategy.compute_loss(
            student_output=jax.tree.map(_one_position, s),
            teacher_output=jax.tree.map(_one_position, t),
            labels=y[None],
        )
        return tunix_distill.loss_and_metrics(result)

    return jax.vmap(one)(student, teacher, labels)


def _one_position(x: jax.Array) -> jax.Array:
    return jnp.expand_dims(x, -2)  # [..., 1, last]


def predicting(x: jax.Array) -> jax.Array:
    """``[B, T, V] -> [B (T-1), V]`` logits, or features ``[L, B, T, D] -> [B (T-1), L,
    D]``: the positions that predict a next token, flattened batch-major."""
    if x.ndim == 3:
        return x[:, :-1].reshape(-1, x.shape[-1])  # [B (T-1), V]
    layers, _, _, width = x.shape
    per_token = jnp.transpose(x[:, :, :-1], (1, 2, 0, 3))  # [B, T-1, L, D]
    return per_token.reshape(-1, layers, width)  # [B (T-1), L, D]


def kl_to_teacher(student: jax.Array, teacher: jax.Array) -> jax.Array:
    """``[...]`` float32 ``KL(softmax(teacher) || softmax(student))`` at temperature 1, per
    position (the figure ``posttrain distill`` reports; not the objective)."""
    return _kl(jax.nn.log_softmax(student.astype(jnp.float32), axis=-1), teacher)


def _kl(s_log: jax.Array, teacher: jax.Array) -> jax.Array:
    """:func:`kl_to_teacher` from the student's float32 log-probabilities."""
    t_log = jax.nn.log_softmax(teacher.astype(jnp.float32), axis=-1)
    return jnp.sum(jnp.exp(t_log) * (t_log - s_log), axis=-1)


def distill_terms(strategy, student, teacher_output, input_tokens, input_mask, segment_ids):
    """Sums over target positions -> ``{"distill_sum", "nll_sum", "target_tokens"}`` and,
    for the logit strategy, ``"kl_sum"`` (float32 scalars).

    Args:
      student: ``[batch, seq, vocab]`` logits (``LogitStrategy``), or ``{"logits": ...,
        "features": [L_s, batch, seq, D_s]}`` (the feature strategies; projected ones
        ``[L_t, ..., D_t]``).
      teacher_output: what the strategy's ``get_teacher_outputs`` gave: ``[batch, seq,
        vocab]`` logits (any float dtype; bf16 too) or ``[L_t, batch, seq, D_t]``
        features; a constant here (``frozen``).
      input_tokens, input_mask, segment_ids: ``[batch, seq]`` (:mod:`posttrain.training.loss`).

    Raises:
      ValueError: the logit strategy's vocabularies differ.
    """
    logits = student["logits"] if isinstance(student, dict) else student
    if not isinstance(student, dict) and logits.shape != teacher_output.shape:
        raise ValueError(
            f"student logits {logits.shape} and teacher logits "
            f"{teacher_output.shape}: expected the same [batch, seq, vocab]"
        )
    targets = sft_loss.target_mask(input_mask, segment_ids)  # [B, T-1]
    positions = jax.tree.map(predicting, student)
    teacher = predicting(frozen(teacher_output))
    tokens = input_tokens[:, 1:].reshape(-1)
    weight = targets.reshape(-1).astype(jnp.float32)
    loss, _ = per_position(strategy, positions, teacher, tokens)
    s_log = jax.nn.log_softmax(predicting(logits).astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(s_log, tokens[:, None], axis=-1)[:, 0]
    terms = {
        "distill_sum": jnp.sum(weight * loss),
        "nll_sum": jnp.sum(weight * nll),
        "target_tokens": jnp.sum(weight),
    }
    if not isinstance(student, dict):  # the teacher's logits are here: the KL is free
        terms["kl_sum"] = jnp.sum(weight * _kl(s_log, teacher))  # s_log: shared with nll
    return terms
