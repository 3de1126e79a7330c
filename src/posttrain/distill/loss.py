"""The distillation objective: Tunix's strategy loss per target position, masked.

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
arXiv:1503.02531), ``mask`` from :func:`posttrain.sft.loss.target_mask` (completion
tokens of the same packed segment). Logits at t predict token t+1: the labels are
``input_tokens[:, 1:]``, one-hot (Tunix's ``optax.softmax_cross_entropy`` convention).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from posttrain.distill import tunix_distill
from posttrain.sft import loss as sft_loss

#: what keeps the teacher's logits out of the gradient (one name, so a test can break it)
frozen = jax.lax.stop_gradient


def per_position(strategy, student: jax.Array, teacher: jax.Array, tokens: jax.Array):
    """``(loss [N], metrics {name: [N]})``: the strategy's ``compute_loss`` at each position.

    Args:
      strategy: a Tunix strategy with ``compute_loss(student_output, teacher_output, labels)``.
      student, teacher: ``[N, vocab]`` logits at the predicting positions.
      tokens: ``[N]`` int32, the predicted tokens.
    """
    vocab = student.shape[-1]
    labels = jax.nn.one_hot(tokens, vocab, dtype=jnp.float32)

    def one(s, t, y):
        result = strategy.compute_loss(
            student_output=s[None], teacher_output=t[None], labels=y[None]
        )
        return tunix_distill.loss_and_metrics(result)

    return jax.vmap(one)(student, teacher, labels)


def kl_to_teacher(student: jax.Array, teacher: jax.Array) -> jax.Array:
    """``[...]`` float32 ``KL(softmax(teacher) || softmax(student))`` at temperature 1, per
    position (the figure ``posttrain distill`` reports; not the objective)."""
    t_log = jax.nn.log_softmax(teacher.astype(jnp.float32), axis=-1)
    s_log = jax.nn.log_softmax(student.astype(jnp.float32), axis=-1)
    return jnp.sum(jnp.exp(t_log) * (t_log - s_log), axis=-1)


def distill_terms(strategy, student_logits, teacher_logits, input_tokens, input_mask, segment_ids):
    """Sums over target positions -> ``{"distill_sum", "nll_sum", "kl_sum",
    "target_tokens"}`` (float32 scalars).

    Args:
      student_logits, teacher_logits: ``[batch, seq, vocab]`` (any float dtype; the
        teacher's may be bf16), from the same tokens.
      input_tokens, input_mask, segment_ids: ``[batch, seq]`` (:mod:`posttrain.sft.loss`).

    Raises:
      ValueError: the vocabularies differ.
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student logits {student_logits.shape} and teacher logits "
            f"{teacher_logits.shape}: expected the same [batch, seq, vocab]"
        )
    targets = sft_loss.target_mask(input_mask, segment_ids)  # [B, T-1]
    vocab = student_logits.shape[-1]
    student = student_logits[:, :-1].reshape(-1, vocab)
    teacher = frozen(teacher_logits[:, :-1]).reshape(-1, vocab)
    tokens = input_tokens[:, 1:].reshape(-1)
    weight = targets.reshape(-1).astype(jnp.float32)
    loss, _ = per_position(strategy, student, teacher, tokens)
    s_log = jax.nn.log_softmax(student.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(s_log, tokens[:, None], axis=-1)[:, 0]
    return {
        "distill_sum": jnp.sum(weight * loss),
        "nll_sum": jnp.sum(weight * nll),
        "kl_sum": jnp.sum(weight * kl_to_teacher(student, teacher)),
        "target_tokens": jnp.sum(weight),
    }
