"""Conversion throughput and peak memory on a generated multi-shard checkpoint.

Usage::

    PYTHONPATH=src python benchmarks/convert.py --dir /tmp/convbench \
        --layers 11 --d-model 1024 --moe-d-ff 3584 --experts 8 --shard-mb 500

Generates a bfloat16 Mixtral-shaped HF checkpoint in the hub layout (per-expert
tensors, several shards) from the table rows, then times, each in a fresh
process that reports its peak RSS (``ru_maxrss``) and the growth of its resident set
while the operation runs (sampled every 5 ms from ``/proc/self/statm``):

* ``baseline``: importing the package and planning (reading headers, tracing the
  abstract model), without converting: the Python/JAX floor (its time is planning only);
* ``copy``, ``copy_fsync``: ``shutil.copyfile`` of the same shards, without and with
  an ``fsync`` of each (the converter fsyncs its shards before the atomic rename);
* ``to_native`` (and ``to_native_nofsync``), ``to_native_scan`` (layers stacked),
  ``to_hf`` (back to the hub layout).

It prints MB/s against the copy, and peak RSS against the baseline and the
largest tensor (input and output side). Targets (issue 3): peak RSS below
2 x largest tensor + baseline; throughput within 3x of the copy.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import shutil
import subprocess
import sys
import threading
import time

import numpy as np


def _config(args):
    from posttrain.models import get_config

    cfg = get_config("mixtral-tiny")
    attn = cfg.attention["full"]
    import dataclasses

    return cfg.replace(
        vocab_size=32_000,
        d_model=args.d_model,
        num_layers=args.layers,
        layer_types=("full",) * args.layers,
        attention={
            "full": dataclasses.replace(
                attn, num_heads=16, num_kv_heads=4, head_dim=args.d_model // 16
            )
        },
        moe=dataclasses.replace(cfg.moe, num_experts=args.experts, moe_d_ff=args.moe_d_ff),
        dtype="bfloat16",
        param_dtype="bfloat16",
    )


def generate(args) -> None:
    from posttrain import conversion
    from posttrain.conversion import safetensors_io as sio

    cfg = _config(args)
    infos = {
        k: sio.OutputSpec(k, "BF16", tuple(v.shape))
        for k, v in conversion.abstract_params(cfg).items()
    }
    plan = conversion.plan_to_hf(conversion.NativeMeta(cfg), infos, layout="hub")
    src = pathlib.Path(args.dir) / "hf"
    src.mkdir(parents=True)
    writer = sio.CheckpointWriter(src, "model", plan.outputs, args.shard_mb << 20)
    rng = np.random.default_rng(0)
    for spec in plan.outputs:
        writer.write(
            spec.name,
            (0.02 * rng.standard_normal(spec.shape, np.float32)).astype(sio.DTYPES["BF16"]),
        )
    writer.finish()
    (src / "config.json").write_text(json.dumps(conversion.to_hf_config(cfg)))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _RssSampler(threading.Thread):
    """Highest resident set size seen every 5 ms while running (``ru_maxrss`` is a
    process-lifetime high-water mark, which the imports and planning may set)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.start_rss = self.peak = _rss()
        self.running = True

    def run(self):
        while self.running:
            self.peak = max(self.peak, _rss())
            time.sleep(0.005)


def phase(name: str, root: pathlib.Path) -> None:
    """One measured phase, in this (fresh) process; prints a JSON line. The clock starts
    after the imports (the same for every phase); ``baseline`` times planning alone."""
    from posttrain import conversion
    from posttrain.conversion import safetensors_io as sio

    src = root / "hf"
    sampler = _RssSampler()
    sampler.start()
    started = time.perf_counter()
    if name == "baseline":
        with sio.CheckpointReader(src) as reader:
            conversion.plan_to_native(json.loads((src / "config.json").read_text()), reader.tensors)
    elif name in ("copy", "copy_fsync"):
        (root / name).mkdir()
        for f in src.iterdir():
            shutil.copyfile(f, root / name / f.name)
            if name == "copy_fsync":  # the converter fsyncs each shard before its rename
                with open(root / name / f.name, "rb+") as out:
                    os.fsync(out.fileno())
    elif name in ("to_native", "to_native_nofsync"):
        conversion.convert_hf_to_native(
            src, root / name, max_shard_bytes=1 << 30, fsync=name == "to_native"
        )
    elif name == "to_native_scan":
        conversion.convert_hf_to_native(
            src, root / "native_scan", scan_layers=True, max_shard_bytes=1 << 30
        )
    elif name == "to_hf":
        conversion.convert_native_to_hf(
            root / "to_native", root / "back", max_shard_bytes=500 << 20
        )
    seconds = time.perf_counter() - started
    sampler.running = False
    sampler.join()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(
        json.dumps(
            {
                "phase": name,
                "seconds": seconds,
                "peak_rss": peak,
                "growth": sampler.peak - sampler.start_rss,
            }
        )
    )


def _largest(directory: pathlib.Path, stem: str) -> tuple[int, int, int]:
    from posttrain.conversion import safetensors_io as sio

    with sio.CheckpointReader(directory, stem) as reader:
        sizes = [i.nbytes for i in reader.tensors.values()]
    files = [f for f in directory.iterdir() if f.suffix == ".safetensors"]
    return max(sizes), sum(sizes), len(files)


PHASES = (
    "baseline",
    "copy",
    "copy_fsync",
    "to_native",
    "to_native_nofsync",
    "to_native_scan",
    "to_hf",
)


def _args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default="/tmp/convbench")
    parser.add_argument("--layers", type=int, default=11)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--moe-d-ff", type=int, default=3584)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--shard-mb", type=int, default=500)
    parser.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--keep", action="store_true", help="keep the generated files")
    return parser.parse_args()


def _report(results: dict, root: pathlib.Path, largest_in: int, total: int) -> None:
    """One line per phase: seconds, MB/s against copy + fsync, peak RSS, and the growth
    while converting as a multiple of the largest tensor read or written."""
    base = results["baseline"]["peak_rss"]
    out_largest = {
        "to_native": _largest(root / "to_native", "params")[0],
        "to_native_nofsync": _largest(root / "to_native", "params")[0],
        "to_native_scan": _largest(root / "native_scan", "params")[0],
    }
    copy_rate = total / results["copy_fsync"]["seconds"]
    for name, r in results.items():
        if name == "baseline":
            print(
                f"baseline (import + plan) {r['seconds']:.1f} s, peak RSS "
                f"{r['peak_rss'] / 1e6:.0f} MB"
            )
            continue
        rate = total / r["seconds"]
        big = max(out_largest.get(name, largest_in), largest_in)
        print(
            f"{name:17s} {r['seconds']:5.1f} s {rate / 1e6:5.0f} MB/s "
            f"({copy_rate / rate:3.1f}x copy+fsync time); peak RSS "
            f"{r['peak_rss'] / 1e6:4.0f} MB (baseline {base / 1e6:.0f}); growth while "
            f"converting {r['growth'] / 1e6:4.0f} MB = {r['growth'] / big:4.2f} x largest "
            f"tensor ({big / 1e6:.0f} MB)"
        )


def main() -> None:
    args = _args()
    root = pathlib.Path(args.dir)
    if args.phase:
        return phase(args.phase, root)
    if root.exists():
        sys.exit(f"{root} exists; remove it or give another --dir")
    t0 = time.perf_counter()
    generate(args)
    largest_in, total, shards = _largest(root / "hf", "model")
    print(
        f"generated {total / 1e9:.2f} GB in {shards} shards, largest tensor "
        f"{largest_in / 1e6:.1f} MB ({time.perf_counter() - t0:.0f} s)"
    )
    results = {}
    try:
        for name in PHASES:  # each in its own process: its peak RSS is its own
            out = subprocess.run(
                [sys.executable, __file__, "--dir", str(root), "--phase", name],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            results[name] = json.loads(out.strip().splitlines()[-1])
        _report(results, root, largest_in, total)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
