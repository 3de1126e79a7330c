"""Grouped-query self-attention with RoPE, optional qk-norm, v-norm, k-as-v, biases and sinks.

Reference: HF ``LlamaAttention`` / ``Qwen3Attention`` / ``Gemma4TextAttention``
/ ``GptOssAttention`` with ``eager_attention_forward`` (transformers 5.24).
Query head h reads KV head h // (N / K) (HF ``repeat_kv``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from posttrain import sharding
from posttrain.config import AttentionConfig
from posttrain.layers import kv_cache, splash
from posttrain.layers.mlp import (
    add_clip_bounds,
    clip,
    kernel_value,
    qwix_may_intercept,
    token_einsum,
)
from posttrain.layers.norms import RMSNorm, rms_normalize
from posttrain.layers.rope import apply_rope

_KERNEL_INIT = nnx.initializers.lecun_normal(in_axis=0, out_axis=(1, 2))
_OUT_KERNEL_INIT = nnx.initializers.lecun_normal(in_axis=(0, 1), out_axis=2)
# causal attention without a cache: the queries in this many blocks (at most), each at least
# MIN_QUERY_BLOCK positions long (Attention._attend)
QUERY_BLOCKS = 4
MIN_QUERY_BLOCK = 64


def attention_mask(
    batch: int,
    seq: int,
    padding_mask: jax.Array | None,
    sliding_window: int | None,
) -> jax.Array:
    """Boolean mask ``[batch, seq, seq]``: True where query t may attend key s.

    Args:
      padding_mask: ``[batch, seq, seq]`` bool from the caller (Tunix passes a
        causal-and-padding mask), or ``None`` for plain causal.
      sliding_window: W keys visible to each query, itself included
        (``t - s < W``, HF ``sliding_window_causal``); ``None`` for full.
    """
    t = jnp.arange(seq)[:, None]  # [T, 1]
    s = jnp.arange(seq)[None, :]  # [1, S]
    mask = s <= t  # [T, S]
    if sliding_window is not None:
        mask &= (t - s) < sliding_window
    mask = jnp.broadcast_to(mask, (batch, seq, seq))  # [B, T, S]
    if padding_mask is not None:
        mask &= padding_mask.astype(bool)
    return mask


class HeadProjection(nnx.Module):
    """``[B, T, D] -> [B, T, heads, head_dim]``: kernel ``[D, heads, head_dim]``, optional bias."""

    def __init__(
        self,
        d_model: int,
        heads: int,
        head_dim: int,
        heads_axis: str,
        *,
        use_bias: bool,
        rngs: nnx.Rngs,
        dtype,
        param_dtype,
        clipped: bool = False,
    ):
        self.dtype = dtype
        add_clip_bounds(self, clipped, rngs, param_dtype)
        self.kernel = sharding.param(
            rngs,
            _KERNEL_INIT,
            (d_model, heads, head_dim),
            ("embed", heads_axis, "head_dim"),
            param_dtype,
        )
        self.bias = (
            sharding.param(
                rngs,
                nnx.initializers.zeros,
                (heads, head_dim),
                (heads_axis, "head_dim"),
                param_dtype,
            )
            if use_bias
            else None
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        x = clip(x.astype(self.dtype), self.input_min, self.input_max)
        kernel = kernel_value(self.kernel, self.dtype)  # [D, heads, H]
        if isinstance(kernel, jax.Array) and not qwix_may_intercept(self):
            # The kernel as a [D, heads * H] matrix: JAX transposes the 3-D einsum into a
            # weight gradient [heads, H, D] then transposed, and XLA's CPU compiler fed that
            # dot a transposing copy of the output gradient with the qk-norm and RoPE
            # backward fused in (benchmarks/model_ab.py --form heads).
            d, heads, head_dim = kernel.shape
            y = token_einsum("...d,dk->...k", x, kernel.reshape(d, heads * head_dim))
            y = y.reshape(*y.shape[:-1], heads, head_dim)
        else:
            y = token_einsum("...d,dnh->...nh", x, kernel)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return clip(y, self.output_min, self.output_max)  # [B, T, heads, H]


class OutProjection(nnx.Module):
    """``[B, T, N, H] -> [B, T, D]``: kernel ``[N, H, D]``, optional bias ``[D]``."""

    def __init__(
        self,
        heads: int,
        head_dim: int,
        d_model: int,
        *,
        use_bias: bool,
        rngs: nnx.Rngs,
        dtype,
        param_dtype,
        clipped: bool = False,
    ):
        self.dtype = dtype
        add_clip_bounds(self, clipped, rngs, param_dtype)
        self.kernel = sharding.param(
            rngs,
            _OUT_KERNEL_INIT,
            (heads, head_dim, d_model),
            ("heads", "head_dim", "embed"),
            param_dtype,
        )
        self.bias = (
            sharding.param(rngs, nnx.initializers.zeros, (d_model,), ("embed",), param_dtype)
            if use_bias
            else None
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        x = clip(x.astype(self.dtype), self.input_min, self.input_max)
        y = token_einsum("...nh,nhd->...d", x, kernel_value(self.kernel, self.dtype))
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return clip(y, self.output_min, self.output_max)  # [B, T, D]


class Attention(nnx.Module):
    """Self-attention of one layer type; ``[B, T, D] -> [B, T, D]``.

    Parameters (HF names): ``q_proj`` ``[D, N, H]``, ``k_proj`` ``[D, K, H]``,
    ``v_proj`` ``[D, K, H]`` (absent with ``k_eq_v``), ``o_proj`` ``[N, H, D]``,
    ``q_norm`` / ``k_norm`` ``[H]`` with ``qk_norm``, ``sinks`` ``[N]`` with ``sinks``.

    ``rope_sections``: 2 for the vision tower's 2-D RoPE (:func:`posttrain.layers.rope.apply_rope`);
    ``clipped``: the projections clamp their inputs and outputs (Gemma 4's vision tower,
    :func:`posttrain.layers.mlp.add_clip_bounds`); ``causal``: every mask it is given is
    within the causal one (a decoder's, not the vision tower's or one with bidirectional
    image blocks), so that without a cache it may skip the keys after each query block.

    Steps: project; qk-norm (before RoPE, Qwen3/Gemma 4); v = k projection
    before norm/RoPE when ``k_eq_v``; weightless v-norm; RoPE on q and k;
    logits = q.k * scale in float32; mask; softmax over keys (and the sink
    column, dropped afterwards, GPT-OSS); weighted sum of v; o_proj.
    """

    def __init__(
        self,
        d_model: int,
        cfg: AttentionConfig,
        *,
        norm_eps: float,
        rngs: nnx.Rngs,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        rope_sections: int = 1,
        clipped: bool = False,
        causal: bool = False,
    ):
        self.cfg = cfg
        self.causal = causal
        self.norm_eps = norm_eps
        self.rope_sections = rope_sections
        self.dtype = dtype
        n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        kw = dict(
            use_bias=cfg.bias, rngs=rngs, dtype=dtype, param_dtype=param_dtype, clipped=clipped
        )
        self.q_proj = HeadProjection(d_model, n, h, "heads", **kw)
        self.k_proj = HeadProjection(d_model, k, h, "kv_heads", **kw)
        self.v_proj = None if cfg.k_eq_v else HeadProjection(d_model, k, h, "kv_heads", **kw)
        self.o_proj = OutProjection(n, h, d_model, **kw)
        norm_kw = dict(eps=norm_eps, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.q_norm = RMSNorm(h, **norm_kw) if cfg.qk_norm else None
        self.k_norm = RMSNorm(h, **norm_kw) if cfg.qk_norm else None
        self.sinks = (
            sharding.param(rngs, nnx.initializers.zeros, (n,), ("heads",), param_dtype)
            if cfg.sinks
            else None
        )

    def __call__(
        self,
        x: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        mask: jax.Array,
        cache: dict | None = None,
    ) -> jax.Array | tuple[jax.Array, dict]:
        """Attends each query position to the key positions ``mask`` allows.

        Dimensions: B batch, T query positions, S key positions (without a cache S = T,
        self-attention over the sequence; with one, S = cache_size slots), D d_model,
        N num_heads, K num_kv_heads, G = N / K query heads per kv head (GQA), H head_dim.

        Args:
          x: ``[B, T, D]`` in the compute dtype.
          cos, sin: ``[B, T, H]`` float32 RoPE tables of ``x``'s positions
            (:func:`posttrain.layers.rope.rope_tables`).
          mask: ``[B, T, S]`` bool, True where query t may attend key s (causal,
            sliding window, packing segments and padding already combined); or a
            :class:`posttrain.layers.splash.SplashMask` holding it, to attend through
            splash attention where it can (causal, no cache, sequence not sharded).
          cache: this layer's KV cache (:mod:`posttrain.layers.kv_cache`); ``x``'s keys
            and values are written into it and the queries attend to all S slots.

        Returns:
          ``[B, T, D]`` in the compute dtype, and with a cache the updated cache. Scores,
          softmax and the weighted sum are float32 (the softmax's range needs it); each
          stage is a ``jax.named_scope`` (``attention_qkv``, ``attention_scores``,
          ``attention_softmax``, ``attention_out``) for profiles and HLO dumps.
        """
        cfg = self.cfg
        with jax.named_scope("attention_qkv"):
            q = self.q_proj(x)  # [B, T, N, H]
            k = self.k_proj(x)  # [B, T, K, H]
            v = k if self.v_proj is None else self.v_proj(x)  # [B, T, K, H]
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            if cfg.v_norm:
                v = rms_normalize(v, self.norm_eps).astype(self.dtype)
            sections = self.rope_sections
            q, k = apply_rope(q, cos, sin, sections), apply_rope(k, cos, sin, sections)
            q = sharding.constrain(
                q, ("activation_batch", "activation_length", "activation_heads", None)
            )
            k = sharding.constrain(
                k, ("activation_batch", "activation_length", "activation_kv_heads", None)
            )
            if cache is not None:
                k, v, cache, _ = kv_cache.write(cache, k, v)  # [B, S, K, H]
        out = self._attend(q, k, v, mask, causal=self.causal and cache is None)
        return out if cache is None else (out, cache)

    def _attend(
        self, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, causal: bool
    ) -> jax.Array:
        """``q`` ``[B, T, N, H]`` over ``k``, ``v`` ``[B, S, K, H]`` under ``mask``
        ``[B, T, S]``; then ``o_proj``.

        ``causal`` (S = T, and ``mask`` never lets query t see a key s > t): the queries
        go in :data:`QUERY_BLOCKS` blocks, block i over the keys up to its own last
        position, skipping the scores above the diagonal that the mask would zero. The
        same products and sums; a query that sees no key at all (every key masked) then
        averages the values of its block's keys instead of all S (HF's eager attention
        averages all S; such a query's output is padding, never trained on).
        """
        cfg = self.cfg
        if isinstance(mask, splash.SplashMask):  # ModelConfig.attention_kernel splash
            if causal and not sharding.sequence_sharded():
                return self.o_proj(splash.attend(q, k, v, mask, self._sinks(), cfg.logit_scale))
            mask = mask.mask  # the kernel cannot: the XLA path (splash's docstring)
        batch, seq = q.shape[:2]
        groups = cfg.num_heads // cfg.num_kv_heads
        q = q.reshape(batch, seq, cfg.num_kv_heads, groups, cfg.head_dim)  # [B, T, K, G, H]
        k, v = k.astype(jnp.float32), v.astype(jnp.float32)
        blocks = min(QUERY_BLOCKS, seq // MIN_QUERY_BLOCK)
        if not causal or blocks < 2 or sharding.sequence_sharded():
            out = self._scores_softmax_out(q, k, v, mask)
        else:
            edges = [round(i * seq / blocks) for i in range(blocks + 1)]
            out = jnp.concatenate(
                [
                    self._scores_softmax_out(q[:, lo:hi], k[:, :hi], v[:, :hi], mask[:, lo:hi, :hi])
                    for lo, hi in zip(edges[:-1], edges[1:], strict=True)
                ],
                axis=1,
            )  # [B, T, K, G, H]
        with jax.named_scope("attention_out"):
            out = out.astype(self.dtype).reshape(batch, seq, cfg.num_heads, cfg.head_dim)
            out = sharding.constrain(
                out, ("activation_batch", "activation_length", "activation_heads", None)
            )  # [B, T, N, H]
            return self.o_proj(out)

    def _scores_softmax_out(self, q, k, v, mask):
        """``q`` ``[B, T, K, G, H]`` over float32 ``k``, ``v`` ``[B, S, K, H]`` under ``mask``
        ``[B, T, S]``: float32 ``[B, T, K, G, H]`` (:func:`softmax_attend`)."""
        sinks = self._sinks()
        if sinks is not None:
            sinks = sinks.reshape(self.cfg.num_kv_heads, -1)  # [K, G]
        return softmax_attend(q, k, v, mask, sinks, self.cfg.logit_scale)

    def _sinks(self) -> jax.Array | None:
        """``[N]`` float32 sink logits, or ``None``."""
        return None if self.sinks is None else self.sinks[...].astype(jnp.float32)


def softmax_attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    sinks: jax.Array | None,
    scale: float,
) -> jax.Array:
    """Softmax attention of ``q`` over ``k``, ``v`` in float32: ``jax.nn.softmax`` over
    ``where(mask, q.k * scale, float32 min)``, the sink logits (GPT-OSS) as one more column
    per query that weighs no value, then the weighted sum of the values.

    The softmax stays unnormalised until after the weighted sum, ``(e @ v) / l`` with
    ``e = exp(s - max)`` and ``l`` its row sum (the sinks' terms added): the division runs
    over ``[T, H]`` instead of ``[T, S]``, in the forward and in its backward
    (``benchmarks/model_ab.py --form softmax``: the model step 0.97x). A query with no
    visible key averages all S values (HF's eager attention), or with sinks puts all its
    weight on the sink; its scores get no gradient.

    Args:
      q: ``[B, T, K, G, H]``, any float dtype (the product is float32).
      k, v: ``[B, S, K, H]`` float32.
      mask: ``[B, T, S]`` bool, True where query t may attend key s.
      sinks: ``[K, G]`` float32 sink logits, or ``None``.
      scale: the scores' factor (``AttentionConfig.logit_scale``).

    Returns:
      ``[B, T, K, G, H]`` float32.
    """
    with jax.named_scope("attention_scores"):
        s = jnp.einsum("btkgh,bskh->bkgts", q.astype(jnp.float32), k) * scale
        s = jnp.where(mask[:, None, None, :, :], s, jnp.finfo(jnp.float32).min)  # [B, K, G, T, S]
    with jax.named_scope("attention_softmax"):
        top = jax.lax.stop_gradient(jnp.max(s, axis=-1))  # [B, K, G, T]; cancels out
        if sinks is not None:
            top = jnp.maximum(top, sinks[None, :, :, None])
        e = jnp.exp(s - top[..., None])  # [B, K, G, T, S]
        total = jnp.sum(e, axis=-1)  # [B, K, G, T]
        if sinks is not None:
            total = total + jnp.exp(sinks[None, :, :, None] - top)
    with jax.named_scope("attention_out"):
        out = jnp.einsum("bkgts,bskh->btkgh", e, v)  # [B, T, K, G, H]
        return out / jnp.moveaxis(total, 3, 1)[..., None]
