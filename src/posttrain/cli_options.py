"""The options of ``posttrain``'s subcommands that are not training runs (``forward``,
``convert``, ``check-logits``, ``generate``); the training runs' are
:mod:`posttrain.training.options` and each workflow's ``options`` module. Each field is a
flag (:mod:`posttrain.flags`); the field names are what :mod:`posttrain.commands` reads.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Literal

from posttrain.config import RematPolicy
from posttrain.flags import option


def _byte_size(text: str) -> int:
    """``4GB``, ``500MB``, ``1GiB`` or a plain number of bytes."""
    units = {
        "kib": 1 << 10,
        "mib": 1 << 20,
        "gib": 1 << 30,
        "kb": 10**3,
        "mb": 10**6,
        "gb": 10**9,
        "b": 1,
    }
    lower = text.strip().lower()
    for unit, factor in units.items():
        if lower.endswith(unit) and lower[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(lower[: -len(unit)]) * factor)
    if lower.isdigit():
        return int(lower)
    raise argparse.ArgumentTypeError(f"{text!r} is not a size like 4GB, 500MB or 1GiB")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ForwardOptions:
    """``posttrain forward``: a preset on a mesh, one jitted forward."""

    model: str = option("qwen3_moe-tiny", "preset name")
    mesh: str = option("fsdp=4,tensor=2", "axis sizes, e.g. data=2,fsdp=2,expert=2")
    per_device_batch_size: int = option(1, "rows per data-parallel shard", show_default=False)
    seq: int = option(64, "tokens per row", show_default=False)
    scan: bool = option(False, "scan_layers=True")
    remat: RematPolicy = option("none", "rematerialisation of the decoder layers")
    repeats: int = option(5, "timed forwards after the first", show_default=False)
    seed: int = option(0, "model init and tokens", show_default=False)

    def check(self) -> None:
        if self.per_device_batch_size < 1 or self.seq < 1 or self.repeats < 1:
            raise ValueError("--per-device-batch-size, --seq and --repeats must be >= 1")


Format = Literal["hf", "native"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConvertOptions:
    """``posttrain convert``: HF checkpoint directory <-> native checkpoint directory."""

    source_format: Format = option(help="source format", flag="--from", required=True)
    target_format: Format = option(help="target format", flag="--to", required=True)
    src: str = option(help="source directory", positional=True)
    dst: str = option(help="destination directory (must not exist)", positional=True)
    scan: bool = option(False, "hf -> native: store layers stacked for scan_layers=True")
    vision: bool = option(
        False, "hf -> native: convert the vision tower too (Gemma 4), not only the text model"
    )
    layout: Literal["hub", "fused"] | None = option(
        None, "native -> hf: hub (per-expert tensors, default) or fused experts"
    )
    prefix: str | None = option(
        None, "native -> hf: key prefix, model. (default) or model.language_model."
    )
    max_shard_size: int = option(
        4 << 30, "largest output shard (default 4GiB)", argtype=_byte_size, show_default=False
    )
    no_fsync: bool = option(False, "skip flushing the shards to disk before the atomic rename")

    def check(self) -> None:
        if (self.source_format, self.target_format) not in (("hf", "native"), ("native", "hf")):
            raise ValueError(
                f"--from {self.source_format} --to {self.target_format}: "
                "convert goes hf -> native or native -> hf"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckLogitsOptions:
    """``posttrain check-logits``: HF and native logits on the same tokens (fp32, CPU)."""

    hf_dir: str = option(help="HF checkpoint directory", positional=True)
    native_dir: str = option(help="native checkpoint directory", positional=True)
    max_kl: float = option(1e-6, "fail above this mean KL(HF || native)")
    atol: float | None = option(None, "fail above this max |delta logit| (default: not checked)")
    seq: int = option(16, "tokens per row", show_default=False)
    seed: int = option(7, "token seed", show_default=False)

    def check(self) -> None:
        if self.seq < 8:
            raise ValueError(f"--seq {self.seq} must be >= 8 (the batch pads 7 tokens)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerateOptions:
    """``posttrain generate``: sample from a model with its KV cache."""

    model: str | None = option(
        None,
        "preset, native directory (e.g. runs/sft/model-step60) or HF directory "
        "(default: the newest runs/sft/model-step<N>)",
    )
    adapter: str | None = option(None, "a LoRA adapter directory to apply")
    tokenizer: str | None = option(None, "tokenizer.json (default: see docs)")
    chat_template: str | None = option(
        None, "a Jinja chat template file, or chatml (default: the checkpoint's own, else ChatML)"
    )
    prompt: tuple[str, ...] = option((), "prompt text (repeatable)")
    prompts: str | None = option(None, 'JSONL: {"prompt": ...} or {"messages": [...]}')
    chat: bool = option(False, "wrap --prompt in the chat template as a user turn")
    image: str | None = option(
        None,
        "an image file the one --prompt asks about (a model with a vision tower): a user "
        "turn of the image, then the text",
    )
    max_new_tokens: int = option(64, "tokens to generate", show_default=False)
    temperature: float | None = option(
        None, "0: greedy (default: the checkpoint's generation_config.json, else greedy)"
    )
    top_k: int | None = option(
        None, "sample from the k likeliest tokens (default: the checkpoint's, else all)"
    )
    top_p: float | None = option(
        None, "sample from the smallest set holding this mass (default: the checkpoint's, else 1)"
    )
    seed: int = option(0, "sampling seed (and a preset's init)", show_default=False)
    cache_size: int | None = option(None, "default: prompt + new tokens")
    output: str | None = option(None, "JSONL file (default: stdout)")
    mesh: str | None = option(None, "axis sizes, e.g. fsdp=4,tensor=2")

    def check(self) -> None:
        """The sampling numbers and ``--output``, before any model is read
        (:func:`posttrain.commands.generate_inputs.check_options`; ``generate`` checks
        the prompts and, once the model is read, the lengths)."""
        from posttrain.commands.generate_inputs import check_options

        check_options(self)
        if self.image is not None:  # one prompt about one image, before a model is read
            if not os.path.isfile(self.image):
                what = "is not a file" if os.path.exists(self.image) else "does not exist"
                raise ValueError(f"--image {self.image!r} {what}; expected an image file")
            if len(self.prompt) != 1 or self.prompts is not None:
                count = len(self.prompt) + (self.prompts is not None)
                raise ValueError(f"--image {self.image!r} takes exactly one --prompt (got {count})")
