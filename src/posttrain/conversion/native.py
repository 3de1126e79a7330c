"""The native checkpoint directory, and loading it into a :class:`~posttrain.models.CausalLM`.

A native directory holds:

* ``config.json``: ``{"format": "posttrain-native", "format_version": 1,
  "model_config": <ModelConfig as a dict>, "hf_config": <the source config.json
  or null>, "hf_layout": "hub" | "fused" | null, "hf_prefix": "model." | ...}``;
* ``params.safetensors`` (or ``params-0000k-of-0000n.safetensors`` and
  ``params.safetensors.index.json``): one tensor per ``nnx.Param``, named by its
  dotted path (``model.layers.0.self_attn.q_proj.kernel``; scanned models
  ``model.blocks.{p}...`` with the leading ``layers`` axis), in the checkpoint's
  own dtype.

It is safetensors rather than Orbax because conversion streams tensor by
tensor, with every header known up front: Orbax saves a whole pytree at once,
which would need the whole model in memory. A loaded model can be saved with
Orbax by the trainer like any other NNX state.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain import _compat
from posttrain.config import AttentionConfig, ModelConfig, MoEConfig, RopeConfig, VisionConfig
from posttrain.conversion import directories
from posttrain.conversion import safetensors_io as sio
from posttrain.conversion.errors import ConversionError, check_source_dir, read_json_object
from posttrain.models import CausalLM, stack_layers, unstack_layers
from posttrain.models.decoder import VISION_PREFIX
from posttrain.tree import path_name

FORMAT, FORMAT_VERSION, STEM = "posttrain-native", 1, "params"


def config_to_dict(cfg: ModelConfig) -> dict[str, Any]:
    """JSON-able dict of ``cfg`` (nested dataclasses as dicts)."""
    return dataclasses.asdict(cfg)


def config_from_dict(d: Mapping[str, Any]) -> ModelConfig:
    """Inverse of :func:`config_to_dict`."""
    d = dict(d)
    d["attention"] = {
        t: AttentionConfig(**dict(a, rope=RopeConfig(**a["rope"])))
        for t, a in d["attention"].items()
    }
    d["layer_types"] = tuple(d["layer_types"])
    if d.get("moe") is not None:
        d["moe"] = MoEConfig(**d["moe"])
    if d.get("vision") is not None:
        d["vision"] = VisionConfig(**d["vision"])
    return ModelConfig(**d)


def _param_leaves(state):
    return jax.tree_util.tree_leaves_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))


_ABSTRACT: dict[str, dict[str, jax.ShapeDtypeStruct]] = {}


def abstract_params(cfg: ModelConfig) -> dict[str, jax.ShapeDtypeStruct]:
    """Shape and dtype of every parameter of ``CausalLM(cfg)``, by dotted path.

    Traced with ``nnx.eval_shape`` (no allocation; about 0.3 s for a tiny model on 2 CPU
    cores, so the result is cached per ``repr(cfg)``: a plan asks several times).
    """
    key = repr(cfg)
    if key not in _ABSTRACT:
        model = nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)))
        if len(_ABSTRACT) >= 64:
            _ABSTRACT.pop(next(iter(_ABSTRACT)))
        _ABSTRACT[key] = {
            path_name(p): _compat.variable_value(v)
            for p, v in _param_leaves(nnx.state(model, nnx.Param))
        }
    return dict(_ABSTRACT[key])


def scanned_name(name: str, cfg: ModelConfig) -> tuple[str, int | None]:
    """Where unscanned ``name`` lives in a scanned model: (stacked name, slot), the
    naming of :func:`posttrain.models.stack_layers` (``layers.{i}`` ->
    ``blocks.{i % P}``, slot ``i // P``); non-layer names map to themselves."""
    parts = name.split(".")
    if not cfg.scan_layers or "layers" not in parts or name.startswith(VISION_PREFIX):
        return name, None
    at = parts.index("layers")
    i, period = int(parts[at + 1]), cfg.layer_period
    return ".".join([*parts[:at], "blocks", str(i % period), *parts[at + 2 :]]), i // period


def is_native_dir(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds a native checkpoint (its ``config.json`` says so)."""
    path = pathlib.Path(directory) / "config.json"
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


@dataclasses.dataclass(frozen=True)
class NativeMeta:
    """The ``config.json`` of a native directory."""

    cfg: ModelConfig
    hf_config: dict[str, Any] | None = None
    hf_layout: str | None = None
    hf_prefix: str = "model."

    def write(self, directory: pathlib.Path) -> None:
        body = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "model_config": config_to_dict(self.cfg),
            "hf_config": self.hf_config,
            "hf_layout": self.hf_layout,
            "hf_prefix": self.hf_prefix,
        }
        (directory / "config.json").write_text(json.dumps(body, indent=2) + "\n")

    @classmethod
    def read(cls, directory: str | os.PathLike) -> NativeMeta:
        path = pathlib.Path(directory) / "config.json"
        check_source_dir(path.parent)
        body = read_json_object(path)
        if body.get("format") != FORMAT:
            raise ConversionError(
                f"{path}: format is {body.get('format')!r}, expected "
                f"{FORMAT!r} (an HF directory where a native one was expected?)"
            )
        if body.get("format_version") != FORMAT_VERSION:
            raise ConversionError(
                f"{path}: format_version {body.get('format_version')} is not {FORMAT_VERSION}"
            )
        try:
            cfg = config_from_dict(body["model_config"])
        except (KeyError, TypeError, ValueError) as error:
            raise ConversionError(f"{path}: bad model_config ({error})") from None
        return cls(
            cfg, body.get("hf_config"), body.get("hf_layout"), body.get("hf_prefix") or "model."
        )


def save_native(
    params: Mapping[str, np.ndarray],
    cfg: ModelConfig,
    dst: str | os.PathLike,
    *,
    hf_config: Mapping[str, Any] | None = None,
    max_shard_bytes: int = sio.DEFAULT_SHARD_BYTES,
) -> pathlib.Path:
    """Writes in-memory flat params (e.g. ``flat_params(model)``) as a native directory.

    Raises:
      ConversionError: ``dst`` exists, or the params are not exactly ``CausalLM(cfg)``'s
        (a missing or unexpected name, or a shape that differs: the message names it).
    """
    expected = abstract_params(cfg)
    if set(params) != set(expected):
        missing, extra = sorted(set(expected) - set(params)), sorted(set(params) - set(expected))
        raise ConversionError(
            f"params do not match the config: missing {missing[:3]}, unexpected {extra[:3]}"
        )
    for name, want in sorted(expected.items()):
        if tuple(np.shape(params[name])) != tuple(want.shape):
            raise ConversionError(
                f"parameter {name} is {list(np.shape(params[name]))}, expected {list(want.shape)}"
            )
    specs = [
        sio.OutputSpec(k, sio.CODES[np.asarray(v).dtype], tuple(np.shape(v)))
        for k, v in sorted(params.items())
    ]
    with directories.atomic_directory(dst) as tmp:
        writer = sio.CheckpointWriter(tmp, STEM, specs, max_shard_bytes)
        for spec in specs:
            writer.write(spec.name, np.asarray(params[spec.name]))
        writer.finish()
        NativeMeta(cfg, dict(hf_config) if hf_config is not None else None).write(tmp)
    return pathlib.Path(dst)


def read_native_params(src: str | os.PathLike) -> tuple[NativeMeta, dict[str, np.ndarray]]:
    """Metadata and every parameter of a native directory, in memory."""
    meta = NativeMeta.read(src)
    with sio.CheckpointReader(src, STEM) as reader:
        return meta, {k: reader.read(k) for k in reader.tensors}


def load_native(src: str | os.PathLike, **overrides) -> CausalLM:
    """A :class:`CausalLM` with the parameters of native directory ``src``.

    Args:
      src: a native directory.
      overrides: config changes (``scan_layers``, ``dtype``, ``param_dtype``,
        MoE ``algorithm`` through ``moe=...`` ...); parameters are stacked or
        unstacked for ``scan_layers`` and cast to ``param_dtype``.

    Raises:
      ConversionError: the parameters do not match the (overridden) config.
    """
    meta, params = read_native_params(src)
    cfg = meta.cfg.replace(**overrides) if overrides else meta.cfg
    if meta.cfg.scan_layers:
        params = unstack_layers(params, meta.cfg)
    if cfg.scan_layers:
        params = stack_layers(params, cfg)
    model = nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model, nnx.Param)
    dtype = jnp.dtype(cfg.param_dtype)
    seen = set()

    def fill(path, variable):
        name = path_name(path)
        want = _compat.variable_value(variable)
        if name not in params:
            raise ConversionError(f"{src}: parameter {name} is missing")
        value = params[name]
        if tuple(value.shape) != tuple(want.shape):
            raise ConversionError(
                f"{src}: parameter {name} is {list(value.shape)}, expected {list(want.shape)}"
            )
        seen.add(name)
        return variable.replace(jnp.asarray(value, dtype))

    state = jax.tree_util.tree_map_with_path(
        fill, state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    extra = sorted(set(params) - seen)
    if extra:
        raise ConversionError(f"{src}: parameters {extra[:3]} are not in the model")
    return nnx.merge(graphdef, state)
