"""Vision SFT rows: encoded conversations with their images -> fixed-shape rows, the batch's
images as Tunix's ``TrainingInput.images``, and the held-out answer scores.

A row is one conversation (no packing: a row's images are a fixed count), right-padded
to ``max_target_length``; its images are padded to ``images_per_row`` slots (an unused
slot is all padding patches, at position (-1, -1), which the tower skips):

=====================  ====================================  ==========================
key                    shape, dtype                          what
=====================  ====================================  ==========================
``input_tokens``       ``[rows, T]`` int32                   boi, image tokens, eoi per image
``input_mask``         ``[rows, T]`` int32                   1 on the assistant turns only
``positions``          ``[rows, T]`` int32                   0.. per row
``segment_ids``        ``[rows, T]`` int32                   1 on the row's tokens, 0 padding
``image_pixels``       ``[rows, I, P, C]`` float32           patches (``vision_data``)
``image_positions``    ``[rows, I, P, 2]`` int32             (x, y); (-1, -1) padding
=====================  ====================================  ==========================
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain import sharding
from posttrain.layers.vision import ImageBatch
from posttrain.training import loss

#: row keys holding the images; :func:`with_images` turns them into one ImageBatch
PIXELS, PATCH_POSITIONS = "image_pixels", "image_positions"


def fit_example(example, max_target_length: int, overflow: str, image_token_id: int, where: str):
    """``example`` (a :class:`~posttrain.vision.data.VisionExample`) cut to
    ``max_target_length`` tokens, or None when nothing of it is a target any more.

    Raises:
      ValueError: it is longer and ``overflow`` is ``reject``, or the cut would split or
        drop its image tokens (its images would not match its tokens); naming ``where``.
    """
    n = len(example.tokens)
    if n <= max_target_length:
        return example if example.loss_mask[1:].any() else None
    if overflow == "reject":
        raise ValueError(
            f"{where} has {n} tokens, more than max_target_length={max_target_length} "
            "(overflow='reject')"
        )
    images = np.flatnonzero(example.tokens == image_token_id)
    if len(images) and images[-1] + 1 >= max_target_length:  # its eoi must fit too
        raise ValueError(
            f"{where}: its image tokens run to token {images[-1] + 2}, past "
            f"max_target_length={max_target_length}; raise --max-target-length"
        )
    cut = type(example)(
        example.tokens[:max_target_length],
        example.loss_mask[:max_target_length],
        example.pixels,
        example.positions,
    )
    return cut if cut.loss_mask[1:].any() else None


def vision_rows(
    examples: Sequence, max_target_length: int, images_per_row: int, pad_id: int
) -> dict[str, np.ndarray]:
    """One row per example (module docstring); examples already fit the row.

    Raises:
      ValueError: an example has more images than ``images_per_row``.
    """
    rows = len(examples)
    patches, channels = _patch_shape(examples)
    out = {
        "input_tokens": np.full((rows, max_target_length), pad_id, np.int32),
        "input_mask": np.zeros((rows, max_target_length), np.int32),
        "positions": np.zeros((rows, max_target_length), np.int32),
        "segment_ids": np.zeros((rows, max_target_length), np.int32),
        PIXELS: np.zeros((rows, images_per_row, patches, channels), np.float32),
        PATCH_POSITIONS: np.full((rows, images_per_row, patches, 2), -1, np.int32),
    }
    for r, ex in enumerate(examples):
        n, count = len(ex.tokens), len(ex.pixels)
        if count > images_per_row:
            raise ValueError(f"row {r} has {count} images, more than {images_per_row} per row")
        out["input_tokens"][r, :n] = ex.tokens
        out["input_mask"][r, :n] = ex.loss_mask
        out["positions"][r, :n] = np.arange(n)
        out["segment_ids"][r, :n] = 1
        out[PIXELS][r, :count] = ex.pixels
        out[PATCH_POSITIONS][r, :count] = ex.positions
    return out


def _patch_shape(examples: Sequence) -> tuple[int, int]:
    """``(P, C)`` of the examples' images (all equal: one processing)."""
    for ex in examples:
        if len(ex.pixels):
            return ex.pixels.shape[1], ex.pixels.shape[2]
    raise ValueError("no example has an image; --vision trains on conversations with images")


def with_images(batches: Iterable[dict], field: str) -> Iterator[dict]:
    """Each batch with its image rows as one :class:`~posttrain.layers.vision.ImageBatch`
    under ``field`` (Tunix's ``TrainingInput`` images field, :func:`posttrain.sft.
    tunix_compat.image_field`), which the loss passes to the model as ``images=``."""
    for batch in batches:
        batch = dict(batch)
        images = ImageBatch(batch.pop(PIXELS), batch.pop(PATCH_POSITIONS))
        yield {**batch, field: images}


def _scores(model, tokens, mask, positions, segments, images):
    """Per row: ``(answer NLL sum, answer tokens, all answer tokens argmax-right)``."""
    logits, _ = model.forward(
        tokens, positions, loss.packed_attention_mask(segments), images=images
    )  # [B, T, V]
    targets = loss.target_mask(mask, segments)  # [B, T-1]
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)  # [B, T-1, V]
    logp = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]  # [B, T-1]
    right = jnp.argmax(logits[:, :-1], axis=-1) == tokens[:, 1:]  # [B, T-1]
    nll = -jnp.sum(jnp.where(targets, logp, 0.0), axis=1)
    count = jnp.sum(targets, axis=1)
    exact = jnp.all(right | ~targets, axis=1) & (count > 0)
    return nll, count, exact


def answer_scores(model, rows: dict[str, np.ndarray], mesh, chunk: int) -> dict[str, float]:
    """The held-out answer figures of ``model`` on ``rows`` (:func:`vision_rows`):
    ``loss`` (mean NLL per answer token) and ``accuracy`` (the share of rows whose every
    answer token is the argmax given the ones before it, teacher-forced: what greedy
    decoding would answer). ``chunk`` rows at a time (a multiple of the data-parallel
    size; the last chunk is filled with padding rows, which have no answer tokens)."""
    step = nnx.jit(_scores)
    placement = sharding.batch_sharding(mesh)
    total = len(rows["input_tokens"])
    nll = count = exact = 0.0
    with sharding.use_mesh(mesh):
        for start in range(0, total, chunk):
            part = {k: _filled(v[start : start + chunk], chunk) for k, v in rows.items()}
            placed = {k: jax.device_put(v, placement) for k, v in part.items()}
            images = ImageBatch(placed[PIXELS], placed[PATCH_POSITIONS])
            n, c, e = step(
                model,
                placed["input_tokens"],
                placed["input_mask"],
                placed["positions"],
                placed["segment_ids"],
                images,
            )
            nll += float(n.sum())
            count += float(c.sum())
            exact += float(e.sum())
    return {"loss": nll / max(count, 1.0), "accuracy": exact / max(total, 1)}


def _filled(x: np.ndarray, rows: int) -> np.ndarray:
    """``x`` with padding rows appended up to ``rows`` (tokens 0, masks 0, positions -1 for
    the image patches: padding everywhere)."""
    extra = rows - len(x)
    if extra <= 0:
        return x
    fill = -1 if x.dtype == np.int32 and x.ndim == 4 else 0
    return np.concatenate([x, np.full((extra, *x.shape[1:]), fill, x.dtype)])
