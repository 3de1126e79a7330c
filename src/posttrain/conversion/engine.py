"""The conversion engine: runs a plan (:mod:`.plan`) as a stream, one table entry
(one layer's tensors) at a time.

Layer stacking for scanned models writes each layer into its slot of the stacked
tensor, and reads it back slot by slot. :func:`convert_hf_to_native` and
:func:`convert_native_to_hf` plan, then write into an atomic directory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from posttrain import families
from posttrain.config import ModelConfig
from posttrain.conversion import directories
from posttrain.conversion import safetensors_io as sio
from posttrain.conversion.errors import check_source_dir, read_json_object
from posttrain.conversion.hf_config import (
    from_hf_config,
    hf_view,
    text_config,
    to_hf_config,
)
from posttrain.conversion.native import STEM, NativeMeta
from posttrain.conversion.plan import (
    CANONICAL,
    Plan,
    Step,
    plan_to_hf,
    plan_to_native,
)


def _slot(slot: int | None, expert: int):
    return expert if slot is None else (slot, expert)


def _per_expert(step: Step, direction: str, reader, writer) -> None:
    """One expert at a time: HF ``experts.{j}`` <-> slice j of the native tensor."""
    t = step.entry.transform
    if direction == "to_native":
        ((native, slot),) = step.outputs
        for j, (hf, _) in enumerate(step.inputs):
            writer.write(native, t.expert(reader.read(hf), hf), _slot(slot, j))
    else:
        ((native, slot),) = step.inputs
        for j, (hf, _) in enumerate(step.outputs):
            writer.write(hf, t.expert(reader.read(native, _slot(slot, j)), native))


def execute(plan: Plan, reader, writer) -> None:
    """Runs ``plan``: ``reader.read(key, slot)`` -> transform -> ``writer.write(key, array,
    slot)``, one entry at a time (per-expert entries one expert at a time)."""
    for step in plan.steps:
        if step.entry.transform.per_expert:
            _per_expert(step, plan.direction, reader, writer)
            continue
        arrays = [reader.read(key, slot) for key, slot in step.inputs]
        names = [key for key, _ in step.inputs]
        if plan.direction == "to_native":
            out = step.entry.transform.to_native(arrays, step.native_shapes, names)
        else:
            out = step.entry.transform.to_hf(arrays, names)
        del arrays  # outputs may be views of the inputs; nothing else holds them
        for (key, slot), array in zip(step.outputs, out, strict=True):
            writer.write(key, array, slot)
        del out


class _ArrayInfo:
    def __init__(self, array):
        self.shape, self.dtype = tuple(np.shape(array)), sio.CODES[np.asarray(array).dtype]


class _DictReader:
    def __init__(self, arrays: Mapping[str, np.ndarray]):
        self.arrays = arrays

    def read(self, key, slot=None):
        a = np.asarray(self.arrays[key])
        return a if slot is None else a[slot]


class _DictWriter:
    def __init__(self, specs: Sequence[sio.OutputSpec]):
        self.out = {s.name: np.empty(s.shape, sio.DTYPES[s.dtype]) for s in specs}

    def write(self, key, array, slot=None):
        if slot is None:
            self.out[key][...] = array
        else:
            self.out[key][slot] = array


def hf_to_native_params(
    hf_tensors: Mapping[str, np.ndarray],
    hf_config: Mapping[str, Any],
    *,
    vision: bool = False,
    **overrides,
) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """In memory: HF tensors (by key) -> ``(cfg, native flat params)``; ``vision``: with
    the vision tower."""
    infos = {k: _ArrayInfo(v) for k, v in hf_tensors.items()}
    plan = plan_to_native(hf_config, infos, vision=vision, **overrides)
    writer = _DictWriter(plan.outputs)
    execute(plan, _DictReader(hf_tensors), writer)
    return plan.cfg, writer.out


def native_to_hf_params(
    params: Mapping[str, np.ndarray],
    cfg: ModelConfig,
    *,
    layout: str | None = None,
    prefix: str = CANONICAL,
) -> dict[str, np.ndarray]:
    """In memory: native flat params of ``cfg`` -> HF tensors (by key)."""
    plan = plan_to_hf(
        NativeMeta(cfg), {k: _ArrayInfo(v) for k, v in params.items()}, layout=layout, prefix=prefix
    )
    writer = _DictWriter(plan.outputs)
    execute(plan, _DictReader(params), writer)
    return writer.out


@dataclasses.dataclass(frozen=True)
class Summary:
    """What a conversion did (the CLI prints it)."""

    direction: str
    family: str
    layout: str
    prefix: str
    tensors_in: int
    tensors_out: int
    bytes_out: int
    files: tuple[str, ...]
    ignored: int
    seconds: float

    def line(self) -> str:
        return (
            f"{self.direction}: {self.family} ({self.layout} layout, prefix {self.prefix!r}), "
            f"{self.tensors_in} -> {self.tensors_out} tensors, {self.bytes_out / 1e6:.1f} MB "
            f"in {len(self.files)} file(s), {self.ignored} ignored, {self.seconds:.2f} s "
            f"({self.bytes_out / 1e6 / max(self.seconds, 1e-9):.0f} MB/s)"
        )


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    """The JSON object in ``path`` (a checkpoint directory's ``config.json``).

    Raises:
      ConversionError: the directory or file is missing or not what it should be, the
        file is not JSON, or its top level is not an object (one line naming the path).
    """
    check_source_dir(path.parent)
    return read_json_object(path)


def _run(
    plan: Plan,
    reader,
    dst,
    stem: str,
    write_config,
    max_shard_bytes: int,
    fsync: bool,
    started: float,
    tensors_in: int,
) -> Summary:
    with directories.atomic_directory(dst, fsync=fsync) as tmp:
        writer = sio.CheckpointWriter(tmp, stem, plan.outputs, max_shard_bytes, fsync=fsync)
        try:
            execute(plan, reader, writer)
            files = writer.finish()
        except BaseException:
            writer.abort()
            raise
        write_config(tmp)
    return Summary(
        plan.direction,
        plan.cfg.family,
        plan.layout,
        plan.prefix,
        tensors_in,
        len(plan.outputs),
        sum(s.nbytes for s in plan.outputs),
        tuple(files),
        len(plan.ignored),
        time.perf_counter() - started,
    )


def convert_hf_to_native(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    max_shard_bytes: int = sio.DEFAULT_SHARD_BYTES,
    fsync: bool = True,
    vision: bool = False,
    **overrides,
) -> Summary:
    """HF checkpoint directory ``src`` -> new native directory ``dst`` (streamed, atomic).

    Args:
      max_shard_bytes: largest output shard (a larger tensor gets a shard of its own).
      fsync: flush the shards to disk before the atomic rename.
      vision: convert the vision tower too (Gemma 4); by default only the text model.
      overrides: native-only config fields, e.g. ``scan_layers=True``.

    Raises:
      ConversionError: bad config or checkpoint, or ``dst`` exists; nothing is written.
    """
    started = time.perf_counter()
    src = pathlib.Path(src)
    directories.check_destination(dst)  # before reading anything
    hf_config = _read_json(src / "config.json")
    with sio.CheckpointReader(src, "model") as reader:
        plan = plan_to_native(hf_config, reader.tensors, str(src), vision=vision, **overrides)
        meta = NativeMeta(plan.cfg, hf_config, plan.layout, plan.prefix)
        return _run(
            plan,
            reader,
            dst,
            STEM,
            meta.write,
            max_shard_bytes,
            fsync,
            started,
            len(reader.tensors),
        )


def _hf_config_for(meta: NativeMeta, prefix: str) -> dict[str, Any]:
    """The original config.json when it describes the same model, else a generated one;
    the family's multimodal wrapper only when writing its key prefix."""
    cfg = meta.cfg
    family = families.get(cfg.family)
    original = meta.hf_config
    vision = cfg.vision is not None
    if original is not None and hf_view(from_hf_config(original, vision=vision)) != hf_view(cfg):
        original = None  # the model changed since conversion (e.g. a new config)
    text = text_config(original) if original is not None else to_hf_config(cfg)
    if prefix == CANONICAL:
        return dict(text, architectures=[family.architecture], model_type=family.model_type)
    if original is not None and "text_config" in original:
        return original
    return family.wrap_hf(cfg, text)


def default_prefix(meta: NativeMeta) -> str:
    """The source's key prefix when the source held nothing but the text model, the
    multimodal wrapper's for a model with a vision tower, else ``model.``."""
    hf = meta.hf_config or {}
    if meta.cfg.vision is not None:  # only the multimodal wrapper holds the tower
        return next(p for p in families.get(meta.cfg.family).table.prefixes if p != CANONICAL)
    if (
        meta.hf_prefix != CANONICAL
        and hf.get("vision_config") is None
        and hf.get("audio_config") is None
    ):
        return meta.hf_prefix
    return CANONICAL


#: The files of a checkpoint's formats (``posttrain.chat``; a run's export writes them)
#: that native -> HF copies beside the weights, for transformers and serving stacks.
FORMAT_FILES = (
    "chat_template.jinja",
    "generation_config.json",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
)


def convert_native_to_hf(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    layout: str | None = None,
    prefix: str | None = None,
    max_shard_bytes: int = sio.DEFAULT_SHARD_BYTES,
    fsync: bool = True,
) -> Summary:
    """Native directory ``src`` -> new HF directory ``dst`` that ``from_pretrained`` loads,
    with ``src``'s :data:`FORMAT_FILES` (chat template, tokenizer, generation config).

    Args:
      layout: ``hub`` (default: per-expert tensors where HF has them) or ``fused``.
      prefix: HF key prefix; default :func:`default_prefix`.
      max_shard_bytes, fsync: as in :func:`convert_hf_to_native`.
    """
    started = time.perf_counter()
    directories.check_destination(dst)  # before reading anything
    meta = NativeMeta.read(src)
    prefix = prefix or default_prefix(meta)
    with sio.CheckpointReader(src, STEM) as reader:
        plan = plan_to_hf(meta, reader.tensors, layout=layout, prefix=prefix, source=str(src))
        config = _hf_config_for(meta, prefix)

        def write_config(directory: pathlib.Path) -> None:
            (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            for name in FORMAT_FILES:  # a run's export: serve it in the format it trained
                if (pathlib.Path(src) / name).is_file():
                    shutil.copyfile(pathlib.Path(src) / name, directory / name)

        return _run(
            plan,
            reader,
            dst,
            "model",
            write_config,
            max_shard_bytes,
            fsync,
            started,
            len(reader.tensors),
        )
