"""RoPE's inverse frequencies and attention factor against transformers' own init functions.

The HF parity tests run each family's RoPE through a whole model at a handful of
parameter points; these draw the parameters instead (no model, no XLA compile), down
to the corners a tiny preset never reaches: YaRN at factor 1 and below (HF's attention
factor is 1.0 for ``factor <= 1``), a proportional RoPE with a factor other than 1,
Llama 3 bands with any factors, YaRN's truncated and clamped correction ranges.
Reference: ``transformers/modeling_rope_utils.py`` ``ROPE_INIT_FUNCTIONS``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.config import RopeConfig
from posttrain.hf_schema.hf_fields import rope_config, rope_dict
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


def _blend_rtol(rope, head_dim: int) -> np.ndarray:
    """``[H/2]``: the relative difference HF's float32 arithmetic may leave in llama3's
    and YaRN's inverse frequencies against ours (float64).

    Both blend the base frequency with its interpolation, ``base * (1 - w d)``, ``d = 1 -
    1 / factor``, ``w`` the interpolated share (YaRN's ramp, ``(i - low) / (high - low)``;
    llama3's ``1 - smooth``, ``smooth = (context / wavelength - low) / (high - low)`` in its
    medium band, no blend elsewhere). float32 rounds the numerator (its terms up to ``i +
    |low|``, or ``high``) before the division by the spread: ``w`` is off by up to
    ~``eps32 (1 + numerator / |spread|)``, and the blend moves by that times ``|d| / (1 -
    w d)``, up to ``factor - 1`` times where the blend is nearly all interpolation.
    Seen: 1.23e-6 (YaRN, theta 1000, factor 32, index 30, ramp 0.997), 3.9e-6 (llama3,
    factor 32, low 2, high 2.5). 4x that model, and 1e-6 at least."""
    from posttrain.layers.rope import inverse_frequencies as ours
    from posttrain.layers.rope import yarn_correction_range

    eps32 = float(np.finfo(np.float32).eps)
    index = np.arange(head_dim // 2, dtype=np.float64)
    damp = 1 - 1 / rope.factor
    if rope.kind == "yarn":
        low, high = yarn_correction_range(rope, head_dim)
        spread = high - low  # negative where the clip to [0, head_dim - 1] crosses them
        share = np.clip((index - low) / spread, 0, 1)
        weight_error = eps32 * (1 + (index + abs(low)) / abs(spread))
        blended = np.ones_like(index, bool)
    elif rope.kind == "llama3":
        old, low, high = (
            rope.original_max_position_embeddings,
            rope.low_freq_factor,
            rope.high_freq_factor,
        )
        wavelength = 2 * np.pi / ours(dataclasses.replace(rope, kind="default"), head_dim)[0]
        share = 1 - (old / wavelength - low) / (high - low)
        weight_error = np.full_like(index, eps32 * (1 + high / (high - low)))
        blended = (wavelength >= old / high) & (wavelength <= old / low)  # the medium band
    else:
        return np.full_like(index, 1e-6)
    amplification = np.where(blended, abs(damp) / (1 - share * damp), 0.0)
    return 1e-6 + 4 * weight_error * amplification


# float64 numpy against torch: no program (a chip changes nothing; 16.9 s on a v5e)
@pytest.mark.host
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
    rtol = _blend_rtol(rope, head_dim)  # [H/2]: HF computes in float32
    np.testing.assert_array_less(  # + 1e-300: an exact 0 (unrotated dims) passes as equal
        np.abs(got - want.double().numpy()), rtol * np.abs(want.double().numpy()) + 1e-300
    )
    assert scale == pytest.approx(want_scale, rel=1e-12)
