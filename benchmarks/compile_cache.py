"""A compile's cost with JAX's persistent compilation cache size-limited against without the
limit, in a cache that already holds ``--entries`` entries (``harness/devices/compile_cache.py``).

Usage::

    python benchmarks/compile_cache.py [--entries 4000] [--programs 40] [--repeats 2]

Each run is a fresh Python process on the CPU that compiles ``--programs`` small distinct
programs (``jax.jit`` of an elementwise function, one new constant each) into a copy of a
cache pre-filled with ``--entries`` entries of 4 KiB, each with the access-time file JAX's
limit keeps (the gate's cache held 4,037 entries on 2026-12-07). With
``JAX_COMPILATION_CACHE_MAX_SIZE`` set (2 GiB: nothing is evicted), JAX lists the cache and
reads every access-time file before each write; with ``-1`` it writes the entry alone. The
two settings take turns, ``--repeats`` runs each.

Printed: each setting's median milliseconds per compile (its JAX import excluded) and the
ratio without / with the limit.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

COMPILES = """
import sys, time
import jax, jax.numpy as jnp
x = jnp.ones(8)
jax.block_until_ready(x + 1)
start = time.perf_counter()
for i in range(int(sys.argv[1])):
    jax.block_until_ready(jax.jit(lambda v, c=float(i) + 0.5: v * c + c)(x))
print((time.perf_counter() - start) / int(sys.argv[1]))
"""


def fill(cache: Path, entries: int) -> None:
    """``entries`` fake ``<key>-cache`` files of 4 KiB, each with its ``<key>-atime`` file."""
    cache.mkdir(parents=True)
    for i in range(entries):
        (cache / f"jit_fake-{i:08x}-cache").write_bytes(b"\0" * 4096)
        (cache / f"jit_fake-{i:08x}-atime").write_bytes(i.to_bytes(8, "little"))


def one_run(template: Path, work: Path, max_size: str, programs: int) -> float:
    """Seconds per compile of a fresh process writing into a copy of ``template``."""
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(template, work)
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "JAX_COMPILATION_CACHE_DIR": str(work),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        "JAX_COMPILATION_CACHE_MAX_SIZE": max_size,
    }
    done = subprocess.run(
        [sys.executable, "-c", COMPILES, str(programs)], env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(f"compile run failed ({max_size}): {done.stderr.strip()[-500:]}")
    return float(done.stdout.split()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--entries", type=int, default=4000)
    parser.add_argument("--programs", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    for name in ("entries", "programs", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} {getattr(args, name)}: expected >= 1")
    settings = {"limit 2 GiB": str(2 * 1024**3), "no limit": "-1"}
    with tempfile.TemporaryDirectory() as tmp:
        template = Path(tmp) / "template"
        fill(template, args.entries)
        times: dict[str, list[float]] = {name: [] for name in settings}
        for _ in range(args.repeats):
            for name, max_size in settings.items():
                times[name].append(one_run(template, Path(tmp) / "work", max_size, args.programs))
    medians = {name: statistics.median(t) for name, t in times.items()}
    print(
        f"cache of {args.entries} entries, {args.programs} compiles a run, {args.repeats} runs each"
    )
    for name, seconds in medians.items():
        print(f"  {name:12s} {seconds * 1e3:8.1f} ms a compile")
    print(f"ratio no limit / limit: {medians['no limit'] / medians['limit 2 GiB']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
