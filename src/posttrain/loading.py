"""A model from what a user types: a preset name, a native directory or an HF checkpoint
directory (``posttrain sft --model`` and ``posttrain generate --model``)."""

from __future__ import annotations

import os
import pathlib
import tempfile


def load_model(spec: str, mesh, *, seed: int = 0, scratch: str | os.PathLike, **overrides):
    """``(model placed on mesh, HF directory or None)``.

    Args:
      spec: a preset (built with ``seed``), a native directory (``posttrain sft``'s
        ``model-step<N>``) or an HF checkpoint directory (converted into a temporary
        directory beside ``scratch`` first: a kill that skips the cleanup leaves it where
        the next run sweeps it, ``sweep_stale_temporaries``).
      mesh: the mesh to place the model on.
      overrides: native-only config fields (``scan_layers``, ``remat``).

    Raises:
      ValueError: ``spec`` is neither a preset nor a directory; the mesh does not divide
        the model; a conversion error (named).
    """
    from posttrain import sharding
    from posttrain.models import PRESETS, build_model, get_config

    if spec in PRESETS:
        return build_model(get_config(spec, **overrides), mesh, seed=seed), None
    if not os.path.isdir(spec):
        raise ValueError(
            f"--model {spec!r} is neither a preset ({', '.join(sorted(PRESETS))})"
            " nor a checkpoint directory (HF or native)"
        )
    from posttrain.conversion import convert_hf_to_native, load_native
    from posttrain.conversion.native import is_native_dir
    from posttrain.conversion.safetensors_io import temporary_prefix

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
