"""The KV cache: fixed-shape per-layer buffers of keys and values, in Tunix's layout.

Dimensions: B batch, S cache_size (slots), T tokens of one call, K num_kv_heads,
H head_dim (each layer type its own K and H: Gemma 4's full layers differ).

One layer's cache (Tunix's ``models/*`` layout, ``shared/research/tunix-rl.md`` 3.3)::

    {"k": [B, S, K, H], "v": [B, S, K, H], "end_index": int32 [B]}

``k`` is stored after qk-norm and RoPE, ``v`` after the v-norm (Gemma 4's k-as-v full
layers keep their own ``v``, the k projection before norm and RoPE), both in the cache
dtype. A call writes its T tokens at slots ``end_index[0] % S`` onward (one write
index for the batch: prompts are left-padded, so slot i is token-buffer index i) and
returns ``end_index + T``. The caller's mask ``[B, T, S]`` says which of the slots up
to its own a query sees (Tunix: causal x non-pad); sliding-window layers also mask
slots ``W`` or more behind the query's slot (masked slots: every layer keeps S slots,
no ring buffer, so the slot arithmetic is the same for every layer type).

Memory (:func:`cache_bytes`): sum over layers of ``2 * B * S * K * H * itemsize + 4 * B``.
The model cache is ``{"layer_{i}": ...}`` unscanned and ``{"block_{p}": ...}`` scanned,
where each leaf gains a leading ``[L / P]`` layers axis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from posttrain import sharding
from posttrain.config import ModelConfig

KV_AXES = ("activation_batch", None, "activation_kv_heads", None)  # [B, S, K, H]


def init_layer(batch: int, cache_size: int, kv_heads: int, head_dim: int, dtype) -> dict:
    """One layer's empty cache (zeros, ``end_index`` 0)."""
    shape = (batch, cache_size, kv_heads, head_dim)
    return {
        "k": jnp.zeros(shape, dtype),
        "v": jnp.zeros(shape, dtype),
        "end_index": jnp.zeros((batch,), jnp.int32),
    }


def write(cache: dict, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array, dict, jax.Array]:
    """Writes ``k``, ``v`` ``[B, T, K, H]`` at the cache's write index.

    Returns:
      ``(keys [B, S, K, H], values [B, S, K, H], new cache, start)``: the whole buffers
      after the write, and the slot of the first written token (int32 scalar).
    """
    size = cache["k"].shape[1]
    start = cache["end_index"][0] % size
    keys = jax.lax.dynamic_update_slice_in_dim(cache["k"], k.astype(cache["k"].dtype), start, 1)
    values = jax.lax.dynamic_update_slice_in_dim(cache["v"], v.astype(cache["v"].dtype), start, 1)
    keys = sharding.constrain(keys, KV_AXES)
    values = sharding.constrain(values, KV_AXES)
    new = {"k": keys, "v": values, "end_index": cache["end_index"] + k.shape[1]}
    return keys, values, new, start


def slot_mask(
    start: jax.Array,
    tokens: int,
    cache_size: int,
    mask: jax.Array | None,
    batch: int,
    sliding_window: int | None,
) -> jax.Array:
    """``[B, T, S]`` bool: the slots each of ``tokens`` queries (at slots ``start + t``) sees.

    Every slot up to the query's own (causal over the slots, as
    :func:`posttrain.layers.attention.attention_mask` is for the full forward), and of
    those the ones ``mask`` (the caller's ``[B, T, S]``, Tunix's causal x non-pad; or
    ``None``) allows: a caller's mask cannot open a later slot, which holds a later
    token or nothing yet. A sliding window W also hides slots W or more behind the query
    (``q - s < W``, HF ``sliding_window_causal``).
    """
    query = start + jnp.arange(tokens)[:, None]  # [T, 1]
    slots = jnp.arange(cache_size)[None, :]  # [1, S]
    allowed = slots <= query  # [T, S]
    if sliding_window is not None:
        allowed &= (query - slots) < sliding_window
    allowed = jnp.broadcast_to(allowed, (batch, tokens, cache_size))
    return allowed if mask is None else allowed & mask.astype(bool)


def layer_shapes(cfg: ModelConfig) -> list[tuple[str, int, int]]:
    """``(layer type, num_kv_heads, head_dim)`` of each layer, in order."""
    return [(t, cfg.attention[t].num_kv_heads, cfg.attention[t].head_dim) for t in cfg.layer_types]


def cache_bytes(cfg: ModelConfig, batch: int, cache_size: int, dtype) -> int:
    """Bytes of :meth:`posttrain.models.CausalLM.init_cache`: ``2 * B * S * K * H *
    itemsize`` per layer (keys and values) plus its int32 ``end_index`` ``[B]``."""
    itemsize = np.dtype(dtype).itemsize
    return sum(
        2 * batch * cache_size * kv * hd * itemsize + 4 * batch for _, kv, hd in layer_shapes(cfg)
    )
