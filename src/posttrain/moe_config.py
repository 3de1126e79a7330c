"""The routed Mixture-of-Experts block's config (:class:`MoEConfig`), beside
:class:`posttrain.config.ModelConfig` (its ``moe`` field), which re-exports it."""

from __future__ import annotations

import dataclasses
from typing import Literal

MoEAlgorithm = Literal["dense", "sorted", "ragged"]


def _fail(message: str) -> None:
    raise ValueError(message)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Routed Mixture-of-Experts block (see ``posttrain.layers.moe``).

    Attributes:
      num_experts: E.
      top_k: R experts per token.
      moe_d_ff: expert FFN width F.
      scoring: ``softmax`` or ``sigmoid`` of the router logits.
      score_order: ``score_then_topk`` (Mixtral, Qwen3-MoE, Gemma 4: score all E,
        keep the top R) or ``topk_then_score`` (GPT-OSS: top R of the logits,
        softmax over those R).
      renormalize: divide the R kept weights by their sum (``norm_topk_prob``).
      router_bias: learned bias on the router logits (GPT-OSS).
      router_input_norm: weightless RMSNorm of the router input times a learned
        per-channel ``scale`` and d_model^-1/2 (Gemma 4 ``Gemma4TextRouter``).
      per_expert_scale: learned [E] scale multiplied into each selected weight
        after renormalisation (Gemma 4 ``router.per_expert_scale``).
      fuse_expert_scales: apply the per-expert scale by folding it into the
        experts' ``down_proj`` kernel instead of the routing weights (same result,
        one multiply fewer per token).
      expert_bias: biases on expert projections (GPT-OSS).
      capacity_factor: ``None`` is dropless; otherwise each expert keeps at most
        ``ceil(capacity_factor * T * R / E)`` assignments, in token order.
      shared_expert_d_ff: width of an always-on shared expert; ``None`` for none.
      algorithm: ``dense`` (every expert on every token, einsum on the module
        parameters: the path Qwix LoRA can adapt), ``sorted`` (block-sorted
        grouped matmul, fast on CPU), ``ragged`` (``jax.lax.ragged_dot``, for
        accelerators with ragged kernels).
      block_size: token rows per block in the ``sorted`` algorithm (each expert's rows
        pad to whole blocks, multiplied in chunks of 2^j blocks); ``None`` picks one
        from the number of assignments per expert.
      aux_loss_weight: weight of the load-balancing loss (Switch Transformer).
    """

    num_experts: int
    top_k: int
    moe_d_ff: int
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    score_order: Literal["score_then_topk", "topk_then_score"] = "score_then_topk"
    renormalize: bool = True
    router_bias: bool = False
    router_input_norm: bool = False
    per_expert_scale: bool = False
    fuse_expert_scales: bool = False
    expert_bias: bool = False
    capacity_factor: float | None = None
    shared_expert_d_ff: int | None = None
    algorithm: MoEAlgorithm = "sorted"
    block_size: int | None = None
    aux_loss_weight: float = 0.0

    def __post_init__(self):
        if self.num_experts < 1:
            _fail(f"num_experts={self.num_experts} must be >= 1")
        if not 1 <= self.top_k <= self.num_experts:
            _fail(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.moe_d_ff < 1:
            _fail(f"moe_d_ff={self.moe_d_ff} must be >= 1")
        if self.scoring not in ("softmax", "sigmoid"):
            _fail(f"scoring={self.scoring!r} must be softmax or sigmoid")
        if self.score_order not in ("score_then_topk", "topk_then_score"):
            _fail(f"score_order={self.score_order!r} must be score_then_topk or topk_then_score")
        if self.algorithm not in ("dense", "sorted", "ragged"):
            _fail(f"algorithm={self.algorithm!r} must be dense, sorted or ragged")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            _fail(f"capacity_factor={self.capacity_factor} must be > 0 or None")
        if self.fuse_expert_scales and not self.per_expert_scale:
            _fail("fuse_expert_scales=True needs per_expert_scale=True")
        if self.block_size is not None and self.block_size < 1:
            _fail(f"block_size={self.block_size} must be >= 1 or None")
