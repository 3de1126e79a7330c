"""Images for vision SFT: TRL's vision chat format, Pillow decoding, Gemma 4's resize,
rescale, normalisation and patches, and the image tokens the template's one token becomes.

Input format (TRL's), one conversation per line, image paths relative to the JSONL file
and confined to its directory (or ``--image-root``; :func:`confined`)::

    {"messages": [{"role": "user", "content": [{"type": "image"},
                                               {"type": "text", "text": "What shape?"}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "A circle."}]}],
     "images": ["shapes/0.png"]}

A message's ``content`` may also be a plain string. Each ``{"type": "image"}`` part takes
the next path of ``images``, in order; the counts must agree. Every image is opened (its
header) when the file is read, so a missing, unreadable or oversized one fails before
training, naming the file and line.

Reference: transformers 5.12.1 ``Gemma4ImageProcessorPil`` (aspect-ratio-preserving
resize to at most ``max_soft_tokens * k^2`` patches with sides a multiple of ``k * p``,
bicubic on the 8-bit image, rescale by 1/255, optional normalisation, patches, padding
to the maximum) and ``Gemma4Processor.replace_image_token`` (begin-of-image, one image
token per soft token, end-of-image).
"""

from __future__ import annotations

import dataclasses
import math
import os
import struct
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from posttrain.layers.vision import patchify
from posttrain.training.data import Messages, encode_chats, jsonl_records, validate_messages

DEFAULT_MAX_PIXELS = 4096 * 4096  # an image beyond this is refused, not decoded


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImageProcessing:
    """How a checkpoint's images are prepared (its ``preprocessor_config.json``).

    Attributes:
      patch_size, pooling_kernel_size: p and k (the tower's).
      max_soft_tokens: soft tokens per image at most; patches at most ``max_soft_tokens * k^2``.
      resample: Pillow's resampling filter number (3: bicubic).
      rescale_factor: pixel values are multiplied by it (``do_rescale``; 1 when off).
      image_mean, image_std: per channel, applied after rescaling when ``do_normalize``.
      max_pixels: larger images are refused (width x height, read from the header).
    """

    patch_size: int = 16
    pooling_kernel_size: int = 3
    max_soft_tokens: int = 280
    resample: int = 3
    rescale_factor: float = 1 / 255
    do_normalize: bool = False
    image_mean: tuple[float, float, float] = (0.0, 0.0, 0.0)
    image_std: tuple[float, float, float] = (1.0, 1.0, 1.0)
    max_pixels: int = DEFAULT_MAX_PIXELS

    @property
    def max_patches(self) -> int:
        return self.max_soft_tokens * self.pooling_kernel_size**2

    @classmethod
    def from_preprocessor_config(cls, config: Mapping[str, Any]) -> ImageProcessing:
        """Reads ``preprocessor_config.json`` (Gemma 4's image processor fields; absent
        ones take ``Gemma4ImageProcessorPil``'s defaults)."""
        d = cls()
        return cls(
            patch_size=config.get("patch_size", d.patch_size),
            pooling_kernel_size=config.get("pooling_kernel_size", d.pooling_kernel_size),
            max_soft_tokens=config.get("max_soft_tokens", d.max_soft_tokens),
            resample=config.get("resample", d.resample),
            rescale_factor=config.get("rescale_factor", d.rescale_factor)
            if config.get("do_rescale", True)
            else 1.0,
            do_normalize=config.get("do_normalize", d.do_normalize),
            image_mean=tuple(config.get("image_mean", d.image_mean)),
            image_std=tuple(config.get("image_std", d.image_std)),
        )


def resized_size(height: int, width: int, processing: ImageProcessing) -> tuple[int, int]:
    """The largest (height, width) with the image's aspect ratio, sides a multiple of
    ``k * p``, and at most ``max_patches`` patches (HF ``get_aspect_ratio_preserving_size``).

    Raises:
      ValueError: the image is too thin to keep one block of ``k * p`` on both sides.
    """
    p, k = processing.patch_size, processing.pooling_kernel_size
    side, limit = k * p, processing.max_patches * p * p
    factor = math.sqrt(limit / (height * width))
    h = int(math.floor(factor * height / side)) * side
    w = int(math.floor(factor * width / side)) * side
    longest = (processing.max_patches // k**2) * side
    if h == 0 and w == 0:
        raise ValueError(f"a {height}x{width} image resizes to nothing (side multiple {side})")
    if h == 0:
        h, w = side, min(int(math.floor(width / height)) * side, longest)
    elif w == 0:
        h, w = min(int(math.floor(height / width)) * side, longest), side
    if h * w > limit:
        raise ValueError(f"a {height}x{width} image resizes to {h}x{w}, over the patch budget")
    return h, w


DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, IndexError, TypeError, struct.error)
"""What Pillow's decoders raise on a corrupt file besides ``OSError`` (a broken PNG chunk is
a ``SyntaxError``, a short read an ``EOFError`` or ``struct.error``)."""


def open_image(path: str, processing: ImageProcessing, where: str):
    """The opened Pillow image at ``path`` (header read, pixels not yet decoded).

    Raises:
      ValueError: ``<where>: image '<path>' ...`` is missing, not an image Pillow reads,
        or has more than ``max_pixels`` pixels.
    """
    from PIL import Image

    if not os.path.isfile(path):
        raise ValueError(f"{where}: image {path!r} does not exist")
    try:
        with warnings.catch_warnings():  # a decoder's warning is a corrupt file here
            warnings.simplefilter("error")
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # sized below
            image = Image.open(path)
    except Image.DecompressionBombError:
        raise ValueError(f"{where}: image {path!r} is oversized (Pillow refuses it)") from None
    except (*DECODE_ERRORS, Warning) as e:
        raise ValueError(f"{where}: image {path!r} is not a readable image ({e})") from None
    width, height = image.size
    if width * height > processing.max_pixels:
        image.close()
        raise ValueError(
            f"{where}: image {path!r} is {width}x{height} pixels, over max_pixels="
            f"{processing.max_pixels}"
        )
    return image


def load_image(path: str, processing: ImageProcessing, where: str) -> np.ndarray:
    """``[height, width, 3]`` float32: decoded to RGB, resized (:func:`resized_size`),
    rescaled and, with ``do_normalize``, normalised per channel.

    Raises:
      ValueError: as :func:`open_image`, or the pixels do not decode (truncated file).
    """
    from PIL import Image

    with open_image(path, processing, where) as image:
        try:
            with warnings.catch_warnings():  # a decoder's warning is a corrupt file here
                warnings.simplefilter("error")
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # sized
                image.load()
            with warnings.catch_warnings():  # e.g. a palette's transparency: not ours
                warnings.simplefilter("ignore")
                rgb = image.convert("RGB")
        except (*DECODE_ERRORS, Warning) as e:
            raise ValueError(f"{where}: image {path!r} is not a readable image ({e})") from None
    height, width = rgb.height, rgb.width
    h, w = resized_size(height, width, processing)
    if (h, w) != (height, width):
        rgb = rgb.resize((w, h), resample=processing.resample)
    pixels = np.asarray(rgb, dtype=np.float32) * np.float32(processing.rescale_factor)
    if processing.do_normalize:
        mean = np.asarray(processing.image_mean, np.float32)
        pixels = (pixels - mean) / np.asarray(processing.image_std, np.float32)
    return pixels  # [H, W, 3]


def image_patches(
    image: np.ndarray, processing: ImageProcessing
) -> tuple[np.ndarray, np.ndarray, int]:
    """``image`` ``[H, W, 3]`` as ``(patches [max_patches, p*p*3], positions [max_patches, 2],
    soft tokens)``: padding patches are 0 at position (-1, -1)."""
    patches, positions = patchify(image, processing.patch_size)
    pad = processing.max_patches - len(patches)
    patches = np.pad(patches, ((0, pad), (0, 0)))
    positions = np.pad(positions, ((0, pad), (0, 0)), constant_values=-1)
    soft = (len(positions) - pad) // processing.pooling_kernel_size**2
    return patches, positions, soft


def expand_image_tokens(
    tokens: np.ndarray,
    loss_mask: np.ndarray,
    soft_tokens: Sequence[int],
    *,
    image_token_id: int,
    boi_token_id: int,
    eoi_token_id: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Each image token the template rendered becomes begin-of-image, ``soft_tokens[i]``
    image tokens, end-of-image; none of them is a target.

    Args:
      tokens: ``[T]`` int32, one ``image_token_id`` per image, in image order.
      loss_mask: ``[T]`` bool.
      soft_tokens: per image, in order.

    Raises:
      ValueError: the number of image tokens differs from the number of images.
    """
    at = np.flatnonzero(tokens == image_token_id)
    if len(at) != len(soft_tokens):
        raise ValueError(
            f"{len(at)} image tokens in the rendered text but {len(soft_tokens)} images"
        )
    out_tokens, out_mask, start = [], [], 0
    for index, count in zip(at, soft_tokens, strict=True):
        block = [boi_token_id, *[image_token_id] * count, eoi_token_id]
        out_tokens += [tokens[start:index], np.asarray(block, tokens.dtype)]
        out_mask += [loss_mask[start:index], np.zeros(len(block), bool)]
        start = index + 1
    out_tokens.append(tokens[start:])
    out_mask.append(loss_mask[start:])
    return np.concatenate(out_tokens), np.concatenate(out_mask)


@dataclasses.dataclass(frozen=True)
class VisionConversation:
    """One conversation: text messages (each image part as ``placeholder``) and the
    absolute paths of its images, in order."""

    messages: Messages
    images: tuple[str, ...]


def _text_content(content, placeholder: str, where: str, index: int) -> tuple[str, int]:
    """A message's content as text and its number of image parts."""
    if isinstance(content, str):
        return content, 0
    if not isinstance(content, list):
        raise ValueError(f"{where}: message {index} content must be a string or a list of parts")
    text, images = [], 0
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image":
            text.append(placeholder)
            images += 1
        elif kind == "text" and isinstance(part.get("text"), str):
            text.append(part["text"])
        else:
            raise ValueError(
                f'{where}: message {index} part {part!r} is neither {{"type": "image"}} nor '
                '{"type": "text", "text": "..."}'
            )
    return "".join(text), images


def confined(image: str, base: str, root: str, widened: bool, where: str) -> str:
    """``image`` (relative to ``base``, or absolute) resolved, links followed, when it
    lies under ``root`` (itself resolved).

    Raises:
      ValueError: it leaves ``root``; the line does not say whether it exists.
    """
    real = os.path.realpath(os.path.join(base, image))
    if os.path.commonpath([real, root]) != root:
        within = "--image-root" if widened else "the data file's directory"
        hint = "" if widened else " (widen it with --image-root DIR)"
        raise ValueError(
            f"{where}: image {image!r} is outside {root}; images must be under {within}{hint}"
        )
    return real


def read_vision_jsonl(
    path: str | os.PathLike,
    placeholder: str,
    processing: ImageProcessing,
    *,
    image_root: str | os.PathLike | None = None,
) -> list[VisionConversation]:
    """Reads and checks a vision chat JSONL file (TRL's format, module docstring).

    Image paths resolve beside the file and must stay under its directory, or under
    ``image_root`` when one is given (``--image-root``): both resolved, links followed
    (:func:`confined`).

    Raises:
      ValueError: naming the file and line: what :func:`posttrain.training.data.read_chat_jsonl`
        refuses, a malformed part, ``images`` not a list of strings, a count of image
        parts other than the number of paths, an image outside the allowed directory,
        or one :func:`open_image` refuses; ``image_root`` is not a directory.
    """
    path = os.fspath(path)
    base = os.path.dirname(os.path.abspath(path))
    if image_root is not None and not os.path.isdir(image_root):
        raise ValueError(f"--image-root {os.fspath(image_root)!r} is not a directory")
    root = os.path.realpath(base if image_root is None else image_root)
    out = []
    for where, record in jsonl_records(path, "a vision chat JSONL file"):
        if not isinstance(record, dict) or not isinstance(record.get("messages"), list):
            raise ValueError(f'{where}: expected {{"messages": [...], "images": [...]}}')
        messages, parts = [], 0
        for i, m in enumerate(record["messages"]):
            content = m.get("content") if isinstance(m, dict) else None
            text, count = _text_content(content, placeholder, where, i)
            messages.append({**m, "content": text})
            parts += count
        messages = validate_messages({"messages": messages}, where=where)
        paths = record.get("images", [])
        if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
            raise ValueError(f"{where}: 'images' must be a list of paths, got {paths!r}")
        if len(paths) != parts:
            raise ValueError(
                f"{where}: {parts} image part(s) in the messages but {len(paths)} path(s) in "
                "'images'"
            )
        resolved = tuple(confined(p, base, root, image_root is not None, where) for p in paths)
        for p in resolved:
            open_image(p, processing, where).close()
        out.append(VisionConversation(messages, resolved))
    if not out:
        raise ValueError(f"{path}: no conversations (empty dataset)")
    return out


@dataclasses.dataclass(frozen=True)
class VisionExample:
    """One encoded conversation with its images.

    Attributes:
      tokens: ``[T]`` int32, each image as begin-of-image, its image tokens, end-of-image.
      loss_mask: ``[T]`` bool: the assistant turns' tokens only (never an image token).
      pixels: ``[I, max_patches, p*p*3]`` float32; positions: ``[I, max_patches, 2]`` int32.
    """

    tokens: np.ndarray
    loss_mask: np.ndarray
    pixels: np.ndarray
    positions: np.ndarray


def encode_vision_chats(
    conversations: Sequence[VisionConversation],
    tokenizer,
    template,
    processing: ImageProcessing,
    vision,
) -> list[VisionExample]:
    """Encodes each conversation (:func:`posttrain.training.data.encode_chats`: the template's
    assistant mask), loads its images and expands each image placeholder.

    Args:
      conversations: from :func:`read_vision_jsonl`, whose ``placeholder`` must encode to
        the single token ``vision.image_token_id``.
      vision: the model's :class:`posttrain.config.VisionConfig` (its token ids).

    Raises:
      ValueError: an image cannot be loaded (:func:`load_image`), or the rendered text
        holds another number of image tokens than the conversation has images.
    """
    encoded = encode_chats([c.messages for c in conversations], tokenizer, template)
    out = []
    for index, (conversation, example) in enumerate(zip(conversations, encoded, strict=True)):
        where = f"conversation {index}"
        loaded = [
            image_patches(load_image(p, processing, where), processing) for p in conversation.images
        ]
        try:
            tokens, mask = expand_image_tokens(
                np.asarray(example.tokens, np.int32),
                np.asarray(example.loss_mask, bool),
                [soft for _, _, soft in loaded],
                image_token_id=vision.image_token_id,
                boi_token_id=vision.boi_token_id,
                eoi_token_id=vision.eoi_token_id,
            )
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        channels = 3 * processing.patch_size**2
        pixels = np.stack([p for p, _, _ in loaded]) if loaded else np.zeros((0, 0, channels))
        positions = np.stack([q for _, q, _ in loaded]) if loaded else np.zeros((0, 0, 2))
        out.append(
            VisionExample(tokens, mask, pixels.astype(np.float32), positions.astype(np.int32))
        )
    return out
