"""RMSNorm (Zhang & Sennrich 2019), computed in float32.

Reference: HF ``LlamaRMSNorm`` / ``Gemma4RMSNorm`` (transformers 5.24): x *
(mean(x^2) + eps)^-1/2 * w, with w itself (not 1 + w as in Gemma 1-3).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from posttrain import sharding


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """Weightless RMS normalisation over the last axis, in float32.

    Args:
      x: ``[..., dim]`` any float dtype.
      eps: added to the mean square.

    Returns:
      ``[..., dim]`` float32.
    """
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    """RMSNorm with a learned ``scale`` of shape ``[dim]`` (logical axis ``norm``).

    ``__call__`` maps ``[..., dim]`` to the same shape in ``dtype`` (the input's
    dtype when ``None``); the multiply by ``scale`` happens in float32.
    """

    def __init__(
        self, dim: int, *, eps: float, rngs: nnx.Rngs, dtype=None, param_dtype=jnp.float32
    ):
        self.eps = eps
        self.dtype = dtype
        self.scale = sharding.param(rngs, nnx.initializers.ones, (dim,), ("norm",), param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = rms_normalize(x, self.eps) * self.scale[...].astype(jnp.float32)
        return y.astype(self.dtype or x.dtype)
