"""Conversion plans: from configs and tensor headers only, before any data is read.

A plan expands the family's table rows for the config, proves that the rows cover
every native parameter of ``CausalLM(cfg)`` exactly once and every checkpoint tensor
exactly once (picking the layout and key prefix that match), checks every shape
through the rows' transforms and fixes the output headers. :mod:`.engine` runs it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from posttrain import families
from posttrain.config import ModelConfig
from posttrain.conversion import safetensors_io as sio
from posttrain.conversion.errors import ConversionError
from posttrain.conversion.hf_config import (
    from_hf_config,
)
from posttrain.conversion.native import NativeMeta, abstract_params, scanned_name
from posttrain.hf_schema.rows import Entry, expand
from posttrain.hf_schema.table import Table

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


def _canonical(
    table: Table, prefix: str, keys, expected: set[str]
) -> tuple[dict[str, str], list[str]]:
    """Canonical HF key -> file key under ``prefix``, and the keys skipped (a tower's
    keys, ``table.ignored``, are skipped unless the config has the tower: ``expected``)."""
    canon, ignored = {}, []
    for key in keys:
        c = CANONICAL + key[len(prefix) :] if key.startswith(prefix) else key
        skip = key.endswith(ALWAYS_IGNORED) or (
            prefix != CANONICAL
            and not key.startswith(prefix)
            and key.startswith(table.ignored)
            and c not in expected
        )
        if skip:
            ignored.append(key)
        elif c in canon:
            raise ConversionError(f"tensors {canon[c]} and {key} both map to {c}")
        else:
            canon[c] = key
    return canon, ignored


def _under(prefix: str, key: str) -> str:
    """Canonical ``key`` (``model.<rest>``) under ``prefix``."""
    return prefix + key[len(CANONICAL) :] if key.startswith(CANONICAL) else key


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
        for layout in table.layouts:
            entries = expand(table.rows, cfg, layout)
            expected = {k for e in entries for k in e.hf_keys}
            canon, ignored = _canonical(table, prefix, keys, expected)
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
    *,
    vision: bool = False,
    **overrides,
) -> Plan:
    """Plan HF -> native from headers only: every HF tensor is proven used exactly once
    and every native parameter produced exactly once before any data is read.

    Args:
      hf_config: the parsed ``config.json``.
      tensors: HF key -> object with ``shape``, ``dtype`` (safetensors code) and
        optionally ``file`` (for messages).
      source: the checkpoint's name in messages.
      vision: read the vision tower too (:func:`~posttrain.conversion.hf_config.from_hf_config`).
      overrides: native-only config fields (``scan_layers``, ``remat``, ``dtype`` ...).

    Returns:
      The :class:`Plan` :func:`execute` runs (its layout and key prefix detected).

    Raises:
      ConversionError: the config is unsupported (the field named), the checkpoint
        holds MXFP4-quantised experts, or its keys or shapes fit no layout and prefix
        of the family's table (missing, unexpected and mis-shaped keys named).
    """
    cfg = from_hf_config(hf_config, vision=vision, **overrides)
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
    table, layout = _table_for_hf(cfg, layout, prefix, source)
    entries = expand(table.rows, cfg, layout)
    native = abstract_params(cfg.replace(scan_layers=False))
    _check_native_cover(entries, native, cfg.family)
    _check_stored(cfg, tensors, source)
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
        outs = tuple(  # a tower's keys (table.ignored) keep theirs
            (_under(prefix, k) if not k.startswith(table.ignored) else k, None) for k in e.hf_keys
        )
        for (name, _), shape in zip(outs, hf_shapes, strict=True):
            _add_output(outputs, cfg, name, None, dtype, shape)
        steps.append(Step(e, inputs, outs, nshapes))
    return Plan("to_hf", cfg, table, layout, prefix, steps, list(outputs.values()), [])


def _table_for_hf(cfg, layout: str | None, prefix: str, source: str):
    """``(table, layout)`` of ``cfg``'s family for native -> HF; the layout defaults to the
    table's first (the hub's).

    Raises:
      ConversionError: the family has no table, or ``layout`` or ``prefix`` is not its
        (a model with a vision tower takes its multimodal prefix).
    """
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
    if cfg.vision is not None and prefix == CANONICAL:
        raise ConversionError(
            f"{source}: a model with a vision tower is written under its multimodal key "
            f"prefix {[p for p in table.prefixes if p != CANONICAL]}, not {prefix!r}"
        )
    return table, layout


def _check_stored(cfg, tensors: Mapping[str, Any], source: str) -> None:
    """The stored tensors are exactly ``cfg``'s native parameters, each of its shape.

    Raises:
      ConversionError: tensors missing, unexpected or mis-shaped (each named).
    """
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
