"""Checkpoint directories for the conversion tests, built from the table rows (no torch)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from posttrain import conversion, families
from posttrain.conversion import NativeMeta
from posttrain.conversion import safetensors_io as sio


def random_array(rng: np.random.Generator, shape, dtype: str) -> np.ndarray:
    return rng.standard_normal(shape, dtype=np.float32).astype(sio.DTYPES[dtype])


def hf_checkpoint(cfg, layout: str, seed: int, prefix: str = "model.") -> dict[str, np.ndarray]:
    """Random HF tensors named and shaped by the table rows for ``cfg`` in ``layout``."""
    infos = {
        k: sio.OutputSpec(k, sio.CODES[np.dtype(v.dtype)], tuple(v.shape))
        for k, v in conversion.abstract_params(cfg).items()
    }
    plan = conversion.plan_to_hf(NativeMeta(cfg), infos, layout=layout, prefix=prefix)
    rng = np.random.default_rng(seed)
    return {s.name: random_array(rng, s.shape, s.dtype) for s in plan.outputs}


def write_hf_dir(path, tensors, config, max_shard_bytes=sio.DEFAULT_SHARD_BYTES):
    path.mkdir()
    specs = [sio.OutputSpec(k, sio.CODES[v.dtype], v.shape) for k, v in sorted(tensors.items())]
    writer = sio.CheckpointWriter(path, "model", specs, max_shard_bytes)
    for spec in specs:
        writer.write(spec.name, tensors[spec.name])
    writer.finish()
    (path / "config.json").write_text(json.dumps(config))
    return path


def read_dir(path, stem="model") -> dict[str, np.ndarray]:
    with sio.CheckpointReader(path, stem) as reader:
        return {k: reader.read(k) for k in reader.tensors}


def assert_bit_identical(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert (a[key].dtype, a[key].shape) == (b[key].dtype, b[key].shape), key
        assert a[key].tobytes() == b[key].tobytes(), key


def patch_rows(monkeypatch, family: str, replace) -> None:
    """Registers ``family`` with each table row ``r`` replaced by ``replace(r)`` (for the
    test's duration); fails when no row changes."""
    fam = families.get(family)
    rows = tuple(replace(r) for r in fam.table.rows)
    assert rows != fam.table.rows
    table = dataclasses.replace(fam.table, rows=rows)
    registry = {**families.FAMILIES, family: dataclasses.replace(fam, table=table)}
    monkeypatch.setattr(families, "FAMILIES", registry)
