"""``posttrain sft``'s options: :class:`~posttrain.training.options.SupervisedRunOptions`
and what only SFT has (its images, ``--vision``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from posttrain.flags import option
from posttrain.training.options import VISION_MODEL, SupervisedRunOptions

__all__ = ["VISION_MODEL", "SFTConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTConfig(SupervisedRunOptions):
    """Everything one SFT run needs; defaults are the embedded run (``qwen3-tiny`` on the
    embedded ``pydoc_data`` Q/A set, the byte tokenizer, every device on fsdp).

    Attributes beyond :class:`~posttrain.training.options.SupervisedRunOptions`:
      vision: train on images (:mod:`posttrain.vision.run`): ``--data`` in TRL's
        vision chat format, else the embedded drawn images; the default ``--model``
        becomes ``gemma4-vision-tiny`` (:meth:`default_model`; a given one is kept, and
        refused if it has no tower); one conversation per row; the tower frozen.
      train_vision_tower: with ``vision``, train the tower too (full fine-tuning).
      image_root: with ``vision`` and ``data``, the directory the data's images must lie
        under (resolved, links followed); None: the data file's directory
        (:func:`posttrain.vision.data.read_vision_jsonl`).
    """

    TRAINING_FIELDS: ClassVar[tuple[str, ...]] = (
        *SupervisedRunOptions.TRAINING_FIELDS,
        "vision",
        "train_vision_tower",
    )

    vision: bool = option(
        False,
        "train on images: --data in TRL's vision chat format (default: embedded drawn "
        "images, 1 in 8 held out); the default --model becomes gemma4-vision-tiny; one "
        "conversation per row; the vision tower frozen",
    )
    train_vision_tower: bool = option(
        False, "with --vision, train the vision tower too (full fine-tuning only)"
    )
    image_root: str | None = option(
        None,
        "with --vision --data, the directory images may be read from (default: the data "
        "file's directory; paths that leave it are refused)",
    )

    def default_model(self) -> str:
        """:data:`VISION_MODEL` under ``vision`` (the text default has no tower), else the
        text default; a given ``--model`` is kept either way."""
        return VISION_MODEL if self.vision else super().default_model()

    def check_fields(self) -> None:
        super().check_fields()
        if self.train_vision_tower and not self.vision:
            self.bad("train_vision_tower", "only with --vision")
        if self.image_root is not None and not (self.vision and self.data):
            self.bad("image_root", "only with --vision and --data (where the images are read)")
        if self.train_vision_tower and self.lora_rank:
            self.bad(
                "train_vision_tower",
                "full fine-tuning (--lora-rank 0): LoRA adapts the text model only",
            )
