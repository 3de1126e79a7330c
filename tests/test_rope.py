"""RoPE's inverse frequencies and attention factor against transformers' own init functions.

The HF parity tests run each family's RoPE through a whole model at a handful of
parameter points; these draw the parameters instead (no model, no XLA compile), down
to the corners a tiny preset never reaches: YaRN at factor 1 and below (HF's attention
factor is 1.0 for ``factor <= 1``), a proportional RoPE with a factor other than 1,
Llama 3 bands with any factors, YaRN's truncated and clamped correction ranges.
Reference: ``transformers/modeling_rope_utils.py`` ``ROPE_INIT_FUNCTIONS``.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.config import RopeConfig
from posttrain.conversion.hf_fields import rope_config, rope_dict
from posttrain.layers.rope import inverse_frequencies
from tests.strategies import scaled

pytestmark = pytest.mark.reference

HEAD_DIMS = st.sampled_from([4, 6, 10, 12, 16, 64])
THETAS = st.sampled_from([1e3, 1e4, 5e5, 1.5e5])


@st.composite
def ropes(draw) -> RopeConfig:
    """A RoPE of each scaled kind, parameters drawn wide of the presets'."""
    kind = draw(st.sampled_from(["llama3", "yarn", "proportional"]))
    theta = draw(THETAS)
    if kind == "llama3":
        low = draw(st.sampled_from([0.5, 1.0, 2.0, 3.0]))
        return RopeConfig(
            kind="llama3",
            theta=theta,
            factor=draw(st.sampled_from([1.0, 2.0, 4.0, 8.0, 32.0])),
            low_freq_factor=low,
            high_freq_factor=low + draw(st.sampled_from([0.5, 3.0, 8.0])),
            original_max_position_embeddings=draw(st.sampled_from([16, 128, 8192])),
        )
    if kind == "yarn":
        return RopeConfig(
            kind="yarn",
            theta=theta,
            factor=draw(st.sampled_from([0.5, 1.0, 1.5, 4.0, 32.0])),
            beta_fast=draw(st.sampled_from([4.0, 32.0, 1e4])),
            beta_slow=draw(st.sampled_from([1e-8, 1.0, 4.0])),
            truncate=draw(st.booleans()),
            original_max_position_embeddings=draw(st.sampled_from([16, 4096])),
        )
    return RopeConfig(
        kind="proportional",
        theta=theta,
        factor=draw(st.sampled_from([0.5, 1.0, 2.0, 8.0])),
        partial_rotary_factor=draw(st.sampled_from([0.25, 0.5, 0.75, 1.0])),
    )


def _yarn_blend_amplification(rope, head_dim: int) -> np.ndarray:
    """``[H/2]``: how much float32's rounding of HF's YaRN ramp, ``(i - low) / (high -
    low)`` (an absolute error up to ~``eps32 * (1 + (i + low) / (high - low))``), moves
    the blend ``base * (1 - ramp (1 - 1 / factor))`` relative to itself: by ``(1 - 1 /
    factor) / (1 - ramp (1 - 1 / factor))``, up to ``factor - 1`` where the ramp nears 1
    (1.23e-6 seen at theta 1000, factor 32, head_dim 64, index 30, ramp 0.997)."""
    import math

    def correction_dim(rotations):  # HF _compute_yarn_parameters' find_correction_dim
        ratio = rope.original_max_position_embeddings / (rotations * 2 * math.pi)
        return head_dim * math.log(ratio) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    spread = max(high - low, 0.001)
    index = np.arange(head_dim // 2, dtype=np.float64)
    ramp = np.clip((index - low) / spread, 0, 1)
    damp = 1 - 1 / rope.factor
    return (1 + (index + abs(low)) / spread) * abs(damp) / (1 - ramp * damp)


@settings(deadline=None, max_examples=scaled(60))
@given(rope=ropes(), head_dim=HEAD_DIMS)
def test_inverse_frequencies_and_attention_factor_match_transformers(rope, head_dim):
    """``inverse_frequencies`` gives HF's ``inv_freq`` (float32 there, float64 here) and its
    attention factor; the HF dict we write reads back as the same RoPE."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = rope_dict(rope)
    assert rope_config(params, 1.0, None, "rope_parameters") == rope
    hf_config = transformers.PretrainedConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=4 * rope.original_max_position_embeddings,
        rope_parameters=params,
    )
    want, want_scale = ROPE_INIT_FUNCTIONS[rope.kind](hf_config, "cpu")
    got, scale = inverse_frequencies(rope, head_dim)
    assert got.shape == (head_dim // 2,)
    # HF computes in float32. For llama3, its smooth factor (context / wavelength - low) /
    # (high - low) carries float32's rounding of context / wavelength (<= high) divided
    # by (high - low): a relative error up to ~eps32 * high / (high - low) in the blend
    # (1.13e-6 seen at low 3, high 3.5); 4x that, and 1e-6 at least.
    rtol = 1e-6
    eps32 = float(np.finfo(np.float32).eps)
    if rope.kind == "llama3":
        spread = rope.high_freq_factor - rope.low_freq_factor
        rtol = max(rtol, 4 * eps32 * (1 + rope.high_freq_factor / spread))
    if rope.kind == "yarn":
        rtol = rtol + 4 * eps32 * _yarn_blend_amplification(rope, head_dim)  # [H/2]
    np.testing.assert_array_less(
        np.abs(got - want.double().numpy()), rtol * np.abs(want.double().numpy()) + 1e-300
    )
    assert scale == pytest.approx(want_scale, rel=1e-12)
