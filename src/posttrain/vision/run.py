"""``posttrain sft --vision``: what a vision run adds to the supervised run
(:func:`posttrain.training.supervised.run_supervised`); :func:`run_vision` runs one.

- The model: with no ``--model``, :data:`VISION_MODEL` (resolved by the options,
  ``posttrain.sft.options.SFTConfig.default_model``); a given model without a vision
  tower (``qwen3-tiny`` too) is refused in one line.
- The data: ``--data`` in TRL's vision chat format (:mod:`posttrain.vision.data`),
  else :data:`EMBEDDED_COUNT` drawn images (:mod:`posttrain.vision.default_data`)
  of which every :data:`HELD_OUT_EVERY`-th is held out for the answer figures. Rows are
  one conversation each, images padded to the data's largest count per conversation
  (:mod:`posttrain.vision.rows`).
- The images enter the step as Tunix's ``TrainingInput.images`` (the batch field the
  release names, :func:`posttrain.training.tunix_compat.image_field`); a release without it
  is refused in one line.
- The tower is frozen (``SFTOptions.frozen``) unless ``--train-vision-tower``; the
  projector trains with the text model (full fine-tuning). With LoRA, Qwix adapts the
  modules the text-only trace reaches: the text model's; tower and projector stay as
  loaded.
- The export also gets ``preprocessor_config.json`` (how images were prepared), which
  ``posttrain generate --image`` reads.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import tempfile
from typing import Any

from flax import nnx

from posttrain import atomic, limits
from posttrain.layers.mlp import CLIP_BOUNDS
from posttrain.training import tunix_compat
from posttrain.training.options import VISION_MODEL
from posttrain.training.supervised import SFTResult, run_supervised
from posttrain.vision import data as vision_data
from posttrain.vision import default_data as vision_default_data
from posttrain.vision.data import ImageProcessing
from posttrain.vision.rows import answer_scores, fit_example, vision_rows, with_images

EMBEDDED_COUNT = 512  # drawn images of the embedded set
EMBEDDED_SEED = 0
HELD_OUT_EVERY = 8  # every 8th embedded conversation is held out
PRESET_SOFT_TOKENS = 64  # a 48 x 48 drawing -> 64 x 64 -> 256 patches (tower p 4, k 2)
PROCESSOR_FILE = "preprocessor_config.json"


def image_processing(model: str, vision):
    """How ``model``'s images are prepared: its directory's ``preprocessor_config.json``
    when it has one (an HF checkpoint, a vision run's export), else the tower's patch and
    pooling sizes with :data:`PRESET_SOFT_TOKENS` soft tokens at most."""
    path = os.path.join(model, PROCESSOR_FILE)
    if os.path.isfile(path):
        try:
            config = json.loads(pathlib.Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise ValueError(f"{path}: not readable JSON ({error})") from None
        return ImageProcessing.from_preprocessor_config(config)
    return ImageProcessing(
        patch_size=vision.patch_size,
        pooling_kernel_size=vision.pooling_kernel_size,
        max_soft_tokens=PRESET_SOFT_TOKENS,
    )


def processor_config(processing) -> dict[str, Any]:
    """``preprocessor_config.json`` of ``processing`` (the fields
    ``ImageProcessing.from_preprocessor_config`` reads, HF's names)."""
    return {
        "image_processor_type": "Gemma4ImageProcessor",
        "patch_size": processing.patch_size,
        "pooling_kernel_size": processing.pooling_kernel_size,
        "max_soft_tokens": processing.max_soft_tokens,
        "resample": processing.resample,
        "do_rescale": True,
        "rescale_factor": processing.rescale_factor,
        "do_normalize": processing.do_normalize,
        "image_mean": list(processing.image_mean),
        "image_std": list(processing.image_std),
    }


def tower_of(model: str):
    """The :class:`~posttrain.config.VisionConfig` of ``--model`` (read from its config,
    no weights loaded).

    Raises:
      ValueError: the model has no vision tower (naming it).
    """
    vision = limits.checkpoint_config(model)[0].vision
    if vision is None:
        raise ValueError(
            f"--model {model!r} has no vision tower, and --vision trains one's images: use "
            f"{VISION_MODEL}, a vision run's export, or an HF Gemma 4 checkpoint converted "
            "with `posttrain convert --vision`"
        )
    return vision


def placeholder_of(tok, vision) -> str:
    """The token text standing for an image in the rendered conversation: the tokenizer's
    ``image_token_id`` token.

    Raises:
      ValueError: the tokenizer has no such token, or it does not encode back to it.
    """
    text = tok.id_to_token(vision.image_token_id)
    if text is None or tok.encode(text, add_special_tokens=False).ids != [vision.image_token_id]:
        raise ValueError(
            f"the tokenizer has no single token for the tower's image_token_id="
            f"{vision.image_token_id}; pass the model's --tokenizer"
        )
    return text


@dataclasses.dataclass
class VisionRun:
    """The vision part of one SFT run (:func:`prepare`).

    Attributes:
      field: the batch key of the images (Tunix's ``TrainingInput`` field).
      processing: how images are prepared (written beside the export).
      examples: the encoded training conversations, in file order.
      held_out: the held-out rows (:func:`posttrain.vision.rows.vision_rows`), None
        without a held-out split (``--data``).
      images_per_row: image slots per row.
      frozen: the ``nnx`` filter of the variables training leaves as they are.
    """

    cfg: Any
    field: str
    processing: Any
    examples: list
    held_out: dict | None
    images_per_row: int
    frozen: Any
    pad_id: int

    def rows(self, cfg, tok, shard: tuple[int, int] = (0, 1), template=None):
        """The training rows of data shard ``(index, count)`` (the supervised run's row builder)."""
        index, count = shard
        kept = self.examples[index::count]
        if not kept:
            raise ValueError(f"data shard {index} of {count} holds no conversation")
        return vision_rows(kept, cfg.max_target_length, self.images_per_row, self.pad_id)

    def batches(self, batches):
        """The run's batches with their images as Tunix's images field."""
        return with_images(batches, self.field)

    def score(self, model, mesh, chunk: int) -> dict[str, float] | None:
        """The held-out answer figures of ``model`` (None without a held-out split)."""
        if self.held_out is None:
            return None
        return answer_scores(model, self.held_out, mesh, chunk)

    def held_out_summary(self, before: dict[str, float], after: dict[str, float]) -> str:
        """The closing line of the held-out figures (:func:`held_out_line`)."""
        return held_out_line(before, after, len(self.held_out["input_tokens"]))

    def write(self, exported: list[pathlib.Path]) -> None:
        """``preprocessor_config.json`` into the model export (atomically)."""
        for path in exported:
            if path.name.startswith("model-step"):
                text = json.dumps(processor_config(self.processing), indent=2) + "\n"
                atomic.write_text(path / PROCESSOR_FILE, text)


#: the tower's buffers in HF (never trained): the clip bounds (+-inf until a checkpoint
#: sets them) and the standardisation
TOWER_BUFFERS = (*CLIP_BOUNDS, "std_bias", "std_scale")


def frozen_filter(train_tower: bool):
    """The ``nnx`` filter of what a vision run leaves as loaded: the whole tower, or with
    ``train_tower`` only its buffers (:data:`TOWER_BUFFERS`)."""
    buffers = nnx.All(
        nnx.PathContains("vision_tower"), nnx.Any(*(nnx.PathContains(b) for b in TOWER_BUFFERS))
    )
    return buffers if train_tower else nnx.PathContains("vision_tower")


def prepare(cfg, tok, template, pad_id: int) -> VisionRun:
    """Checks the vision run ``cfg`` and reads and encodes its conversations (before
    anything is written). Every process encodes every conversation (small sets); each
    then builds rows of its own data shards only.

    Raises:
      ValueError: the installed Tunix has no images field, the model no tower, the
        tokenizer no image token; a bad data line or image (naming the file and line);
        a conversation whose image tokens do not fit its row (naming it).
    """
    field = tunix_compat.image_field()
    if field is None:
        raise ValueError(
            "--vision: the installed Tunix's TrainingInput has no images field (google-tunix "
            ">= 0.1.6 has it); the images would not reach the model"
        )
    vision = tower_of(cfg.model)
    processing = image_processing(cfg.model, vision)
    train, held_out = _encoded(cfg, tok, template, processing, vision)
    per_row = max(1, *(len(e.pixels) for e in train + held_out))

    def fit(examples, name):
        fitted = (
            fit_example(
                e, cfg.max_target_length, cfg.overflow, vision.image_token_id, f"{name} {i}"
            )
            for i, e in enumerate(examples)
        )
        return [e for e in fitted if e is not None]

    kept = fit(train, "conversation")
    if not kept:
        raise ValueError(
            f"no conversation has a target token within max_target_length {cfg.max_target_length}"
        )
    test = fit(held_out, "held-out conversation")
    return VisionRun(
        cfg=cfg,
        field=field,
        processing=processing,
        examples=kept,
        held_out=vision_rows(test, cfg.max_target_length, per_row, pad_id) if test else None,
        images_per_row=per_row,
        frozen=frozen_filter(cfg.train_vision_tower),
        pad_id=pad_id,
    )


def _encoded(cfg, tok, template, processing, vision) -> tuple[list, list]:
    """``(training examples, held-out examples)``: ``--data``'s (nothing held out), else
    the embedded set drawn into a temporary directory (every :data:`HELD_OUT_EVERY`-th
    held out)."""
    placeholder = placeholder_of(tok, vision)

    def encode(path, image_root=None):
        conversations = vision_data.read_vision_jsonl(
            path, placeholder, processing, image_root=image_root
        )
        return vision_data.encode_vision_chats(conversations, tok, template, processing, vision)

    if cfg.data:
        return encode(cfg.data, cfg.image_root), []
    with tempfile.TemporaryDirectory(prefix="posttrain-vision-") as tmp:
        every = encode(vision_default_data.write_dataset(tmp, EMBEDDED_COUNT, EMBEDDED_SEED))
    held = HELD_OUT_EVERY - 1
    return (
        [e for i, e in enumerate(every) if i % HELD_OUT_EVERY != held],
        [e for i, e in enumerate(every) if i % HELD_OUT_EVERY == held],
    )


def held_out_line(before: dict[str, float], after: dict[str, float], rows: int) -> str:
    """The closing line of the held-out figures."""
    return (
        f"held-out answers ({rows} images): loss {before['loss']:.3f} -> {after['loss']:.3f}, "
        f"accuracy {before['accuracy']:.3f} -> {after['accuracy']:.3f}"
    )


def run_vision(
    cfg, *, trainer_class: type | None = None, on_built=None, log_every: int | None = None
) -> SFTResult:
    """Runs (or resumes) one vision run: ``cfg`` is ``posttrain sft --vision``'s options
    (an ``SFTConfig`` with ``vision`` set), the supervised run with :func:`prepare`'s
    images.

    Raises:
      ValueError: a bad config, mesh, model, tokenizer, dataset or image (one line).
    """
    if not cfg.vision:
        raise ValueError("run_vision: the options' vision is off (posttrain sft --vision)")
    return run_supervised(
        cfg,
        trainer_class=trainer_class,
        on_built=on_built,
        log_every=log_every,
        prepare_images=prepare,
    )
