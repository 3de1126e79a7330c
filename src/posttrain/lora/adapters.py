"""Adapter files: the native format (save / load) and Hugging Face PEFT export.

Native: a directory with ``lora_config.json`` (the LoRA config and the model
it was made for) and ``lora_adapter.safetensors`` (every ``nnx.LoRAParam`` by
dotted path). Loading checks the config against the model's and lists every
difference; an adapter saved from a scanned model loads into an unscanned one
and back (``stack_layers`` / ``unstack_layers``).

PEFT: ``adapter_config.json`` and ``adapter_model.safetensors`` as
``peft.PeftModel.from_pretrained`` reads them (peft 0.x LoRA, not rsLoRA: the
scale is ``lora_alpha / r``, the same as Qwix's). Module names come from the
conversion table (``posttrain.families.get(family).table``): a native weight maps to an
HF ``nn.Linear`` whose ``weight`` is ``[out, in]``; ``lora_A.weight`` is
``[r, in]`` and ``lora_B.weight`` ``[out, r]``, with the native dims flattened
in the order the table's transform flattens them (``heads_in``, ``heads_out``,
``transpose``). Adapters on routed experts have no PEFT ``nn.Linear`` and are
refused.
"""

from __future__ import annotations

import json
import os
import pathlib

import jax
import numpy as np
import safetensors.numpy
from flax import nnx

from posttrain import _compat, families
from posttrain.conversion.directories import atomic_directory
from posttrain.distributed import host_array
from posttrain.hf_schema.rows import expand
from posttrain.lora import layout
from posttrain.lora.config import LoraConfig, lora_config_of
from posttrain.models.decoder import stack_layers, unstack_layers
from posttrain.tree import path_name

CONFIG_FILE, ADAPTER_FILE = "lora_config.json", "lora_adapter.safetensors"
PEFT_CONFIG_FILE, PEFT_ADAPTER_FILE = "adapter_config.json", "adapter_model.safetensors"
FORMAT, VERSION = "posttrain-lora", 1  # VERSION: of lora_config.json's layout
_CHECKED = ("family", "num_layers", "rank", "alpha", "target", "weight_qtype", "tile_size")
_PEFT_TRANSFORMS = ("heads_in", "heads_out", "transpose")


def _describe(model: nnx.Module) -> dict:
    config, cfg = lora_config_of(model), model.config
    return {
        "format": FORMAT,
        "version": VERSION,
        "family": cfg.family,
        "num_layers": cfg.num_layers,
        "scan_layers": cfg.scan_layers,
        "rank": config.rank,
        "alpha": float(config.alpha),
        "dropout": config.dropout,
        "target": config.target_regex,
        "weight_qtype": config.weight_qtype,
        "tile_size": config.tile_size,
    }


def adapter_arrays(model) -> dict[str, np.ndarray]:
    """``model``'s LoRA parameters as host arrays by path (gathered across processes: a
    collective, :func:`posttrain.distributed.host_array`)."""
    state = nnx.state(model, nnx.LoRAParam)
    return {
        path_name(p): host_array(_compat.variable_value(v)) for p, v in nnx.to_flat_state(state)
    }


def save_adapter(
    model: nnx.Module,
    directory: str | os.PathLike,
    arrays: dict[str, np.ndarray] | None = None,
) -> pathlib.Path:
    """Writes ``model``'s adapters and LoRA config to a new ``directory`` (atomically).

    ``arrays``: :func:`adapter_arrays` of ``model`` when already gathered (across
    processes every process gathers and one writes).

    Raises:
      ValueError: the model was not built by ``apply_lora``.
      ConversionError: ``directory`` exists or its parent does not.
    """
    meta = _describe(model)
    arrays = adapter_arrays(model) if arrays is None else arrays
    with atomic_directory(directory) as tmp:
        safetensors.numpy.save_file(arrays, str(tmp / ADAPTER_FILE), metadata={"format": FORMAT})
        (tmp / CONFIG_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return pathlib.Path(directory)


def read_adapter_config(directory: str | os.PathLike) -> dict:
    """The ``lora_config.json`` of adapter ``directory``: a JSON object of format
    :data:`FORMAT` (its fields are checked by :func:`saved_lora_config`).

    Raises:
      ValueError: no such file, not readable JSON, not an object, another format (the
        file named).
    """
    path = pathlib.Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"{directory}: no {CONFIG_FILE} (not a posttrain adapter)")
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as error:
        raise ValueError(f"{path}: not readable JSON ({error})") from None
    if not isinstance(saved, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(saved).__name__}")
    if saved.get("format") != FORMAT:
        raise ValueError(f"{path} is not a {FORMAT} config")
    return saved


def saved_lora_config(saved: dict, directory: str | os.PathLike) -> LoraConfig:
    """The :class:`LoraConfig` recorded in an adapter's ``lora_config.json``
    (:func:`read_adapter_config`).

    Raises:
      ValueError: a field missing or of the wrong type or range (the file and the
        field named).
    """
    path = pathlib.Path(directory) / CONFIG_FILE
    fields = ("rank", "alpha", "target", "weight_qtype", "tile_size")
    missing = [name for name in fields if name not in saved]
    if missing:
        raise ValueError(f"{path}: no {', '.join(missing)}")
    if not (saved["target"] is None or isinstance(saved["target"], str)):
        raise ValueError(f"{path}: target={saved['target']!r} must be a regex string")
    try:
        return LoraConfig(**{name: saved[name] for name in fields})
    except (TypeError, ValueError) as error:
        raise ValueError(f"{path}: {error}") from None


def load_adapter(model: nnx.Module, directory: str | os.PathLike) -> nnx.Module:
    """Loads adapters saved by :func:`save_adapter` into ``model`` in place (keeping shardings).

    Returns:
      ``model``.

    Raises:
      ValueError: the model was not built by ``apply_lora``, the config is not a
        ``posttrain-lora`` one of version :data:`VERSION`, the saved config differs from
        the model's in family,
        num_layers, rank, alpha, target, weight_qtype or tile_size (the message
        lists each difference), or the tensors do not match the model's
        adapters (names or shapes).
    """
    directory = pathlib.Path(directory)
    saved = read_adapter_config(directory)
    if saved.get("version") != VERSION:  # a later layout read as this one would misload
        raise ValueError(
            f"{directory / CONFIG_FILE} has {FORMAT} version {saved.get('version')!r}; "
            f"this release reads version {VERSION}"
        )
    want = _describe(model)
    diffs = [
        f"{k} {saved.get(k)!r} (adapter) != {want[k]!r} (model)"
        for k in _CHECKED
        if saved.get(k) != want[k]
    ]
    if diffs:
        raise ValueError(f"adapter {directory} does not fit this model: {'; '.join(diffs)}")
    tensors = safetensors.numpy.load_file(str(directory / ADAPTER_FILE))
    if saved["scan_layers"] != want["scan_layers"]:
        cfg = model.config
        tensors = stack_layers(tensors, cfg) if cfg.scan_layers else unstack_layers(tensors, cfg)
    state = nnx.state(model, nnx.LoRAParam)
    names = {path_name(p) for p, _ in nnx.to_flat_state(state)}
    missing, extra = sorted(names - set(tensors)), sorted(set(tensors) - names)
    if missing or extra:
        raise ValueError(
            f"adapter {directory}: missing {missing[:4]}, unexpected {extra[:4]} "
            f"({len(missing)} missing, {len(extra)} unexpected)"
        )

    def one(path, var):
        old, new = _compat.variable_value(var), tensors[path_name(path)]
        if new.shape != old.shape:
            raise ValueError(
                f"adapter {path_name(path)}: shape {list(new.shape)} != "
                f"{list(old.shape)} in the model"
            )
        return var.replace(jax.device_put(new.astype(old.dtype), old.sharding))

    nnx.update(model, nnx.from_flat_state([(p, one(p, v)) for p, v in nnx.to_flat_state(state)]))
    return model


def _per_layer(model) -> list[tuple[str, np.ndarray, np.ndarray, tuple[int, ...]]]:
    """``(native weight key, A, B, a_dims)`` per layer (scanned blocks unstacked)."""
    cfg = model.config
    period, out = cfg.layer_period, []
    for ad in layout.iter_adapters(model):
        a, b = np.asarray(jax.device_get(ad.a)), np.asarray(jax.device_get(ad.b))
        if not ad.stacked:
            out.append((ad.key, a, b, ad.a_dims))
            continue
        parts = ad.key.split(".")
        at = parts.index("blocks")
        p = int(parts[at + 1])
        for j in range(a.shape[0]):
            key = ".".join([*parts[:at], "layers", str(j * period + p), *parts[at + 2 :]])
            out.append((key, a[j], b[j], ad.a_dims))
    return out


def export_peft(
    model: nnx.Module, directory: str | os.PathLike, *, base_model_name_or_path: str | None = None
) -> pathlib.Path:
    """Writes ``model``'s adapters as a PEFT LoRA adapter of the HF model to a new ``directory``.

    Raises:
      ValueError: the model was not built by ``apply_lora``, an adapter sits on a weight
        with no HF ``nn.Linear`` in the family's conversion table (e.g. routed experts),
        or the family has no table.
    """
    cfg, meta = model.config, _describe(model)
    if cfg.family not in families.FAMILIES:
        raise ValueError(f"family {cfg.family!r} has no conversion table; PEFT export needs one")
    table = families.get(cfg.family).table
    entries = expand(table.rows, cfg.replace(scan_layers=False), table.layouts[0])
    by_native = {e.native_keys[0]: e for e in entries if len(e.native_keys) == 1}
    rank, tensors, modules = meta["rank"], {}, set()
    for key, a, b, a_dims in _per_layer(model):
        entry = by_native.get(key)
        if entry is None or entry.transform.name not in _PEFT_TRANSFORMS:
            how = "no row" if entry is None else f"transform {entry.transform.name}"
            raise ValueError(
                f"PEFT export supports adapters on attention and dense MLP "
                f"projections (HF nn.Linear); {key} has {how} in the "
                f"{cfg.family} table"
            )
        if a_dims != tuple(range(len(a_dims))):
            raise ValueError(f"{key}: adapter A covers dims {a_dims}, not the leading input dims")
        module = entry.hf_keys[0].removesuffix(".weight")
        modules.add(module)
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.reshape(-1, rank).T  # [r, in]
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.reshape(rank, -1).T  # [out, r]
    targets = []
    for short in sorted({m.rsplit(".", 1)[-1] for m in modules}):
        every = {
            e.hf_keys[0].removesuffix(".weight")
            for e in by_native.values()
            if e.hf_keys[0].removesuffix(".weight").rsplit(".", 1)[-1] == short
        }
        ours = {m for m in modules if m.rsplit(".", 1)[-1] == short}
        targets += [short] if ours == every else sorted(ours)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": meta["alpha"],
        "lora_dropout": meta["dropout"],
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "base_model_name_or_path": base_model_name_or_path,
        "revision": None,
    }
    with atomic_directory(directory) as tmp:
        safetensors.numpy.save_file(
            {k: np.ascontiguousarray(v) for k, v in tensors.items()},
            str(tmp / PEFT_ADAPTER_FILE),
            metadata={"format": "pt"},
        )
        (tmp / PEFT_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return pathlib.Path(directory)
