"""Next-token cross-entropy over completion tokens, with the MoE auxiliary loss.

Batch fields (``[batch, seq]`` unless noted; the names of Tunix's
``TrainingInput`` where one exists):

- ``input_tokens`` int32 token ids;
- ``input_mask`` bool/int, 1 where the token is a target (assistant tokens);
- ``positions`` int32 position of each token inside its segment;
- ``segment_ids`` int32, 1.. per packed sequence, 0 for padding;
- ``step_target_tokens`` ``[batch]`` int32 (optional): the number of target
  tokens in the whole optimizer step (every micro-batch of the accumulation
  window, global batch), the same value in every row;
- ``images`` (optional, Tunix's ``TrainingInput.images``): the rows' images, a
  :class:`posttrain.layers.vision.ImageBatch` (``pixels [batch, I, P, C]``,
  ``positions [batch, I, P, 2]``), passed to the model as ``images=``.

Token t is a target when ``input_mask[t]`` is set and token t-1 is in the same
(non-padding) segment; it is predicted from logits at t-1. The step objective
is ``sum(NLL over targets of the step) / step_target_tokens + moe_aux_weight *
mean(moe_aux_loss over micro-batches)``: the loss of one large batch, not a mean
of per-micro-batch means. Each micro-batch differentiates the term whose mean over
the step's micro-batches is that (:func:`step_objective`), as Tunix's accumulators
average the micro-gradients.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from posttrain.training import chunked_loss


def packed_attention_mask(segment_ids: jax.Array) -> jax.Array:
    """``[batch, seq, seq]`` bool: query t may see key s iff both are in the same segment.

    Combined with the causal mask by the attention layer; padding (segment 0)
    sees only padding, so no row is fully masked.
    """
    return segment_ids[:, :, None] == segment_ids[:, None, :]


def target_mask(input_mask: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """``[batch, seq-1]`` bool: which of ``input_tokens[:, 1:]`` are predicted targets."""
    same = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] > 0)
    return input_mask[:, 1:].astype(bool) & same


def token_nll(logits: jax.Array, input_tokens: jax.Array, targets: jax.Array) -> jax.Array:
    """Summed NLL (float32 scalar) of ``input_tokens[:, 1:]`` under ``logits[:, :-1]``.

    Only positions where ``targets`` is set count.

    Args:
      logits: ``[batch, seq, vocab]`` float32.
      input_tokens: ``[batch, seq]`` int32.
      targets: ``[batch, seq-1]`` bool from :func:`target_mask`.
    """
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, input_tokens[:, 1:, None], axis=-1)[..., 0]  # [B, T-1]
    return -jnp.sum(jnp.where(targets, picked, 0.0))


def sft_terms(
    model,
    input_tokens,
    input_mask,
    positions=None,
    segment_ids=None,
    images=None,
    *,
    chunked: bool = True,
    logit_chunk: int | None = None,
    **_,
):
    """Forward pass -> ``{"nll_sum", "target_tokens", "moe_aux_loss"}`` (float32 scalars).

    ``model`` is a :class:`posttrain.models.CausalLM` (``forward`` returns the
    MoE aux loss); ``images`` go to it as ``images=`` (None: text only); other keyword
    fields of the batch are ignored.

    ``chunked`` (default): the NLL is taken from the hidden states ``logit_chunk`` positions
    at a time (:func:`posttrain.training.chunked_loss.chunked_nll`, through ``forward``'s
    ``head`` so LoRA on ``lm_head`` applies; ``None``: about 512 MiB of float32 logits per
    device and chunk), never holding the batch's float32 logits ``[batch, seq, vocab]``;
    equal to :func:`token_nll` of the full logits up to float32 reassociation. ``False``:
    the full logits and :func:`token_nll`. SFT and vision SFT (this function) and the
    eval loss chunk; DPO/ORPO (per-sequence log-probabilities), distillation (the teacher's
    and student's full distributions) and GRPO keep the full logits.

    Raises:
      ValueError: ``logit_chunk`` is not a positive integer or None.
    """
    if segment_ids is None:
        segment_ids = jnp.ones_like(input_tokens)
    mask = packed_attention_mask(segment_ids)
    targets = target_mask(input_mask, segment_ids)
    kw = {} if images is None else {"images": images}  # text-only forwards have no images
    if chunked:
        head = functools.partial(
            chunked_loss.chunked_nll,
            input_tokens=input_tokens,
            targets=targets,
            chunk=logit_chunk,
        )
        nll, aux = model.forward(input_tokens, positions, mask, head=head, **kw)
    else:
        logits, aux = model.forward(input_tokens, positions, mask, **kw)
        nll = token_nll(logits, input_tokens, targets)
    return {
        "nll_sum": nll,
        "target_tokens": jnp.sum(targets).astype(jnp.float32),
        "moe_aux_loss": jnp.asarray(aux["moe_aux_loss"], jnp.float32),
    }


def step_objective(
    terms: dict, step_target_tokens, *, moe_aux_weight: float, grad_accum_steps: int
) -> jax.Array:
    """This micro-batch's objective: the mean of a step's micro-batch objectives is the
    step loss (Tunix's accumulators average the micro-gradients, so theirs is the step's
    gradient). The one place gradient accumulation's count scales the loss: this
    micro-batch's NLL sum weighs ``grad_accum_steps`` / ``step_target_tokens``.

    ``step_target_tokens`` is the ``[batch]`` field (or None: then this
    micro-batch's own count stands for the step's / ``grad_accum_steps``, exact only
    when every micro-batch has the same number of targets). A loss that is already a
    mean over a micro-batch of fixed size (DPO's) needs no scaling at all.
    """
    if step_target_tokens is None:
        loss = terms["nll_sum"] / jnp.maximum(terms["target_tokens"], 1.0)
    else:
        denom = step_target_tokens[0].astype(jnp.float32)
        loss = terms["nll_sum"] / jnp.maximum(denom, 1.0) * grad_accum_steps
    if moe_aux_weight:
        loss = loss + moe_aux_weight * terms["moe_aux_loss"]
    return loss


def eval_loss_fn(model, **batch):
    """Tunix ``loss_fn(model, **inputs)`` form: ``(mean NLL over targets, terms)``."""
    terms = sft_terms(model, **batch)
    return terms["nll_sum"] / jnp.maximum(terms["target_tokens"], 1.0), terms
