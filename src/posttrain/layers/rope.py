"""Rotary position embeddings (Su et al. 2021) in the half-split layout.

Every supported family uses HF's ``rotate_half`` convention: cos/sin are built
from ``cat(freqs, freqs)`` and dim ``d`` pairs with ``d + head_dim/2``.

Reference: ``transformers/modeling_rope_utils.py`` (transformers 5.12-5.24):
``_compute_default_rope_parameters``, ``_compute_llama3_parameters``,
``_compute_yarn_parameters``, ``_compute_proportional_rope_parameters``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from posttrain.config import RopeConfig


def yarn_correction_range(rope: RopeConfig, head_dim: int) -> tuple[float, float]:
    """``(low, high)``: the frequency indices between which YaRN's ramp goes from
    extrapolation to interpolation (HF ``_compute_yarn_parameters``' correction range:
    the dims of ``beta_fast`` and ``beta_slow`` rotations, floored and ceiled when
    ``truncate``, clipped to ``[0, head_dim - 1]``, ``high`` nudged past ``low`` when they
    meet)."""

    def correction_dim(rotations: float) -> float:
        return (
            head_dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))
        ) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # HF: prevents a division by zero
    return low, high


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> tuple[np.ndarray, float]:
    """Inverse frequencies ``[head_dim // 2]`` (float64 numpy) and the cos/sin scale.

    The scale is YaRN's attention factor ``0.1 * ln(factor) + 1`` (1.0 for the
    other kinds); HF multiplies both cos and sin by it.
    """
    half = head_dim // 2
    exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim  # [H/2]
    base = rope.theta**-exponents  # [H/2]
    if rope.kind == "default":
        return base, 1.0
    if rope.kind == "llama3":
        old = rope.original_max_position_embeddings
        low_wavelen = old / rope.low_freq_factor
        high_wavelen = old / rope.high_freq_factor
        wavelen = 2 * math.pi / base
        scaled = np.where(wavelen > low_wavelen, base / rope.factor, base)
        smooth = (old / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled), 1.0
    if rope.kind == "yarn":
        low, high = yarn_correction_range(rope, head_dim)
        ramp = np.clip((np.arange(half, dtype=np.float64) - low) / (high - low), 0, 1)  # [H/2]
        extrapolation = 1 - ramp
        inv = base / rope.factor * (1 - extrapolation) + base * extrapolation
        scale = 1.0 if rope.factor <= 1 else 0.1 * math.log(rope.factor) + 1.0
        return inv, scale
    if rope.kind == "proportional":
        rotated = int(rope.partial_rotary_factor * head_dim // 2)
        inv = np.where(np.arange(half) < rotated, base, 0.0) / rope.factor  # [H/2]
        return inv, 1.0
    raise ValueError(f"rope kind {rope.kind!r} is not supported")


def rope_tables(
    positions: jax.Array, rope: RopeConfig, head_dim: int
) -> tuple[jax.Array, jax.Array]:
    """cos and sin tables for ``positions``.

    Args:
      positions: ``[batch, seq]`` int token positions.

    Returns:
      ``(cos, sin)``, each ``[batch, seq, head_dim]`` float32, already scaled by
      the kind's attention factor.
    """
    inv, scale = inverse_frequencies(rope, head_dim)
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv, jnp.float32)  # [B, T, H/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [B, T, H]
    return jnp.cos(emb) * scale, jnp.sin(emb) * scale


def rope_tables_2d(
    positions: jax.Array, theta: float, head_dim: int
) -> tuple[jax.Array, jax.Array]:
    """cos and sin tables of 2-D positions: the first half of head_dim rotates by x, the
    second by y, each with the default frequencies of a head_dim / 2 rotation.

    Args:
      positions: ``[batch, seq, 2]`` int (x, y); padding (-1) rotates by -1, harmlessly
        (padded keys are masked and padded queries dropped).
      theta: base of the frequencies.
      head_dim: H, divisible by 4.

    Returns:
      ``(cos, sin)``, each ``[batch, seq, head_dim]`` float32: ``cat(table_x, table_y)``.

    Reference: HF ``Gemma4VisionRotaryEmbedding`` (transformers 5.12.1), whose
    frequencies are ``theta^(-2i / (H/2))`` per axis, the same for x and y.
    """
    rope = RopeConfig(theta=theta)
    x_cos, x_sin = rope_tables(positions[..., 0], rope, head_dim // 2)  # [B, T, H/2]
    y_cos, y_sin = rope_tables(positions[..., 1], rope, head_dim // 2)  # [B, T, H/2]
    return jnp.concatenate([x_cos, y_cos], -1), jnp.concatenate([x_sin, y_sin], -1)  # [B, T, H]


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, sections: int = 1) -> jax.Array:
    """Rotates ``x`` ``[batch, seq, heads, head_dim]`` by the tables ``[batch, seq, head_dim]``.

    ``sections``: head_dim splits into this many equal parts, each rotated half-split on its
    own (2 for the 2-D RoPE of :func:`rope_tables_2d`, HF ``apply_multidimensional_rope``).
    Computed in float32, returned in ``x.dtype``.
    """
    x32 = x.astype(jnp.float32)
    width = x.shape[-1] // sections
    half = width // 2
    out = []
    for i, part in enumerate(jnp.split(x32, sections, axis=-1)):  # [B, T, N, H/sections]
        first, second = jnp.split(part, 2, axis=-1)  # [B, T, N, H/(2 sections)] each
        at = i * width
        cos1, cos2 = cos[:, :, None, at : at + half], cos[:, :, None, at + half : at + width]
        sin1, sin2 = sin[:, :, None, at : at + half], sin[:, :, None, at + half : at + width]
        # x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-second, first), without
        # building the rotated copy (its backward pads and concatenates)
        out += [first * cos1 - second * sin1, second * cos2 + first * sin2]
    return jnp.concatenate(out, axis=-1).astype(x.dtype)  # [B, T, N, H]
