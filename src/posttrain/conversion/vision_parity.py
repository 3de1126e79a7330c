"""``posttrain check-logits`` with images: the batch :func:`posttrain.conversion.parity.
check_logits` runs when the native checkpoint has a vision tower (Gemma 4's).

Each row of :func:`~posttrain.conversion.parity.make_batch` (full, right-padded,
left-padded) gets one drawn image, placed as the chat template places it: after the row's
first real token, ``boi``, one ``image_token_id`` per soft token, ``eoi``, then the rest
of the row. Row r's image is ``CELLS[r % 3]`` pooled cells of ``k p`` x ``k p`` pixels (4,
2 and 1 soft tokens), so the batch has images of several sizes, their patches padded to
the largest. A row with too few real tokens for its image (a short ``--seq``)
gets none (an all-padding slot; the tokens stay text). Random text tokens equal to the
three image tokens become token 1, as a text token must not claim an image.

Both models receive the same patches (:func:`posttrain.layers.vision.patchify`, which
``tests/test_vision.py`` holds equal to transformers' processor): this checks the
converted weights, not the image processor. Nothing here imports torch or JAX at import.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from posttrain.layers.vision import ImageBatch, patchify

#: pooled cells (rows, columns) of row r's image: r % 3 picks one (4, 2, 1 soft tokens)
CELLS = ((2, 2), (1, 2), (1, 1))
#: real tokens a row keeps around its image: one before, at least one after
TEXT_AROUND = 2


@dataclasses.dataclass(frozen=True)
class ParityImages:
    """One image (or none) per row of a check-logits batch.

    Attributes:
      pictures: per row, ``[H, W, 3]`` float32 in [0, 1], or None (no image).
      patch_size: the tower's p.
    """

    pictures: tuple[np.ndarray | None, ...]
    patch_size: int

    def _patches(self) -> list[tuple[np.ndarray, np.ndarray] | None]:
        return [None if p is None else patchify(p, self.patch_size) for p in self.pictures]

    def _padded(self) -> tuple[np.ndarray, np.ndarray]:
        """``(pixels [B, P, C] float32, positions [B, P, 2] int32)``: every row padded to
        the largest image's P (pixels 0, positions -1), a row without an image all padding."""
        cut = self._patches()
        width = max(len(c[0]) for c in cut if c is not None)  # P
        channels = next(c[0].shape[1] for c in cut if c is not None)  # p * p * 3
        pixels = np.zeros((len(cut), width, channels), np.float32)
        positions = np.full((len(cut), width, 2), -1, np.int32)
        for row, patches in enumerate(cut):
            if patches is not None:
                pixels[row, : len(patches[0])] = patches[0]
                positions[row, : len(patches[1])] = patches[1]
        return pixels, positions

    def native(self):
        """The :class:`~posttrain.layers.vision.ImageBatch` of the rows: ``pixels
        [B, 1, P, C]``, ``positions [B, 1, P, 2]``."""
        pixels, positions = self._padded()
        return ImageBatch(jnp.asarray(pixels[:, None]), jnp.asarray(positions[:, None]))

    def hf_inputs(self) -> dict[str, np.ndarray]:
        """transformers' ``Gemma4ForConditionalGeneration`` image inputs, the images in row
        order (its ``masked_scatter`` fills the image tokens in that order):
        ``pixel_values [N, P, C]`` float32 and ``image_position_ids [N, P, 2]`` int64."""
        pixels, positions = self._padded()
        rows = [r for r, p in enumerate(self.pictures) if p is not None]
        return {
            "pixel_values": pixels[rows],
            "image_position_ids": positions[rows].astype(np.int64),
        }


def with_images(
    tokens: np.ndarray, mask: np.ndarray, vision, seed: int
) -> tuple[np.ndarray, ParityImages]:
    """``tokens [B, S]`` with each row's image tokens placed (see the module docstring),
    and the images. ``mask [B, S]`` (1 on real tokens) is unchanged: image tokens are
    real tokens.

    Raises:
      ValueError: no row has room for its image (``--seq`` too short for the tower).
    """
    rng = np.random.default_rng(seed)
    image_ids = (vision.image_token_id, vision.boi_token_id, vision.eoi_token_id)
    tokens = np.where(np.isin(tokens, image_ids), 1, tokens).astype(np.int32)
    cell = vision.patch_size * vision.pooling_kernel_size  # pixels per pooled cell side
    pictures: list[np.ndarray | None] = []
    for row in range(tokens.shape[0]):
        rows, cols = CELLS[row % len(CELLS)]
        span = [vision.boi_token_id, *[vision.image_token_id] * (rows * cols)]
        span.append(vision.eoi_token_id)
        real = np.flatnonzero(mask[row])  # [real tokens] indices
        if len(real) < len(span) + TEXT_AROUND:
            pictures.append(None)
            continue
        start = real[0] + 1  # after the row's first real token
        tokens[row, start : start + len(span)] = span
        pictures.append(rng.random((rows * cell, cols * cell, 3), dtype=np.float32))
    if all(p is None for p in pictures):
        raise ValueError(
            f"--seq {tokens.shape[1]}: no row has room for an image's tokens; raise --seq"
        )
    return tokens, ParityImages(tuple(pictures), vision.patch_size)
