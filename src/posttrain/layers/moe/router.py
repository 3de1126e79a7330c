"""Stage 1 of the MoE block: router logits, top-k routing and the load-balancing loss.

Dimension legend (STYLE.md): T tokens, D d_model, E num_experts, R top_k.

Reference: HF transformers 5.24 ``MixtralTopKRouter`` / ``Qwen3MoeTopKRouter``
(softmax over E, top-k, optional renormalisation), ``Gemma4TextRouter``
(weightless RMSNorm * scale * d_model^-1/2 on the router input, per-expert scale
after renormalisation), ``GptOssTopKRouter`` (logits + bias, top-k on logits,
softmax over the k); ``load_balancing_loss_func`` in ``modeling_mixtral.py``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from posttrain import sharding
from posttrain.config import MoEConfig
from posttrain.layers.norms import rms_normalize

_KERNEL_INIT = nnx.initializers.lecun_normal()


class Routing(NamedTuple):
    """Output of :func:`route`.

    Attributes:
      weights: ``[tokens, top_k]`` float32, the weight of each selected expert.
      expert_ids: ``[tokens, top_k]`` int32, selected experts, best first.
      probs: ``[tokens, num_experts]`` float32, softmax over all E of the logits
        (the router probabilities of the load-balancing loss).
    """

    weights: jax.Array
    expert_ids: jax.Array
    probs: jax.Array


class Router(nnx.Module):
    """Linear router ``[tokens, d_model] -> [tokens, num_experts]`` float32 logits.

    Parameters: ``kernel`` ``[d_model, num_experts]`` (embed, exp); ``bias``
    ``[num_experts]`` (exp) when ``moe.router_bias`` (GPT-OSS); ``scale``
    ``[d_model]`` (norm) when ``moe.router_input_norm`` (Gemma 4);
    ``per_expert_scale`` ``[num_experts]`` (exp) when ``moe.per_expert_scale``
    (Gemma 4). The router does not apply ``per_expert_scale`` itself: the block
    passes it to :func:`route` or folds it into the experts (``fuse_expert_scales``).

    Args:
      d_model: D.
      moe: the MoE config.
      norm_eps: epsilon of the router-input RMSNorm.
      rngs: parameter RNGs.
      param_dtype: parameter dtype.
    """

    def __init__(
        self,
        d_model: int,
        moe: MoEConfig,
        *,
        norm_eps: float,
        rngs: nnx.Rngs,
        param_dtype=jnp.float32,
    ):
        e = moe.num_experts
        self.d_model, self.norm_eps = d_model, norm_eps

        def param(init, shape, axes):
            return sharding.param(rngs, init, shape, axes, param_dtype)

        self.kernel = param(_KERNEL_INIT, (d_model, e), ("embed", "exp"))
        self.bias = param(nnx.initializers.zeros, (e,), ("exp",)) if moe.router_bias else None
        self.scale = (
            param(nnx.initializers.ones, (d_model,), ("norm",)) if moe.router_input_norm else None
        )
        self.per_expert_scale = (
            param(nnx.initializers.ones, (e,), ("exp",)) if moe.per_expert_scale else None
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        """Router logits.

        Args:
          x: ``[tokens, d_model]`` any float dtype, the router input.

        Returns:
          ``[tokens, num_experts]`` float32 logits.
        """
        # float32 throughout: bf16 logits tie often, and ties reorder top_k.
        if self.scale is None:
            h = x.astype(jnp.float32)
        else:  # Gemma 4: weightless RMSNorm * scale * d_model^-1/2
            h = rms_normalize(x, self.norm_eps) * self.scale[...].astype(jnp.float32)
            h = h * self.d_model**-0.5
        # HIGHEST: a TPU multiplies float32 at its default precision in one bfloat16 pass,
        # which rounds the logits as bf16 would (tests/test_bf16.py's tie, on a v5e).
        kernel = self.kernel[...].astype(jnp.float32)
        logits = jnp.einsum("td,de->te", h, kernel, precision=jax.lax.Precision.HIGHEST)  # [T, E]
        if self.bias is not None:
            logits = logits + self.bias[...].astype(jnp.float32)
        return logits


def _score(x: jax.Array, scoring: str) -> jax.Array:
    if scoring == "softmax":
        return jax.nn.softmax(x, axis=-1)
    return jax.nn.sigmoid(x)


def route(
    logits: jax.Array, cfg: MoEConfig, *, per_expert_scale: jax.Array | None = None
) -> Routing:
    """Selects ``top_k`` experts per token and their weights.

    Steps: ``score_then_topk`` scores all E logits (softmax or sigmoid) and keeps
    the scores of the top R; ``topk_then_score`` (GPT-OSS) scores only the top R
    logits (softmax over the R). Then, if ``cfg.renormalize``, the R weights are
    divided by their sum (sigmoid included). Then, if ``per_expert_scale`` is
    given, each weight is multiplied by the scale of its expert (Gemma 4, after
    renormalisation); the block passes it only on the unfused path.

    The top R are always chosen on the logits: softmax and sigmoid are monotonic,
    so this is the top R of the scores, without the ties that a saturated sigmoid
    or an underflowed softmax creates among distinct logits.

    Args:
      logits: ``[tokens, num_experts]`` router logits, any float dtype.
      cfg: the MoE config (``top_k``, ``scoring``, ``score_order``, ``renormalize``).
      per_expert_scale: ``[num_experts]`` or ``None``.

    Returns:
      :class:`Routing` (weights ``[tokens, top_k]`` float32, expert_ids
      ``[tokens, top_k]`` int32, probs ``[tokens, num_experts]`` float32).

    Reference: HF ``MixtralTopKRouter.forward``, ``Qwen3MoeTopKRouter.forward``,
    ``Gemma4TextRouter.forward``, ``GptOssTopKRouter.forward`` (transformers 5.24).
    """
    # Scores and top-k in float32: bf16 rounding creates ties, and ties reorder top_k.
    logits = logits.astype(jnp.float32)  # [T, E]
    top_logits, expert_ids = jax.lax.top_k(logits, cfg.top_k)  # [T, R]
    if cfg.score_order == "score_then_topk":
        scores = _score(logits, cfg.scoring)  # [T, E]
        weights = jnp.take_along_axis(scores, expert_ids, axis=-1)  # [T, R]
    else:
        weights = _score(top_logits, cfg.scoring)  # [T, R]
    if cfg.renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    if per_expert_scale is not None:
        weights = weights * per_expert_scale.astype(jnp.float32)[expert_ids]  # [T, R]
    probs = jax.nn.softmax(logits, axis=-1)  # [T, E]
    return Routing(weights, expert_ids.astype(jnp.int32), probs)


def load_balancing_loss(probs: jax.Array, expert_ids: jax.Array) -> jax.Array:
    """Switch-Transformer load-balancing loss, unweighted.

    ``E * sum_e (count_e / T) * mean_t probs[t, e]``, where ``count_e`` counts the
    (token, slot) assignments to expert e before any capacity drop. It is 1 for
    uniform top-1 routing (``top_k`` for uniform top-k) and grows as routing
    concentrates. The caller multiplies by ``MoEConfig.aux_loss_weight``.

    Args:
      probs: ``[tokens, num_experts]`` float32, softmax over all E of the logits
        (for every ``scoring`` and ``score_order``, as HF does).
      expert_ids: ``[tokens, top_k]`` int selected experts.

    Returns:
      Scalar float32.

    Reference: Fedus et al. 2021, "Switch Transformers", eq. 4; HF
    ``load_balancing_loss_func`` (``modeling_mixtral.py``, transformers 5.24),
    which sums over the top_k slots.
    """
    num_tokens, num_experts = probs.shape
    one_hot = jax.nn.one_hot(expert_ids, num_experts, dtype=jnp.float32)  # [T, R, E]
    fraction = jnp.sum(one_hot, axis=(0, 1)) / num_tokens  # [E]
    mean_probs = jnp.mean(probs.astype(jnp.float32), axis=0)  # [E]
    return num_experts * jnp.sum(fraction * mean_probs)
