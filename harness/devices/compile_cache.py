"""JAX's persistent compilation cache for the suites: where it lives, what JAX is told,
and how it is kept under a size.

The gate, the matrix and ``tox -e tpu`` keep every compile in a directory that outlives
the run, so a second run reuses them. It stays under a size by :func:`prune`, once before
a run, least recently used entries first. JAX's own limit (``JAX_COMPILATION_CACHE_MAX_SIZE``,
``jax._src.lru_cache``) is left off (``-1``): before every write it lists the directory and
reads every entry's access-time file, so each new compile paid a scan of the whole cache:
0.19 s a write in a 4,037-entry cache on a 2-core machine, and a cold gate took 227 s
with the limit and 188 s without it (2026-12-07; ``benchmarks/compile_cache.py`` prints
the ratio, docs/testing.md the runs).

``python -m harness.devices.compile_cache DIR [--max-bytes N]`` prunes ``DIR`` (tox.ini's
chip environments run it before the suites).
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

MAX_BYTES = 2 * 1024**3  # one gate writes ~25 MB, the chip's tier ~250 MB
_ENTRY = "-cache"  # jax._src.lru_cache's suffixes: <key>-cache, and with its limit <key>-atime
_ATIME = "-atime"


def env(cache: str) -> dict[str, str]:
    """Environment for a pytest run: JAX's persistent compilation cache in ``cache``,
    pruned to :data:`MAX_BYTES` first (:func:`prune`). ``off``: nothing is set.

    Every compile of at least 10 ms is stored (XLA:CPU compiles dominate the gate and
    the matrix); JAX keys entries by program, backend and version, so one directory may
    serve several JAX versions. The eager ops' small programs count: with 0.2 s the warm
    gate took 155 s, with 10 ms 128 s (2026-12-04, the same checkout and machine).
    ``JAX_COMPILATION_CACHE_MAX_SIZE`` is ``-1`` also where the caller's environment
    set another: JAX's limit scans the cache before every write (module docstring).
    """
    if cache == "off":
        return {}
    directory = Path(cache)
    directory.mkdir(parents=True, exist_ok=True)
    prune(directory)
    return {
        "JAX_COMPILATION_CACHE_DIR": str(directory.resolve()),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.01",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        "JAX_COMPILATION_CACHE_MAX_SIZE": "-1",
    }


def last_use_ns(entry: Path) -> int:
    """When ``entry`` (a ``<key>-cache`` file) was last written or read, in ns: the latest
    of its modification time, its access time (the kernel's, at ``relatime``'s day-sized
    steps) and the time in its ``<key>-atime`` file where JAX's own limit wrote one."""
    stat = entry.stat()
    latest = max(stat.st_mtime_ns, stat.st_atime_ns)
    atime = entry.with_name(entry.name.removesuffix(_ENTRY) + _ATIME)
    with contextlib.suppress(OSError):
        latest = max(latest, int.from_bytes(atime.read_bytes()[:8], "little"))
    return latest


def prune(cache: Path, max_bytes: int = MAX_BYTES) -> list[Path]:
    """Removes the least recently used entries of ``cache`` (:func:`last_use_ns`) until
    the rest total at most ``max_bytes``, then every ``-atime`` file whose entry is gone.
    Other files are left alone. An entry that another process removes meanwhile (or a
    dangling link) is skipped.

    Returns:
        The entries removed, least recently used first.

    Raises:
        ValueError: ``max_bytes`` < 0.
    """
    if max_bytes < 0:
        raise ValueError(f"max_bytes={max_bytes}: expected >= 0")
    entries = []
    for entry in cache.glob(f"*{_ENTRY}"):  # ordered below, by last use
        try:
            entries.append((last_use_ns(entry), entry.stat().st_size, entry))
        except FileNotFoundError:
            continue
    total = sum(size for _, size, _ in entries)
    removed = []
    for _, size, entry in sorted(entries):
        if total <= max_bytes:
            break
        entry.unlink(missing_ok=True)
        total -= size
        removed.append(entry)
    for atime in cache.glob(f"*{_ATIME}"):
        if not atime.with_name(atime.name.removesuffix(_ATIME) + _ENTRY).exists():
            atime.unlink(missing_ok=True)
    return removed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m harness.devices.compile_cache",
        description="Prune JAX's persistent compilation cache to a size, least recently "
        "used first.",
        allow_abbrev=False,
    )
    parser.add_argument("directory", type=Path)
    parser.add_argument("--max-bytes", type=int, default=MAX_BYTES, help="default: %(default)s")
    args = parser.parse_args(argv)
    if args.max_bytes < 0:
        parser.error(f"--max-bytes {args.max_bytes}: expected >= 0")
    if not args.directory.is_dir():
        print(f"compile cache {args.directory}: nothing to prune (no such directory)")
        return 0
    removed = prune(args.directory, args.max_bytes)
    print(f"compile cache {args.directory}: removed {len(removed)} least recently used entries")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
