"""Gemma 4's vision tower: patch embedding, a bidirectional encoder with 2-D RoPE, spatial
pooling, and the projection of each pooled soft token into the text embedding space.

Dimension legend: B batch (text rows), I images per row, N = B * I images, P patches per
image (padded to a fixed count), C = patch_size^2 * 3 values per patch, L = P / k^2 soft
tokens per image (k the pooling kernel), D_v the tower's width, D the text model's d_model,
T text sequence.

Reference: HF ``Gemma4VisionModel`` (``Gemma4VisionPatchEmbedder``, ``Gemma4VisionEncoder``,
``Gemma4VisionPooler``) and ``Gemma4MultimodalEmbedder``, ``Gemma4Model.forward``'s
``masked_scatter`` of the image features, ``convert_image_to_patches`` of
``image_processing_pil_gemma4.py`` (transformers 5.12.1).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain import _compat, sharding
from posttrain.config import ActivationConfig, AttentionConfig, VisionConfig
from posttrain.layers.attention import Attention
from posttrain.layers.mlp import MLP, Linear
from posttrain.layers.norms import RMSNorm, rms_normalize
from posttrain.layers.rope import rope_tables_2d

PATCH_AXES = ("activation_batch", None, "activation_embed")  # [N, P, D_v]: images shard
GELU_TANH = ActivationConfig("gelu_tanh", 0.0, 0.0)  # HF gelu_pytorch_tanh


class ImageBatch(NamedTuple):
    """The images of a batch, as patches (a pytree: it passes through ``jit``).

    Attributes:
      pixels: ``[B, I, P, C]`` float in [0, 1], each patch's rows, columns, channels
        flattened in that order (:func:`patchify`); padding patches are 0.
      positions: ``[B, I, P, 2]`` int32 (x, y) patch coordinates; (-1, -1) marks a padding
        patch, and an image slot of a row with fewer images is all padding.
    """

    pixels: jax.Array
    positions: jax.Array


def image_blocks(tokens: jax.Array, image_token_id: int) -> jax.Array:
    """``[B, T]`` int32: for each image token, the index of its image in the row (a run of
    consecutive ``image_token_id``), -1 for every other token (transformers 5.12
    ``modeling_gemma4.get_block_sequence_ids_for_mask``)."""
    is_image = tokens == image_token_id  # [B, T]
    before = jnp.pad(is_image[:, :-1], ((0, 0), (1, 0)))  # [B, T]: the previous token's
    starts = is_image & ~before  # [B, T]: an image's first token
    return jnp.where(is_image, jnp.cumsum(starts, axis=1) - 1, -1).astype(jnp.int32)


def block_overlay(query_blocks: jax.Array, key_blocks: jax.Array) -> jax.Array:
    """``[B, T, S]`` bool: True where query t and key s are tokens of the same image
    (``query_blocks [B, T]``, ``key_blocks [B, S]`` from :func:`image_blocks`); OR-ed onto
    the causal, sliding-window and padding mask (transformers 5.12
    ``masking_utils.blockwise_overlay`` under ``or_masks``)."""
    q = query_blocks[:, :, None]  # [B, T, 1]
    return (q == key_blocks[:, None, :]) & (q >= 0)  # [B, T, S]


def patchify(image: np.ndarray, patch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Cuts ``image`` ``[height, width, channels]`` into patches in row-major patch order.

    Returns:
      ``(patches [P, patch_size * patch_size * channels], positions [P, 2] int32 (x, y))``,
      P = (height / p) * (width / p); within a patch, values run over rows, then columns,
      then channels (HF ``convert_image_to_patches`` of a ``[C, H, W]`` image).

    Raises:
      ValueError: height or width is not a multiple of ``patch_size``.
    """
    height, width, channels = image.shape
    if height % patch_size or width % patch_size:
        raise ValueError(f"image {height}x{width} is not a multiple of patch_size={patch_size}")
    rows, cols = height // patch_size, width // patch_size
    patches = image.reshape(rows, patch_size, cols, patch_size, channels)  # [R, p, Q, p, C]
    patches = patches.transpose(0, 2, 1, 3, 4)  # [R, Q, p, p, C]
    patches = patches.reshape(rows * cols, -1)  # [P, C']
    x, y = np.meshgrid(np.arange(cols), np.arange(rows), indexing="xy")  # [R, Q] each
    positions = np.stack([x, y], axis=-1).reshape(rows * cols, 2).astype(np.int32)  # [P, 2]
    return patches, positions


class PatchEmbedder(nnx.Module):
    """Patches ``[N, P, C]`` -> ``[N, P, D_v]``: a linear map of ``2 * pixels - 1`` plus the
    x and y position embeddings (zero on padding patches).

    Parameters: ``input_proj.kernel`` ``[C, D_v]``, ``position_embedding_table``
    ``[2, position_embedding_size, D_v]`` (row 0 indexed by x, row 1 by y).
    """

    def __init__(self, cfg: VisionConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
        self.dtype = dtype
        channels = 3 * cfg.patch_size**2
        self.input_proj = Linear(
            channels, cfg.d_model, (None, "embed"), rngs=rngs, dtype=dtype, param_dtype=param_dtype
        )
        self.position_embedding_table = sharding.param(
            rngs,
            nnx.initializers.normal(0.02),
            (2, cfg.position_embedding_size, cfg.d_model),
            (None, None, "embed"),
            param_dtype,
        )

    def __call__(self, pixels: jax.Array, positions: jax.Array, padding: jax.Array) -> jax.Array:
        x = self.input_proj(2 * (pixels - 0.5))  # [N, P, D_v]: HF rescales [0, 1] to [-1, 1]
        table = self.position_embedding_table[...]
        clamped = jnp.maximum(positions, 0)  # [N, P, 2]: padding (-1) reads row 0, zeroed below
        pos = table[0][clamped[..., 0]] + table[1][clamped[..., 1]]  # [N, P, D_v]
        pos = jnp.where(padding[..., None], 0.0, pos)
        return x + pos.astype(self.dtype)


class VisionEncoderLayer(nnx.Module):
    """One encoder layer: sandwich-normed bidirectional attention and GeGLU MLP.

    ``out = h + post_ff(mlp(pre_ff(h)))`` with ``h = x + post_attn(attn(input_norm(x)))``;
    attention has q/k RMSNorm, weightless v-norm, scale 1 and 2-D RoPE.
    """

    def __init__(self, cfg: VisionConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
        attn = AttentionConfig(
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            qk_norm=True,
            v_norm=True,
            scale=1.0,
        )
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        clipped = cfg.clipped_linears
        self.self_attn = Attention(
            cfg.d_model, attn, norm_eps=cfg.norm_eps, rope_sections=2, clipped=clipped, **kw
        )
        self.mlp = MLP(cfg.d_model, cfg.d_ff, GELU_TANH, clipped=clipped, **kw)
        norm = dict(eps=cfg.norm_eps, **kw)
        self.input_layernorm = RMSNorm(cfg.d_model, **norm)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, **norm)
        self.pre_feedforward_layernorm = RMSNorm(cfg.d_model, **norm)
        self.post_feedforward_layernorm = RMSNorm(cfg.d_model, **norm)

    def __call__(self, x, cos, sin, mask) -> jax.Array:
        h = self.self_attn(self.input_layernorm(x), cos, sin, mask)  # [N, P, D_v]
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))  # [N, P, D_v]
        return sharding.constrain(x + self.post_feedforward_layernorm(h), PATCH_AXES)


def pool(
    x: jax.Array, positions: jax.Array, padding: jax.Array, kernel: int, length: int
) -> tuple[jax.Array, jax.Array]:
    """Averages each ``kernel x kernel`` block of patches into one soft token.

    Args:
      x: ``[N, P, D_v]`` encoder output.
      positions: ``[N, P, 2]`` (x, y); padding (-1) counts as (0, 0) with a zero value.
      padding: ``[N, P]`` bool.
      kernel: k; length: L = P / k^2 soft tokens per image.

    Returns:
      ``(pooled [N, L, D_v] float32 times sqrt(D_v), valid [N, L] bool)``: soft token
      ``x // k + (width // k) * (y // k)`` is the mean of its block's patches; a soft token
      no patch maps to is invalid (an image smaller than the padded patch count).
    """
    x = jnp.where(padding[..., None], 0.0, x)
    clamped = jnp.maximum(positions, 0)  # [N, P, 2]
    width = jnp.max(clamped[..., 0], axis=-1, keepdims=True) + 1  # [N, 1]
    block = clamped // kernel  # [N, P, 2]
    index = block[..., 0] + (width // kernel) * block[..., 1]  # [N, P]
    weights = jax.nn.one_hot(index, length, dtype=jnp.float32) / kernel**2  # [N, P, L]
    pooled = jnp.einsum("npl,npd->nld", weights, x.astype(jnp.float32))  # [N, L, D_v]
    valid = jnp.any(weights != 0, axis=1)  # [N, L]
    # HF casts the average back to the activation dtype, then scales in float32
    pooled = pooled.astype(x.dtype).astype(jnp.float32) * float(x.shape[-1]) ** 0.5
    return pooled, valid


class VisionTower(nnx.Module):
    """Images -> soft tokens ``[B, I, L, D_v]`` (HF ``Gemma4VisionModel``).

    Parameters: ``patch_embedder.*`` (:class:`PatchEmbedder`), ``layers.{v}.*``
    (:class:`VisionEncoderLayer`), and with ``standardize`` ``std_bias`` / ``std_scale``
    ``[D_v]`` (HF persistent buffers; stored, so converted, like any weight).
    """

    def __init__(self, cfg: VisionConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
        self.cfg = cfg
        self.dtype = dtype
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.patch_embedder = PatchEmbedder(cfg, **kw)
        self.layers = _compat.module_list(
            [VisionEncoderLayer(cfg, **kw) for _ in range(cfg.num_layers)]
        )
        if cfg.standardize:
            shape, axes = (cfg.d_model,), ("norm",)
            self.std_bias = sharding.param(rngs, nnx.initializers.zeros, shape, axes, param_dtype)
            self.std_scale = sharding.param(rngs, nnx.initializers.ones, shape, axes, param_dtype)
        else:
            self.std_bias = self.std_scale = None

    def __call__(self, images: ImageBatch) -> tuple[jax.Array, jax.Array]:
        """``(soft tokens [B, I, L, D_v] in the compute dtype, valid [B, I, L] bool)``.

        Raises:
          ValueError: P is not a multiple of pooling_kernel_size^2.
        """
        cfg = self.cfg
        batch, count, patches, channels = images.pixels.shape
        k = cfg.pooling_kernel_size
        if patches % (k * k):
            raise ValueError(f"{patches} patches per image is not a multiple of {k}^2")
        pixels = images.pixels.reshape(batch * count, patches, channels)  # [N, P, C]
        positions = images.positions.reshape(batch * count, patches, 2)  # [N, P, 2]
        padding = jnp.all(positions == -1, axis=-1)  # [N, P]
        with jax.named_scope("vision_embed"):
            x = sharding.constrain(self.patch_embedder(pixels, positions, padding), PATCH_AXES)
            cos, sin = rope_tables_2d(positions, cfg.rope_theta, cfg.head_dim)  # [N, P, H]
            mask = jnp.broadcast_to(~padding[:, None, :], (batch * count, patches, patches))
        with jax.named_scope("vision_encoder"):
            for layer in self.layers:
                x = layer(x, cos, sin, mask)  # [N, P, D_v]
        with jax.named_scope("vision_pool"):
            pooled, valid = pool(x, positions, padding, k, patches // (k * k))  # [N, L, D_v]
            valid &= ~jnp.all(padding, axis=-1, keepdims=True)  # an empty image slot: none
            if self.std_bias is not None:
                bias = self.std_bias[...].astype(jnp.float32)
                pooled = (pooled - bias) * self.std_scale[...].astype(jnp.float32)
        length = pooled.shape[1]
        pooled = pooled.astype(self.dtype).reshape(batch, count, length, cfg.d_model)
        return pooled, valid.reshape(batch, count, length)


class VisionProjector(nnx.Module):
    """Soft tokens ``[..., D_v]`` -> ``[..., D]``: weightless RMSNorm, then a linear map
    (HF ``Gemma4MultimodalEmbedder``: ``embedding_projection.kernel`` ``[D_v, D]``)."""

    def __init__(self, cfg: VisionConfig, d_model: int, *, rngs: nnx.Rngs, dtype, param_dtype):
        self.eps = cfg.norm_eps
        self.dtype = dtype
        self.embedding_projection = Linear(
            cfg.d_model, d_model, (None, "embed"), rngs=rngs, dtype=dtype, param_dtype=param_dtype
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.embedding_projection(rms_normalize(x, self.eps).astype(self.dtype))


def place_image_features(
    embeds: jax.Array, is_image: jax.Array, features: jax.Array, valid: jax.Array
) -> jax.Array:
    """Puts a row's valid soft tokens, in order, at its image-token positions.

    Args:
      embeds: ``[B, T, D]`` token embeddings.
      is_image: ``[B, T]`` bool, True at the image tokens.
      features: ``[B, I * L, D]`` the row's projected soft tokens, image after image.
      valid: ``[B, I * L]`` bool; invalid ones (padding) are skipped.

    Returns:
      ``[B, T, D]``: the r-th image token of a row holds the row's r-th valid soft token
      (HF ``masked_scatter``, which fills the batch's image tokens in row-major order);
      every other position keeps its embedding. The counts must agree (the data checks
      them, :func:`posttrain.vision.data.expand_image_tokens`); image tokens beyond a
      row's valid soft tokens get unspecified (padding) features.
    """
    rank = jnp.cumsum(is_image, axis=1) - 1  # [B, T]: which image token this is in its row
    order = jnp.argsort(~valid, axis=1, stable=True)  # [B, I*L]: valid indices first, in order
    source = jnp.take_along_axis(order, jnp.clip(rank, 0, order.shape[1] - 1), axis=1)  # [B, T]
    gathered = jnp.take_along_axis(features, source[..., None], axis=1)  # [B, T, D]
    return jnp.where(is_image[..., None], gathered.astype(embeds.dtype), embeds)
