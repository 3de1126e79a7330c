"""A model from what a user types: a preset name, a native directory or an HF checkpoint
directory (``posttrain sft --model`` and ``posttrain generate --model``). A run's final
weights go back out through :func:`posttrain.training.export.export_final`."""

from __future__ import annotations

import json
import os
import pathlib
import tempfile

from posttrain import sharding
from posttrain.conversion import convert_hf_to_native, load_native
from posttrain.conversion.directories import temporary_prefix
from posttrain.conversion.native import is_native_dir
from posttrain.lora import LoraConfig, apply_lora
from posttrain.models import PRESETS, build_model, get_config


def load_model(spec: str, mesh, *, seed: int = 0, scratch: str | os.PathLike, **overrides):
    """``(model placed on mesh, HF directory or None)``.

    Args:
      spec: a preset (built with ``seed``), a native directory (``posttrain sft``'s
        ``model-step<N>``) or an HF checkpoint directory (converted into a temporary
        directory beside ``scratch`` first: a kill that skips the cleanup leaves it where
        the next run sweeps it, ``sweep_stale_temporaries``).
      mesh: the mesh to place the model on.
      overrides: native-only config fields (``scan_layers``, ``remat``,
        ``attention_kernel``).

    Raises:
      ValueError: ``spec`` is neither a preset nor a directory; the mesh does not divide
        the model; a conversion error (named).
    """
    if spec in PRESETS:
        return build_model(get_config(spec, **overrides), mesh, seed=seed), None
    if not os.path.isdir(spec):
        raise ValueError(
            f"--model {spec!r} is neither a preset ({', '.join(sorted(PRESETS))})"
            " nor a checkpoint directory (HF or native)"
        )

    if is_native_dir(spec):
        model = load_native(spec, **overrides)
    else:
        out = pathlib.Path(scratch).absolute()
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(
            prefix=temporary_prefix(out, "convert"), dir=out.parent
        ) as tmp:
            convert_hf_to_native(spec, os.path.join(tmp, "native"), fsync=False)
            model = load_native(os.path.join(tmp, "native"), **overrides)
    model.config.check_mesh(dict(mesh.shape), sharding.DEFAULT_RULES)
    sharding.shard_model(model, mesh)
    return model, spec


def recorded_tokenizer(model_dir: str | os.PathLike) -> str | None:
    """The ``tokenizer`` setting of the run that exported ``model_dir`` (its parent's
    ``run.json``, as ``posttrain sft``, ``grpo`` and ``dpo`` write it), or None when there
    is no such record or the run used the embedded tokenizer."""
    run_json = os.path.join(os.path.dirname(os.path.abspath(model_dir)), "run.json")
    if not os.path.isfile(run_json):
        return None
    try:
        with open(run_json, encoding="utf-8") as f:
            body = json.load(f)
    except (OSError, ValueError):
        return None
    settings = body.get("settings", {}) if isinstance(body, dict) else {}
    recorded = settings.get("tokenizer") if isinstance(settings, dict) else None
    return recorded if isinstance(recorded, str) and recorded else None


def load_trainable(
    spec: str,
    mesh,
    *,
    vocab_size: int,
    lora_rank: int,
    lora_alpha: float | None,
    seed: int,
    scratch: str | os.PathLike,
    **overrides,
):
    """:func:`load_model` for training: the model, with LoRA when ``lora_rank`` > 0
    (alpha defaults to 2 x rank), after checking that a tokenizer of ``vocab_size`` ids
    fits it. ``posttrain sft`` and ``posttrain grpo`` load their models this way.

    Raises:
      ValueError: as :func:`load_model`; the tokenizer has more ids than the model's
        ``vocab_size``.
    """
    model, _ = load_model(spec, mesh, seed=seed, scratch=scratch, **overrides)
    if vocab_size > model.config.vocab_size:
        raise ValueError(
            f"tokenizer has {vocab_size} ids but the model's vocab_size "
            f"is {model.config.vocab_size}; pass a matching --tokenizer"
        )
    if lora_rank:
        config = LoraConfig(rank=lora_rank, alpha=lora_alpha or 2.0 * lora_rank, seed=seed)
        model = apply_lora(model, mesh, config)
    return model
