"""Contracts on where images enter Tunix, per release (``posttrain sft --vision``, #39).

Read from each release's own code (git tags of google/tunix, checked 2026-12-03):

============  ========================  ============================  =====================
release       ``TrainingInput.images``  default loss -> ``images=``   image processor
============  ========================  ============================  =====================
0.0.2-0.1.5   none                      none                          none
0.1.6         ``images`` (None)         ``model(..., images=images)``  ``tunix.processors.
                                        when given                    image_processor``
0.1.7, main   same                      same                          same; ``DPOTrainer(
                                                                      image_processor=)``
============  ========================  ============================  =====================

``posttrain sft --vision`` puts the images under the field's name
(:func:`posttrain.training.tunix_compat.image_field`) and refuses a release without it; the
matrix's vision cell is then n/a (``harness/matrix/vision_cell.py``). The image processor is
recorded, not used: images are prepared as transformers prepares Gemma 4's
(:mod:`posttrain.vision.data`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

peft_trainer = pytest.importorskip("tunix.sft.peft_trainer")

from posttrain.families.gemma4 import gemma4_vision_tiny  # noqa: E402
from posttrain.layers.vision import ImageBatch  # noqa: E402
from posttrain.models import build_model, get_config  # noqa: E402
from posttrain.training import loss, tunix_compat  # noqa: E402

#: the loss through Tunix's default loss equals ours to float32 rounding of one mean
LOSS_RTOL = 1e-5


def has_images_field() -> bool:
    return tunix_compat.image_field() is not None


@pytest.mark.contract("tunix.sft.peft_trainer.TrainingInput.images")
def test_training_input_images_is_an_optional_field_where_the_default_loss_takes_it():
    """The field and the default loss's ``images`` keyword come together: both (0.1.6+,
    the field defaulting to None) or neither (<= 0.1.5)."""
    fields = {f.name: f for f in dataclasses.fields(peft_trainer.TrainingInput)}
    keyword = "images" in inspect.signature(peft_trainer._default_loss_fn).parameters
    assert ("images" in fields) == keyword == has_images_field()
    if has_images_field():
        assert fields["images"].default is None
        plain = peft_trainer.TrainingInput(input_tokens=np.zeros(2), input_mask=np.zeros(2))
        assert plain.images is None


def vision_batch():
    """Two rows of 24 tokens, each with one 8 x 8 image (4 soft tokens) after 3 text
    tokens, and a loss mask on the last 8 tokens."""
    vision = gemma4_vision_tiny().vision
    cfg = get_config("llama3-tiny").replace(vision=vision)  # dense: compiles quickly
    rows, seq, patches = 2, 24, 16
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 200, (rows, seq)).astype(np.int32)
    tokens[:, 3:7] = vision.image_token_id  # a 4 x 4 patch grid pools into 4 soft tokens
    mask = np.zeros((rows, seq), np.int32)
    mask[:, -8:] = 1
    pixels = rng.random((rows, 1, patches, 3 * vision.patch_size**2)).astype(np.float32)
    grid = np.stack(np.meshgrid(np.arange(4), np.arange(4), indexing="xy"), -1).reshape(16, 2)
    positions = np.broadcast_to(grid, (rows, 1, patches, 2)).astype(np.int32)
    return cfg, tokens, mask, ImageBatch(jnp.asarray(pixels), jnp.asarray(positions))


@pytest.mark.contract("tunix.sft.peft_trainer._default_loss_fn(images=)")
def test_tunix_default_loss_passes_the_images_as_our_model_takes_them():
    """Tunix's own default loss, given a batch's images, calls our ``CausalLM`` with
    ``images=`` (its keyword) and gets the loss of our SFT objective on the same batch;
    without the field (<= 0.1.5) it has no way to pass them. Tunix main returns a
    ``utils.LossOutput`` (the token-weighted sum and its count) instead of the mean."""
    if not has_images_field():
        assert "images" not in inspect.signature(peft_trainer._default_loss_fn).parameters
        return
    cfg, tokens, mask, images = vision_batch()
    model = build_model(cfg, seed=0)
    rows, seq = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (rows, seq))
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((seq, seq), bool)), (rows, seq, seq))

    @nnx.jit
    def both(model, tokens, mask, images):
        theirs = peft_trainer._default_loss_fn(model, tokens, mask, positions, causal, images)
        if hasattr(theirs, "primary_loss"):  # main: utils.LossOutput, the mean by compute()
            theirs = theirs.primary_loss.compute()
        ours, _ = loss.eval_loss_fn(
            model, input_tokens=tokens, input_mask=mask, positions=positions, images=images
        )
        without, _ = loss.eval_loss_fn(
            model, input_tokens=tokens, input_mask=mask, positions=positions
        )
        return theirs, ours, without

    theirs, ours, without = jax.device_get(both(model, tokens, mask, images))
    assert float(theirs) == pytest.approx(float(ours), rel=LOSS_RTOL)
    assert abs(float(ours) - float(without)) > 1e-3  # the images reached the model


@pytest.mark.contract("tunix.processors.image_processor.ImageProcessor")
def test_the_image_processor_ships_with_the_images_field_and_dpo_takes_it_from_0_1_7():
    """``tunix.processors.image_processor`` exists exactly where ``TrainingInput.images``
    does (0.1.6+); ``DPOTrainer`` takes ``image_processor`` from 0.1.7 (recorded: our DPO
    trains text only; the class is ``DpoTrainer`` in 0.0.2)."""
    has_processor = importlib.util.find_spec("tunix.processors") is not None and (
        importlib.util.find_spec("tunix.processors.image_processor") is not None
    )
    assert has_processor == has_images_field()
    if has_processor:
        from tunix.processors import image_processor

        assert callable(image_processor.ImageProcessor)
    if importlib.util.find_spec("tunix.sft.dpo") is not None:
        from posttrain.preference.tunix_dpo import trainer_class

        takes = "image_processor" in inspect.signature(trainer_class().__init__).parameters
        assert not takes or has_images_field()  # 0.1.7+: never without the field
