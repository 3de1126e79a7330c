"""The embedded vision dataset: small images drawn in code with Pillow (a coloured shape,
or a digit), each with a question and its answer, written in TRL's vision chat format.

Deterministic for a seed, no download: :func:`write_dataset` writes ``images/*.png`` and
``data.jsonl`` (:mod:`posttrain.vision.data`'s format) into a directory.
"""

from __future__ import annotations

import json
import os
import random

COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 170, 60),
    "blue": (40, 70, 220),
    "yellow": (230, 200, 20),
}
SHAPES = ("circle", "square", "triangle")
DIGITS = tuple(str(d) for d in range(10))
SIZE = 48  # pixels per side


def draw(kind: str, colour: str, size: int = SIZE):
    """A ``size`` x ``size`` RGB image on white: ``kind`` a shape of :data:`SHAPES` filled
    with ``colour``, or a digit (a string of :data:`DIGITS`) drawn in it."""
    from PIL import Image, ImageDraw, ImageFont

    image = Image.new("RGB", (size, size), (255, 255, 255))
    pen = ImageDraw.Draw(image)
    rgb, lo, hi = COLOURS[colour], size // 6, size - size // 6
    if kind == "circle":
        pen.ellipse((lo, lo, hi, hi), fill=rgb)
    elif kind == "square":
        pen.rectangle((lo, lo, hi, hi), fill=rgb)
    elif kind == "triangle":
        pen.polygon(((size // 2, lo), (hi, hi), (lo, hi)), fill=rgb)
    elif kind in DIGITS:
        font = ImageFont.load_default(size=int(size * 0.8))
        pen.text((size // 2, size // 2), kind, fill=rgb, font=font, anchor="mm")
    else:
        raise ValueError(f"kind {kind!r} must be one of {SHAPES + DIGITS}")
    return image


def examples(count: int, seed: int = 0) -> list[tuple[str, str, str, str]]:
    """``(kind, colour, question, answer)`` for ``count`` images, drawn with ``seed``."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        colour = rng.choice(sorted(COLOURS))
        if rng.random() < 0.5:
            kind = rng.choice(SHAPES)
            out.append((kind, colour, "What shape is in the picture?", f"A {colour} {kind}."))
        else:
            kind = rng.choice(DIGITS)
            out.append((kind, colour, "Which digit is written in the picture?", kind))
    return out


def write_dataset(directory: str | os.PathLike, count: int = 64, seed: int = 0) -> str:
    """Writes ``count`` examples as ``images/<i>.png`` and ``data.jsonl`` under
    ``directory`` (created); returns the JSONL path."""
    directory = os.fspath(directory)
    os.makedirs(os.path.join(directory, "images"), exist_ok=True)
    lines = []
    for i, (kind, colour, question, answer) in enumerate(examples(count, seed)):
        name = f"images/{i}.png"
        draw(kind, colour).save(os.path.join(directory, name))
        user = [{"type": "image"}, {"type": "text", "text": question}]
        reply = [{"type": "text", "text": answer}]
        record = {
            "messages": [
                {"role": "user", "content": user},
                {"role": "assistant", "content": reply},
            ],
            "images": [name],
        }
        lines.append(json.dumps(record))
    path = os.path.join(directory, "data.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return path
