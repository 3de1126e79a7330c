"""Token embedding table, also used as the tied output projection.

Reference: HF ``nn.Embedding`` rows ``[V, D]``; Gemma multiplies the lookup by
sqrt(d_model) cast to the weight dtype (``Gemma4TextScaledWordEmbedding``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from posttrain import sharding
from posttrain.layers.mlp import token_einsum


class Embed(nnx.Module):
    """``embedding`` ``[vocab, d_model]`` (logical ``vocab, embed``).

    ``__call__``: token ids ``[B, T]`` int -> ``[B, T, D]`` in ``dtype``.
    ``attend``: ``[B, T, D]`` -> logits ``[B, T, V]`` (tied output head).
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        *,
        scale_by_sqrt_dim: bool = False,
        rngs: nnx.Rngs,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
    ):
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.scale = float(d_model) ** 0.5 if scale_by_sqrt_dim else None
        self.embedding = sharding.param(
            rngs,
            nnx.initializers.normal(0.02),
            (vocab_size, d_model),
            ("vocab", "embed"),
            param_dtype,
        )

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = jnp.take(self.embedding[...], tokens, axis=0).astype(self.dtype)  # [B, T, D]
        if self.scale is not None:
            x = x * jnp.asarray(self.scale, self.param_dtype).astype(self.dtype)
        return x

    def attend(self, x: jax.Array) -> jax.Array:
        return token_einsum("...d,vd->...v", x, self.embedding[...].astype(x.dtype))  # [B, T, V]
