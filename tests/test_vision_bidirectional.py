"""Bidirectional attention within an image's tokens (``VisionConfig.bidirectional``; HF
``text_config.use_bidirectional_attention == "vision"``, the larger Gemma 4 checkpoints).

transformers 5.12.1: ``Gemma4Model.forward`` (``models/gemma4/modeling_gemma4.py``) builds
``block_sequence_ids`` from ``mm_token_type_ids`` (``get_block_sequence_ids_for_mask``: one
id per run of image tokens, -1 elsewhere) when the text config says ``"vision"``, and
``masking_utils.create_causal_mask`` / ``create_sliding_window_causal_mask`` OR
``blockwise_overlay`` (same block, not -1) onto the causal, window and padding mask.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from posttrain import conversion
from posttrain.conversion import parity
from posttrain.conversion.native import load_native
from posttrain.families.gemma4 import gemma4_tiny
from posttrain.layers.vision import block_overlay, image_blocks
from posttrain.models import get_config
from tests.path_params import model_with_path_values
from tests.test_conversion_parity import MAX_ABS, MAX_KL
from tests.test_vision import (
    IMG,
    TOKENS,
    VISION,
    check_cached_prefill,
    forward,
    hf_images,
    images,
    native_images,
)

BIDIRECTIONAL = dataclasses.replace(VISION, bidirectional=True)


def test_image_blocks_number_each_image_and_the_overlay_pairs_its_tokens():
    """Each run of image tokens is one block (numbered from 0 per row), other tokens -1;
    the overlay pairs exactly the tokens of one image, in both directions."""
    tokens = jnp.asarray([[5, IMG, IMG, 6, IMG, IMG, IMG, 7], [IMG, 8, 9, 9, 9, 9, 9, IMG]])
    blocks = np.asarray(image_blocks(tokens, IMG))
    np.testing.assert_array_equal(
        blocks, [[-1, 0, 0, -1, 1, 1, 1, -1], [0, -1, -1, -1, -1, -1, -1, 1]]
    )
    pairs = np.asarray(block_overlay(jnp.asarray(blocks), jnp.asarray(blocks)))
    want = (blocks[:, :, None] == blocks[:, None, :]) & (blocks[:, :, None] >= 0)
    np.testing.assert_array_equal(pairs, want)
    assert pairs[0, 1, 2] and pairs[0, 2, 1] and not pairs[0, 2, 4] and not pairs[1, 0, 7]
    assert not pairs[0, 0, 0]  # a text token gains nothing (its causal mask stays)


def test_an_image_token_sees_the_later_tokens_of_its_image_only_when_bidirectional():
    """Same weights, same images: with ``bidirectional`` an image's first token's logits
    change (it now sees the image's later tokens); every token before the image keeps its
    causal logits bit for bit. Fails when the overlay is not applied (causal images)."""
    text = get_config("llama3-tiny")  # dense: compiles in a fraction of gemma4-tiny's MoE
    causal = model_with_path_values(text.replace(vision=VISION))
    both = model_with_path_values(text.replace(vision=BIDIRECTIONAL))
    args = jnp.asarray(TOKENS), native_images(images())
    before, after = np.asarray(forward(causal, *args)), np.asarray(forward(both, *args))
    for row in range(len(TOKENS)):
        at = np.flatnonzero(TOKENS[row] == IMG)
        np.testing.assert_array_equal(before[row, : at[0]], after[row, : at[0]])
        assert np.abs(before[row, at[0]] - after[row, at[0]]).max() > 1e-3, row


@pytest.mark.parametrize(("end", "size"), [(2, 8), (6, 8)], ids=["inside", "wrapping"])
@pytest.mark.parametrize("given", [False, True], ids=["no-mask", "a-mask"])
def test_a_cached_calls_images_see_their_own_slots_in_every_layer_type(end, size, given):
    """The gate's form of the slow cached-prefill test, on ``cached_layer_inputs`` itself:
    4 tokens written at slots ``end % size`` on (wrapping past the ring's end: slots 6, 7,
    0, 1) see what ``slot_mask`` allows (causal, the sliding layer's window of 8, the
    caller's mask) and, each image token, the slots of its image's tokens in this call,
    later ones too; in the full and the sliding layers alike. Row 1 has no image: its
    mask is the plain one."""
    from posttrain.layers import kv_cache
    from posttrain.models.layer_inputs import cached_layer_inputs

    cfg = gemma4_tiny()
    blocks = jnp.asarray([[-1, 0, 0, 1], [-1, -1, -1, -1]], jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(end, end + 4), (2, 4))
    rng = np.random.default_rng(0)
    mask = jnp.asarray(rng.random((2, 4, size)) < 0.7) if given else None
    out = cached_layer_inputs(cfg, positions, mask, blocks, jnp.asarray(end), size)
    assert sorted(out) == ["full", "sliding"]
    slots = [(end + t) % size for t in range(4)]
    for layer_type, (_, _, allowed) in out.items():
        window = cfg.attention[layer_type].sliding_window
        want = np.array(kv_cache.slot_mask(end % size, 4, size, mask, 2, window))
        want[0, 1, slots[2]] = want[0, 2, slots[1]] = True  # image 0: tokens 1 and 2
        want[0, 1, slots[1]] = want[0, 2, slots[2]] = want[0, 3, slots[3]] = True
        np.testing.assert_array_equal(np.asarray(allowed), want, err_msg=layer_type)
    plain = cached_layer_inputs(cfg, positions, mask, None, jnp.asarray(end), size)
    for layer_type, (_, _, allowed) in plain.items():
        np.testing.assert_array_equal(np.asarray(allowed)[1], np.asarray(out[layer_type][2])[1])
        if end + 4 <= size:  # no overlay: causal hides token 2's slot from token 1
            assert not np.asarray(allowed)[0, 1, slots[2]]


@pytest.mark.slow
def test_a_cached_prefill_with_bidirectional_images_equals_the_full_forward():
    """The prefill opens each image's slots to its tokens: prefill (images in) then
    one-token decode steps give the full forward's logits."""
    check_cached_prefill(model_with_path_values(gemma4_tiny().replace(vision=BIDIRECTIONAL)))


def hf_logits(model, mm_token_type_ids: bool) -> np.ndarray:
    import torch

    pixel_values, position_ids = hf_images(images())
    kwargs = dict(pixel_values=pixel_values, image_position_ids=position_ids)
    if mm_token_type_ids:  # what Gemma4Processor returns: 1 on image tokens
        kwargs["mm_token_type_ids"] = torch.tensor(TOKENS == IMG).long()
    with torch.no_grad():
        return model(input_ids=torch.tensor(TOKENS).long(), **kwargs).logits.float().numpy()


@pytest.mark.reference
@pytest.mark.slow
def test_bidirectional_images_match_transformers(hf_tiny, tmp_path):
    """A checkpoint with ``use_bidirectional_attention: "vision"`` converts to a tower with
    ``bidirectional`` and matches transformers (fp32, the text families' bounds); the
    fixture reaches the feature (HF without ``mm_token_type_ids``, i.e. causal images,
    is > 100x the bound away); native -> HF writes the field back."""
    import torch
    import transformers

    built = hf_tiny.build_vision()
    built.config.text_config.use_bidirectional_attention = "vision"
    src = hf_tiny.save(built, tmp_path / "hf")
    conversion.convert_hf_to_native(src, tmp_path / "native", vision=True)
    model = load_native(tmp_path / "native", dtype="float32", param_dtype="float32")
    assert model.config.vision.bidirectional
    hf = transformers.Gemma4ForConditionalGeneration.from_pretrained(
        src, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    reference = hf_logits(hf, mm_token_type_ids=True)
    got = np.asarray(forward(model, jnp.asarray(TOKENS), native_images(images())))
    result = parity.compare(reference, got, np.ones(TOKENS.shape, np.int32))
    print(result.line())
    assert result.ok(MAX_KL, MAX_ABS) and result.top1 == 1.0, result.line()
    assert np.abs(reference - hf_logits(hf, mm_token_type_ids=False)).max() > 100 * MAX_ABS

    conversion.convert_native_to_hf(tmp_path / "native", tmp_path / "back")
    config = hf.config.from_pretrained(tmp_path / "back")
    assert config.text_config.use_bidirectional_attention == "vision"
