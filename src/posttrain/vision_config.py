"""The vision tower's config (:class:`VisionConfig`), beside :class:`posttrain.config.ModelConfig`
(its ``vision`` field), which re-exports it."""

from __future__ import annotations

import dataclasses


def _fail(message: str) -> None:
    raise ValueError(message)


@dataclasses.dataclass(frozen=True, kw_only=True)
class VisionConfig:
    """An image encoder beside the text model (Gemma 4's ``Gemma4VisionModel``).

    Attributes:
      d_model: the tower's width D_v (HF ``vision_config.hidden_size``).
      num_layers, num_heads, num_kv_heads, head_dim, d_ff: its encoder layers.
      patch_size: p; a patch is ``p * p * 3`` pixel values.
      pooling_kernel_size: k; k x k neighbouring patches average into one soft token.
      position_embedding_size: rows of each of the two (x, y) position tables.
      rope_theta: base of the 2-D RoPE (each half of head_dim rotates by one axis).
      norm_eps: RMSNorm epsilon of the tower and of the projection's pre-norm.
      standardize: pooled features are shifted and scaled by stored ``std_bias`` /
        ``std_scale`` (HF ``vision_config.standardize``).
      clipped_linears: each encoder projection clamps its input and output to stored
        bounds (HF ``use_clipped_linears``, ``Gemma4ClippableLinear``).
      image_token_id: the token the image's soft tokens replace (one per soft token).
      boi_token_id, eoi_token_id: tokens around an image's soft tokens in the template.
      bidirectional: the text model's attention is bidirectional within each image's soft
        tokens (a run of consecutive ``image_token_id``), causal elsewhere (HF
        ``text_config.use_bidirectional_attention == "vision"``, the larger Gemma 4
        checkpoints; ``masking_utils.blockwise_overlay``).
    """

    d_model: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    d_ff: int
    patch_size: int
    pooling_kernel_size: int
    position_embedding_size: int
    rope_theta: float = 100.0
    norm_eps: float = 1e-6
    standardize: bool = False
    clipped_linears: bool = False
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int
    bidirectional: bool = False

    def __post_init__(self):
        for name in (
            "d_model",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "d_ff",
            "patch_size",
            "pooling_kernel_size",
            "position_embedding_size",
        ):
            if getattr(self, name) < 1:
                _fail(f"vision {name}={getattr(self, name)} must be >= 1")
        if self.num_heads % self.num_kv_heads:
            _fail(
                f"vision num_heads={self.num_heads} must be divisible by "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 4:  # two axes, each rotated in half-split pairs
            _fail(f"vision head_dim={self.head_dim} must be divisible by 4 for 2-D RoPE")
        if self.rope_theta <= 0:
            _fail(f"vision rope_theta={self.rope_theta} must be > 0")
