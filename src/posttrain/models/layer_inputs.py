"""What each decoder layer is given beside its hidden states: per layer type, the RoPE
tables and the attention mask.

Dimensions: B batch, T the tokens of this call, S the KV cache's slots, H half the head
dim (:func:`posttrain.layers.rope.rope_tables`).

Both functions return ``{layer type: (cos [B, T, H] float32, sin [B, T, H] float32,
mask)}``, one entry per type in ``cfg.layer_types`` (``full``, ``sliding``), where the
mask is bool, True where query t may attend key s:

* :func:`layer_inputs` (training, and a forward without cache): ``mask [B, T, T]``,
  causal and-ed with the caller's ``padding_mask`` (packing segments, padding) and the
  ``sliding`` layers' window (:func:`posttrain.layers.attention.attention_mask`; HF
  ``masking_utils.sliding_window_causal``). With images seen bidirectionally the tokens
  of one image also see each other (:func:`posttrain.layers.vision.block_overlay`, HF
  ``blockwise_overlay`` under ``or_masks``); otherwise, with a splash
  ``cfg.attention_kernel``, the mask becomes a
  :class:`posttrain.layers.splash.SplashMask`, whose segment ids are read off the causal
  mask before the window (:func:`posttrain.layers.splash.splash_mask`).
* :func:`cached_layer_inputs` (decoding into a KV cache): ``mask [B, T, S]`` over the
  cache's slots, causal over the slots, and-ed with the caller's ``[B, T, S]`` mask and
  the window (:func:`posttrain.layers.kv_cache.slot_mask`); the slots this call writes
  carry their tokens' images for the overlay.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from posttrain.config import ModelConfig
from posttrain.layers import kv_cache
from posttrain.layers.attention import attention_mask
from posttrain.layers.rope import rope_tables
from posttrain.layers.splash import splash_mask
from posttrain.layers.vision import block_overlay


def _window(cfg: ModelConfig, layer_type: str) -> int | None:
    """The sliding window of ``layer_type``'s layers (``None``: full attention)."""
    return cfg.attention[layer_type].sliding_window if layer_type == "sliding" else None


def _rope(cfg: ModelConfig, layer_type: str, positions: jax.Array):
    attn = cfg.attention[layer_type]
    return rope_tables(positions, attn.rope, attn.head_dim)  # [B, T, H] each


def layer_inputs(
    cfg: ModelConfig,
    positions: jax.Array,
    padding_mask: jax.Array | None = None,
    blocks: jax.Array | None = None,
) -> dict[str, tuple]:
    """The layers' inputs for a forward without cache.

    Args:
      cfg: the model config (its layer types, attention configs and kernel).
      positions: ``[B, T]`` int position of each token (inside its packed segment).
      padding_mask: ``[B, T, T]`` bool beyond causality, or ``None`` (causal only).
      blocks: ``[B, T]`` int32 image of each token (-1: none;
        :func:`posttrain.layers.vision.image_blocks`), or ``None``.

    Returns:
      ``{layer type: (cos, sin, mask [B, T, T])}`` (the module docstring).
    """
    batch, seq = positions.shape
    out = {}
    for t in sorted(set(cfg.layer_types)):
        cos, sin = _rope(cfg, t, positions)
        window = _window(cfg, t)
        mask = attention_mask(batch, seq, padding_mask, window)  # [B, T, T]
        if blocks is not None:
            mask |= block_overlay(blocks, blocks)  # [B, T, T]
        elif (kernel := cfg.attention_kernel) != "xla":  # segment ids before the window
            causal = attention_mask(batch, seq, padding_mask, None)
            mask = splash_mask(causal, mask, window, kernel)
        out[t] = (cos, sin, mask)
    return out


def cached_layer_inputs(
    cfg: ModelConfig,
    positions: jax.Array,
    mask: jax.Array | None,
    blocks: jax.Array | None,
    end: jax.Array,
    size: int,
) -> dict[str, tuple]:
    """The layers' inputs for ``T`` tokens written into a KV cache at slots ``end % size``
    onwards.

    Args:
      cfg: the model config.
      positions: ``[B, T]`` int position of each token.
      mask: ``[B, T, S]`` bool over the cache's slots, or ``None`` (each token sees every
        slot up to its own).
      blocks: ``[B, T]`` int32 image of each token (-1: none): a token also sees the
        slots this call writes for the other tokens of its image; ``None``: no overlay.
      end: scalar int, the cache's write index before this call.
      size: S, the cache's slots.

    Returns:
      ``{layer type: (cos, sin, mask [B, T, S])}`` (the module docstring).
    """
    batch, tokens = positions.shape
    if blocks is not None:  # the slots this call writes hold its tokens' blocks
        slots = (end + jnp.arange(tokens)) % size  # [T]
        slot_blocks = jnp.full((batch, size), -1, jnp.int32).at[:, slots].set(blocks)  # [B, S]
    out = {}
    for t in sorted(set(cfg.layer_types)):
        cos, sin = _rope(cfg, t, positions)
        allowed = kv_cache.slot_mask(end % size, tokens, size, mask, batch, _window(cfg, t))
        if blocks is not None:
            allowed |= block_overlay(blocks, slot_blocks)  # [B, T, S]
        out[t] = (cos, sin, allowed)
    return out
