"""The conversion engine: one plan per direction from the same rows, then a streaming run.

Planning reads only headers and configs. It expands the family's rows for the
config, proves that the rows cover every native parameter of ``CausalLM(cfg)``
exactly once and every checkpoint tensor exactly once (picking the layout and
key prefix that match), checks every shape through the rows' transforms, and
fixes the output headers. Only then does :func:`execute` read, transform and
write, one table entry (one layer's tensors) at a time. Layer stacking for
scanned models writes each layer into its slot of the stacked tensor, and
reads it back slot by slot.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from posttrain import families
from posttrain.config import ModelConfig
from posttrain.conversion import safetensors_io as sio
from posttrain.conversion.errors import ConversionError, check_source_dir, read_json_object
from posttrain.conversion.hf_config import (
    from_hf_config,
    hf_view,
    text_config,
    to_hf_config,
)
from posttrain.conversion.native import STEM, NativeMeta, abstract_params, scanned_name
from posttrain.conversion.rows import Entry, expand
from posttrain.conversion.table import Table

CANONICAL = "model."
FLOAT_CODES = ("F64", "F32", "F16", "BF16")  # safetensors dtype codes a weight may have
ALWAYS_IGNORED = (".rotary_emb.inv_freq",)  # non-persistent buffers some old checkpoints hold
QUANTISED_SUFFIXES = ("_blocks", "_scales")  # GPT-OSS MXFP4 experts


@dataclasses.dataclass(frozen=True)
class Step:
    """One entry's I/O: (key, slot) to read, (key, slot) to write; slot = scanned layer slot."""

    entry: Entry
    inputs: tuple[tuple[str, int | None], ...]
    outputs: tuple[tuple[str, int | None], ...]
    native_shapes: tuple[tuple[int, ...], ...]


@dataclasses.dataclass
class Plan:
    """Everything :func:`execute` needs; built from headers only."""

    direction: str  # "to_native" or "to_hf"
    cfg: ModelConfig
    table: Table
    layout: str
    prefix: str
    steps: list[Step]
    outputs: list[sio.OutputSpec]
    ignored: list[str]


def _tensor_info(tensors: Mapping[str, Any], key: str) -> tuple[tuple[int, ...], str, str]:
    info = tensors[key]
    return tuple(info.shape), info.dtype, getattr(info, "file", "memory")


def _canonical(table: Table, prefix: str, keys) -> tuple[dict[str, str], list[str]]:
    """Canonical HF key -> file key under ``prefix``, and the keys skipped."""
    canon, ignored = {}, []
    for key in keys:
        c = CANONICAL + key[len(prefix) :] if key.startswith(prefix) else key
        skip = key.endswith(ALWAYS_IGNORED) or (
            prefix != CANONICAL and not key.startswith(prefix) and key.startswith(table.ignored)
        )
        if skip:
            ignored.append(key)
        elif c in canon:
            raise ConversionError(f"tensors {canon[c]} and {key} both map to {c}")
        else:
            canon[c] = key
    return canon, ignored


def _describe(keys: set[str], what: str) -> str:
    if not keys:
        return ""
    first = sorted(keys, key=_natural)[0]
    more = f" (+{len(keys) - 1} more)" if len(keys) > 1 else ""
    return f"{what} tensor {first}{more}"


def _natural(key: str):
    return [int(p) if p.isdigit() else p for p in key.split(".")]


def _match(table: Table, cfg: ModelConfig, keys, source: str):
    """The (layout, prefix) whose expanded rows name exactly the checkpoint's tensors."""
    best = None
    for prefix in table.prefixes:
        canon, ignored = _canonical(table, prefix, keys)
        for layout in table.layouts:
            entries = expand(table.rows, cfg, layout)
            expected = {k for e in entries for k in e.hf_keys}
            missing, extra = expected - set(canon), set(canon) - expected
            score = len(missing) + len(extra)
            if best is None or score < best[0]:
                best = (score, layout, prefix, entries, canon, ignored, missing, extra)
    score, layout, prefix, entries, canon, ignored, missing, extra = best
    if score:
        parts = [p for p in (_describe(missing, "missing"), _describe(extra, "unexpected")) if p]
        raise ConversionError(
            f"{source}: {'; '.join(parts)} (closest match: {cfg.family} "
            f"{layout} layout, key prefix {prefix!r})"
        )
    return layout, prefix, entries, canon, ignored


def _check_native_cover(entries: Sequence[Entry], native: Mapping[str, Any], family: str) -> None:
    produced = {k for e in entries for k in e.native_keys}
    missing, extra = set(native) - produced, produced - set(native)
    if missing or extra:
        raise ConversionError(
            f"{family} table does not cover the model: "
            f"{_describe(missing, 'no row for native')}"
            f"{_describe(extra, ' rows name unknown native')}"
        )


def _stacked(cfg: ModelConfig, name: str, slot: int | None, shape) -> tuple[int, ...]:
    return tuple(shape) if slot is None else (cfg.num_layers // cfg.layer_period, *shape)


def _add_output(outputs: dict, cfg, name, slot, dtype, shape) -> None:
    spec = sio.OutputSpec(name, dtype, _stacked(cfg, name, slot, shape))
    if outputs.setdefault(name, spec) != spec:
        raise ConversionError(f"tensor {name}: layers disagree ({outputs[name]} vs {spec})")


def plan_to_native(
    hf_config: Mapping[str, Any],
    tensors: Mapping[str, Any],
    source: str = "checkpoint",
    **overrides,
) -> Plan:
    """Plan HF -> native from headers only: every HF tensor is proven used exactly once
    and every native parameter produced exactly once before any data is read.

    Args:
      hf_config: the parsed ``config.json``.
      tensors: HF key -> object with ``shape``, ``dtype`` (safetensors code) and
        optionally ``file`` (for messages).
      source: the checkpoint's name in messages.
      overrides: native-only config fields (``scan_layers``, ``remat``, ``dtype`` ...).

    Returns:
      The :class:`Plan` :func:`execute` runs (its layout and key prefix detected).

    Raises:
      ConversionError: the config is unsupported (the field named), the checkpoint
        holds MXFP4-quantised experts, or its keys or shapes fit no layout and prefix
        of the family's table (missing, unexpected and mis-shaped keys named).
    """
    cfg = from_hf_config(hf_config, **overrides)
    table = families.get(cfg.family).table
    for key in tensors:
        if key.endswith(QUANTISED_SUFFIXES):
            raise ConversionError(
                f"tensor {key}: MXFP4-quantised experts (*_blocks/*_scales) "
                "are not supported; dequantise first (transformers "
                "Mxfp4Config(dequantize=True), then save_pretrained)"
            )
    layout, prefix, entries, canon, ignored = _match(table, cfg, tensors, source)
    native = abstract_params(cfg.replace(scan_layers=False))
    _check_native_cover(entries, native, cfg.family)
    num_experts = cfg.moe.num_experts if cfg.moe is not None else None
    steps, outputs = [], {}
    for e in entries:
        nshapes = tuple(tuple(native[k].shape) for k in e.native_keys)
        want = e.transform.hf_shapes(nshapes, e.native_keys, num_experts)
        files = tuple(canon[k] for k in e.hf_keys)
        dtypes = set()
        for key, shape in zip(files, want, strict=True):
            got, dtype, file = _tensor_info(tensors, key)
            if got != tuple(shape):
                raise ConversionError(
                    f"tensor {key} in {file}: shape {list(got)}, expected "
                    f"{list(shape)} (for native {e.native_keys[0]} "
                    f"{list(nshapes[0])})"
                )
            if dtype not in FLOAT_CODES:
                raise ConversionError(
                    f"tensor {key} in {file}: dtype {dtype}, expected a floating-point "
                    f"weight ({', '.join(FLOAT_CODES)})"
                )
            dtypes.add(dtype)
        if len(dtypes) > 1:
            raise ConversionError(f"tensors {list(files)[:2]}: mixed dtypes {sorted(dtypes)}")
        dtype = dtypes.pop()
        outs = tuple(scanned_name(k, cfg) for k in e.native_keys)
        for (name, slot), shape in zip(outs, nshapes, strict=True):
            _add_output(outputs, cfg, name, slot, dtype, shape)
        steps.append(Step(e, tuple((f, None) for f in files), outs, nshapes))
    if cfg.scan_layers:  # the stacked names and shapes are the scanned model's
        scanned = {k: tuple(v.shape) for k, v in abstract_params(cfg).items()}
        if scanned != {k: s.shape for k, s in outputs.items()}:
            raise ConversionError("stacked layer names or shapes differ from the scanned model")
    return Plan("to_native", cfg, table, layout, prefix, steps, list(outputs.values()), ignored)


def plan_to_hf(
    meta: NativeMeta,
    tensors: Mapping[str, Any],
    *,
    layout: str | None = None,
    prefix: str = CANONICAL,
    source: str = "checkpoint",
) -> Plan:
    """Plan native -> HF from headers only.

    Args:
      meta: the native directory's config (and the HF config it was converted from).
      tensors: native key -> object with ``shape``, ``dtype`` and optionally ``file``.
      layout: ``hub`` or ``fused`` (default: the table's first, the hub layout).
      prefix: HF key prefix (``model.``, or a multimodal wrapper's, e.g. Gemma 4's
        ``model.language_model.``).
      source: the checkpoint's name in messages.

    Returns:
      The :class:`Plan` :func:`execute` runs.

    Raises:
      ConversionError: the family has no table, ``layout`` or ``prefix`` is not the
        table's, or the stored tensors are missing, unexpected or mis-shaped for the
        stored config (each named).
    """
    cfg = meta.cfg
    if cfg.family not in families.FAMILIES:
        raise ConversionError(
            f"{source}: family {cfg.family!r} has no conversion table; "
            f"supported: {', '.join(sorted(families.NAMES))}"
        )
    table = families.get(cfg.family).table
    layout = layout or table.layouts[0]
    if layout not in table.layouts:
        raise ConversionError(f"layout {layout!r} must be one of {', '.join(table.layouts)}")
    if prefix not in table.prefixes:
        raise ConversionError(f"key prefix {prefix!r} must be one of {table.prefixes}")
    entries = expand(table.rows, cfg, layout)
    native = abstract_params(cfg.replace(scan_layers=False))
    _check_native_cover(entries, native, cfg.family)
    stored = {k: tuple(v.shape) for k, v in abstract_params(cfg).items()}
    missing, extra = set(stored) - set(tensors), set(tensors) - set(stored)
    if missing or extra:
        parts = [p for p in (_describe(missing, "missing"), _describe(extra, "unexpected")) if p]
        raise ConversionError(f"{source}: {'; '.join(parts)} (for the stored {cfg.family} config)")
    for key, shape in stored.items():
        got, _, file = _tensor_info(tensors, key)
        if got != shape:
            raise ConversionError(
                f"tensor {key} in {file}: shape {list(got)}, expected {list(shape)}"
            )
    num_experts = cfg.moe.num_experts if cfg.moe is not None else None
    steps, outputs = [], {}
    for e in entries:
        nshapes = tuple(tuple(native[k].shape) for k in e.native_keys)
        inputs = tuple(scanned_name(k, cfg) for k in e.native_keys)
        dtypes = {_tensor_info(tensors, name)[1] for name, _ in inputs}
        if not dtypes <= set(FLOAT_CODES):
            raise ConversionError(
                f"parameter {inputs[0][0]}: dtype {sorted(dtypes - set(FLOAT_CODES))[0]}, "
                f"expected a floating-point weight ({', '.join(FLOAT_CODES)})"
            )
        if len(dtypes) > 1:
            raise ConversionError(
                f"tensors {[n for n, _ in inputs]}: mixed dtypes {sorted(dtypes)}"
            )
        dtype = dtypes.pop()
        hf_shapes = e.transform.hf_shapes(nshapes, e.native_keys, num_experts)
        outs = tuple(
            (prefix + k[len(CANONICAL) :] if k.startswith(CANONICAL) else k, None)
            for k in e.hf_keys
        )
        for (name, _), shape in zip(outs, hf_shapes, strict=True):
            _add_output(outputs, cfg, name, None, dtype, shape)
        steps.append(Step(e, inputs, outs, nshapes))
    return Plan("to_hf", cfg, table, layout, prefix, steps, list(outputs.values()), [])


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
    hf_tensors: Mapping[str, np.ndarray], hf_config: Mapping[str, Any], **overrides
) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """In memory: HF tensors (by key) -> ``(cfg, native flat params)``."""
    plan = plan_to_native(hf_config, {k: _ArrayInfo(v) for k, v in hf_tensors.items()}, **overrides)
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
    with sio.atomic_directory(dst, fsync=fsync) as tmp:
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
    **overrides,
) -> Summary:
    """HF checkpoint directory ``src`` -> new native directory ``dst`` (streamed, atomic).

    Args:
      max_shard_bytes: largest output shard (a larger tensor gets a shard of its own).
      fsync: flush the shards to disk before the atomic rename.
      overrides: native-only config fields, e.g. ``scan_layers=True``.

    Raises:
      ConversionError: bad config or checkpoint, or ``dst`` exists; nothing is written.
    """
    started = time.perf_counter()
    src = pathlib.Path(src)
    sio.check_destination(dst)  # before reading anything
    hf_config = _read_json(src / "config.json")
    with sio.CheckpointReader(src, "model") as reader:
        plan = plan_to_native(hf_config, reader.tensors, str(src), **overrides)
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
    if original is not None and hf_view(from_hf_config(original)) != hf_view(cfg):
        original = None  # the model changed since conversion (e.g. a new config)
    text = text_config(original) if original is not None else to_hf_config(cfg)
    if prefix == CANONICAL:
        return dict(text, architectures=[family.architecture], model_type=family.model_type)
    if original is not None and "text_config" in original:
        return original
    return family.wrap_hf(cfg, text)


def default_prefix(meta: NativeMeta) -> str:
    """The source's key prefix when the source held nothing but the text model, else ``model.``."""
    hf = meta.hf_config or {}
    if (
        meta.hf_prefix != CANONICAL
        and hf.get("vision_config") is None
        and hf.get("audio_config") is None
    ):
        return meta.hf_prefix
    return CANONICAL


def convert_native_to_hf(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    layout: str | None = None,
    prefix: str | None = None,
    max_shard_bytes: int = sio.DEFAULT_SHARD_BYTES,
    fsync: bool = True,
) -> Summary:
    """Native directory ``src`` -> new HF directory ``dst`` that ``from_pretrained`` loads.

    Args:
      layout: ``hub`` (default: per-expert tensors where HF has them) or ``fused``.
      prefix: HF key prefix; default :func:`default_prefix`.
      max_shard_bytes, fsync: as in :func:`convert_hf_to_native`.
    """
    started = time.perf_counter()
    sio.check_destination(dst)  # before reading anything
    meta = NativeMeta.read(src)
    prefix = prefix or default_prefix(meta)
    with sio.CheckpointReader(src, STEM) as reader:
        plan = plan_to_hf(meta, reader.tensors, layout=layout, prefix=prefix, source=str(src))
        config = _hf_config_for(meta, prefix)

        def write_config(directory: pathlib.Path) -> None:
            (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")

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
