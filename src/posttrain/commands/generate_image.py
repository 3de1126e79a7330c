"""``posttrain generate --image FILE --prompt TEXT``: one prompt about one image, rendered
as ``posttrain sft --vision`` trains (a user turn: the image, then the text), the image's
soft tokens placed in the prefill."""

from __future__ import annotations

import numpy as np

from posttrain.training.data import chat_prompt


def check_image_model(image: str, spec: str) -> None:
    """Refuses ``--image`` with a model whose config has no vision tower, before the model
    is read (:func:`posttrain.limits.checkpoint_config`).

    Raises:
      ValueError: naming the image and the model.
    """
    from posttrain import limits

    if limits.checkpoint_config(spec)[0].vision is None:
        raise ValueError(_no_tower(image, spec))


def _no_tower(image: str, spec: str) -> str:
    from posttrain.vision.run import VISION_MODEL

    return (
        f"--image {image!r}: --model {spec!r} has no vision tower (e.g. use {VISION_MODEL} "
        "or a `posttrain sft --vision` export)"
    )


def image_prompt(image: str, prompts: list[dict], model, tok, template, spec: str):
    """``(prompt ids [T], images)`` of ``--image`` and its one prompt for ``model``:
    the user turn ``[image, text]`` in ``template`` with its generation prompt, the image
    token expanded to begin-of-image, one token per soft token, end-of-image; ``images`` a
    one-row :class:`~posttrain.layers.vision.ImageBatch`. The image is prepared as the
    checkpoint's ``preprocessor_config.json`` says (a vision run's export has one), else
    as a vision run prepares a preset's (:func:`posttrain.vision.run.image_processing`).

    Raises:
      ValueError: not exactly one text prompt, a model without a vision tower, or an
        image that is missing, unreadable or too large (each naming the value).
    """
    from posttrain.layers.vision import ImageBatch
    from posttrain.vision import data as vision_data
    from posttrain.vision import run as vision_run

    if len(prompts) != 1 or "prompt" not in prompts[0]:
        raise ValueError(f"--image {image!r} takes exactly one --prompt (got {len(prompts)})")
    vision = model.config.vision
    if vision is None:
        raise ValueError(_no_tower(image, spec))
    processing = vision_run.image_processing(spec, vision)
    pixels = vision_data.load_image(image, processing, "--image")
    patches, positions, soft = vision_data.image_patches(pixels, processing)
    text = vision_run.placeholder_of(tok, vision) + prompts[0]["prompt"]
    ids = np.asarray(chat_prompt([{"role": "user", "content": text}], tok, template), np.int32)
    ids, _ = vision_data.expand_image_tokens(
        ids,
        np.zeros(len(ids), bool),
        [soft],
        image_token_id=vision.image_token_id,
        boi_token_id=vision.boi_token_id,
        eoi_token_id=vision.eoi_token_id,
    )
    batch = ImageBatch(patches[None, None], positions[None, None])  # [1, 1, P, C], [1, 1, P, 2]
    return ids.tolist(), batch
