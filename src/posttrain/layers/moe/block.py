"""The routed Mixture-of-Experts block: router -> dispatch -> experts -> combine.

Dimension legend (STYLE.md): B batch, T seq (flattened with batch into tokens
inside the block), D d_model, E num_experts, R top_k.

Reference: HF transformers 5.24 ``MixtralSparseMoeBlock``,
``Qwen3MoeSparseMoeBlock``, Gemma 4 ``Gemma4TextRouter`` + ``Gemma4TextExperts``,
``GptOssMLP``; see the routing table in ``hf-reference.md`` section 10.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from posttrain import sharding
from posttrain.config import ActivationConfig, MoEConfig
from posttrain.layers.mlp import MLP
from posttrain.layers.moe import dispatch
from posttrain.layers.moe.experts import Experts
from posttrain.layers.moe.router import Router, load_balancing_loss, route


class MoEBlock(nnx.Module):
    """Routed experts plus an optional always-on shared expert.

    Stages of ``__call__``, each a ``jax.named_scope`` (``moe_router``, ``moe_dispatch``,
    ``moe_experts``, ``moe_combine``) for profiles and HLO dumps:

    1. **Router**: float32 logits of ``router_input`` (``Router``), then
       :func:`~posttrain.layers.moe.router.route` picks R experts per token and
       their weights. On the unfused path the per-expert scale multiplies the
       selected weights here, after renormalisation (Gemma 4).
    2. **Dispatch** (capacity): with ``moe.capacity_factor`` each expert keeps its
       first ``ceil(cf * T * R / E)`` assignments in token order; dropped ones get
       weight 0 (:func:`~posttrain.layers.moe.dispatch.capacity_mask`).
    3. **Experts**: ``Experts`` by ``moe.algorithm`` (dense, sorted, ragged;
       sorted blocks hold ``moe.block_size`` rows, by default
       :func:`~posttrain.layers.moe.dispatch.default_block_size`: the power of
       two at or below T * R / (8E), clamped to [8, 512]). On the fused path
       (``moe.fuse_expert_scales``) the per-expert scale multiplies ``down_proj``
       and ``down_proj_bias`` of each expert instead; it is applied in exactly
       one of these two places.
    4. **Combine**: the weighted sum of each token's expert outputs (inside the
       experts), plus the shared expert on ``x``.

    Args:
      d_model: D.
      moe: the MoE config.
      activation: the nonlinearity of the routed and shared experts.
      norm_eps: epsilon of the router-input RMSNorm (``moe.router_input_norm``).
      rngs: parameter RNGs.
      dtype: compute dtype of the experts (the router is always float32).
      param_dtype: parameter dtype.
    """

    def __init__(
        self,
        d_model: int,
        moe: MoEConfig,
        activation: ActivationConfig,
        *,
        norm_eps: float,
        rngs: nnx.Rngs,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
    ):
        self.moe = moe
        self.router = Router(d_model, moe, norm_eps=norm_eps, rngs=rngs, param_dtype=param_dtype)
        self.experts = Experts(
            d_model,
            moe,
            activation,
            rngs=rngs,
            dtype=dtype,
            param_dtype=param_dtype,
        )
        self.shared_expert = (
            MLP(
                d_model,
                moe.shared_expert_d_ff,
                activation,
                rngs=rngs,
                dtype=dtype,
                param_dtype=param_dtype,
            )
            if moe.shared_expert_d_ff
            else None
        )

    def __call__(
        self, x: jax.Array, router_input: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """Applies the block.

        Args:
          x: ``[batch, seq, d_model]`` expert input, any float dtype.
          router_input: ``[batch, seq, d_model]`` router input; defaults to ``x``.
            Gemma 4 routes on the raw residual but feeds the experts a normalised
            copy, so its decoder passes both.

        Returns:
          ``y`` ``[batch, seq, d_model]`` in ``x.dtype``, and the load-balancing
          loss, a float32 scalar, **unweighted**: the caller multiplies it by
          ``moe.aux_loss_weight``
          (:func:`~posttrain.layers.moe.router.load_balancing_loss`; counts are
          taken before capacity drops).
        """
        batch, seq, d_model = x.shape
        router_input = x if router_input is None else router_input
        tokens = x.reshape(batch * seq, d_model)  # [B*T, D]
        router_tokens = router_input.reshape(batch * seq, d_model)  # [B*T, D]

        with jax.named_scope("moe_router"):  # 1. router (float32)
            logits = self.router(router_tokens)  # [B*T, E]
            scale = self.router.per_expert_scale
            scale = None if scale is None else scale[...]  # [E]
            fused = self.moe.fuse_expert_scales  # the scale goes to route or experts, not both
            weights, expert_ids, probs = route(
                logits, self.moe, per_expert_scale=None if fused else scale
            )  # [B*T, R]
            aux_loss = load_balancing_loss(probs, expert_ids)

        with jax.named_scope("moe_dispatch"):  # 2. capacity drops become zero weights
            keep = dispatch.capacity_mask(
                expert_ids, self.moe.num_experts, self.moe.capacity_factor
            )
            weights = jnp.where(keep, weights, 0.0)  # [B*T, R]

        with jax.named_scope("moe_experts"):  # 3. experts and 4. combine (weighted sum)
            routed = self.experts(
                tokens, weights, expert_ids, down_scale=scale if fused else None
            )  # [B*T, D] float32
        with jax.named_scope("moe_combine"):
            y = routed.reshape(batch, seq, d_model)  # [B, T, D]
            if self.shared_expert is not None:
                y = y + self.shared_expert(x).astype(jnp.float32)
            y = sharding.constrain(y.astype(x.dtype), sharding.ACTIVATION_AXES)
        return y, aux_loss
