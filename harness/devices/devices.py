"""The JAX device source, set once before JAX starts, and the facts reports name.

Tests and tools run on ``N`` fake CPU devices (XLA's
``--xla_force_host_platform_device_count``) or on the real accelerators
(``real``), with the same code: only the device source differs. XLA reads the
flag when JAX creates its CPU backend, and JAX reads ``JAX_PLATFORMS`` when it is
imported, so :func:`configure_devices` must run before ``import jax``; it
refuses (``RuntimeError``) when it is too late to take effect.

Importing this module imports no JAX and changes no global state; only calling
:func:`configure_devices` changes the environment, and :func:`device_facts`
imports JAX.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import sys
from collections.abc import Mapping
from typing import Any

from harness.devices import compile_cache
from posttrain.xla_flags import jaxlib_version, with_collective_timeout

ENV_VAR = "POSTTRAIN_DEVICES"
DEFAULT_DEVICES = 8
REAL = "real"
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
# Runs on fake CPU devices are bound by XLA:CPU compile time (tiny models, hundreds of
# distinct programs). Two flags cut it without changing which HLO program runs:
# LLVM optimisation level 0 (the backend's LLVM passes dominate a compile) and the
# older elemental IR emitters instead of the MLIR fusion emitters. Measured on a
# remat + MoE test pair, compile cache off: 41.6 s default, 25.2 s with the first,
# 16.4 s with both; an 8-step SFT run gives the same losses, bit for bit. A third
# splits each program's LLVM module into one piece per core for the parallel codegen
# threads (XLA's default makes many more: perf showed llvm::SplitModule at 4.6% of a
# cold tests/test_models.py, and on 2 cores both pytest workers already hold a core).
# The gate on 2 cores, empty compilation cache / warm: default 281.2 s / 159.8 s, one
# piece 251.2 s / 178.6 s (a worker compiling alone cannot use the idle core), one per
# core 259.6 s / 148.8 s. A 6-step qwen3_moe-tiny LoRA SFT run gives the same losses
# and grad norms, bit for bit. All three flags are known to jaxlib 0.7.1-0.10.2 (every
# compat entry; `strings` of the 0.7.1 and 0.10.2 wheels); XLA aborts on a flag it
# does not know. The flags are part of JAX's compilation-cache key: a run after a change
# compiles everything once.
BACKEND_OPT_FLAG = "--xla_backend_optimization_level"
FUSION_EMITTERS_FLAG = "--xla_cpu_use_fusion_emitters"
CODEGEN_SPLIT_FLAG = "--xla_cpu_parallel_codegen_split_count"
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
FAST_CPU_COMPILE_FLAGS: tuple[tuple[str, str], ...] = (
    (BACKEND_OPT_FLAG, "0"),
    (FUSION_EMITTERS_FLAG, "false"),
    (CODEGEN_SPLIT_FLAG, str(CORES or 1)),
)
# The distributions whose versions every report names, in report order.
DISTRIBUTIONS: tuple[str, ...] = (
    "jax",
    "jaxlib",
    "flax",
    "optax",
    "orbax-checkpoint",
    "qwix",
    "google-tunix",
    "transformers",
    "torch",
)

_FLAG_TOKEN = re.compile(re.escape(DEVICE_COUNT_FLAG) + r"(?:=(?P<value>\S*))?")


def parse_device_count(value: int | str) -> int:
    """The device count a ``--devices`` / ``POSTTRAIN_DEVICES`` value names.

    Args:
        value: a positive integer (fake CPU devices), or ``"real"`` / ``0``
            (the real devices of whatever platform JAX finds).

    Returns:
        The count, ``0`` meaning real devices.

    Raises:
        ValueError: the value is neither a non-negative integer nor ``real``.
    """
    text = str(value).strip().lower()
    if text == REAL:
        return 0
    try:
        count = int(text)
    except ValueError:
        count = -1
    if count < 0:
        raise ValueError(f"device count {value!r} must be a positive integer or {REAL!r}")
    return count


def forced_device_count(xla_flags: str) -> int | None:
    """The value of the last device-count flag in ``xla_flags``; None if absent."""
    value = None
    for token in xla_flags.split():
        match = _FLAG_TOKEN.fullmatch(token)
        if match:
            value = match.group("value")
    try:
        return None if value is None else int(value)
    except ValueError:
        return None


def with_device_count(xla_flags: str, count: int) -> str:
    """``xla_flags`` with every device-count flag replaced by one naming ``count``."""
    kept = [token for token in xla_flags.split() if not _FLAG_TOKEN.fullmatch(token)]
    return " ".join([*kept, f"{DEVICE_COUNT_FLAG}={count}"])


def with_fast_cpu_compile(xla_flags: str) -> str:
    """``xla_flags`` plus each of :data:`FAST_CPU_COMPILE_FLAGS` that it does not name."""
    tokens = xla_flags.split()
    for flag, value in FAST_CPU_COMPILE_FLAGS:
        if not any(t == flag or t.startswith(flag + "=") for t in tokens):
            tokens.append(f"{flag}={value}")
    return " ".join(tokens)


def _effective_cpu_device_count(environ: Mapping[str, str]) -> int | None:
    """The fake CPU device count JAX would use; ``JAX_NUM_CPU_DEVICES`` wins over the flag."""
    jax_count = environ.get("JAX_NUM_CPU_DEVICES", "").strip()
    if jax_count.lstrip("-").isdigit() and int(jax_count) >= 0:
        return int(jax_count)
    return forced_device_count(environ.get("XLA_FLAGS", ""))


def configure_devices(count: int | str | None = None) -> int:
    """Sets the JAX device source for this process and its children; call before ``import jax``.

    A positive count ``N`` selects ``N`` fake CPU devices: ``JAX_PLATFORMS=cpu``
    (unless already set) and ``--xla_force_host_platform_device_count=N`` in
    ``XLA_FLAGS`` (replacing any earlier occurrence; ``JAX_NUM_CPU_DEVICES``,
    which JAX prefers over the flag, is rewritten too when present). ``real``
    (or ``0``) leaves the platform alone, for runs on real TPUs or GPUs.
    ``POSTTRAIN_DEVICES`` is set to the choice so subprocesses agree. Calling it
    again with the same count is a no-op.

    Fake devices also get :data:`FAST_CPU_COMPILE_FLAGS` (LLVM level 0, no MLIR
    fusion emitters, one LLVM module piece per core), each unless ``XLA_FLAGS``
    already sets it: tests and the matrix on fake devices spend most of their time
    compiling tiny programs, and the flags change how XLA:CPU emits machine code,
    not the HLO program. And where the installed jaxlib knows it, XLA:CPU's collective
    rendezvous lets a late device thread wait 10 minutes instead of aborting the process
    after 60 s (:mod:`posttrain.xla_flags`).
    Benchmarks do not call this function and keep XLA's defaults.

    Args:
        count: the device count, ``"real"``/``0``, or None for the environment
            variable ``POSTTRAIN_DEVICES`` (default 8).

    Returns:
        The number of fake CPU devices set, ``0`` for real devices.

    Raises:
        ValueError: the count is not a positive integer or ``real``.
        RuntimeError: JAX was imported before, with a different device count.
    """
    if count is None:
        count = os.environ.get(ENV_VAR, "").strip() or DEFAULT_DEVICES
    devices = parse_device_count(count)
    if devices == 0:
        os.environ[ENV_VAR] = REAL
        return 0
    if "jax" in sys.modules and _effective_cpu_device_count(os.environ) != devices:
        raise RuntimeError(
            f"JAX was imported before the harness could set {devices} devices "
            f"(XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}); load the harness first "
            "(pytest plugin, or harness.configure_devices before importing jax)"
        )
    flags = with_device_count(os.environ.get("XLA_FLAGS", ""), devices)
    flags = with_collective_timeout(with_fast_cpu_compile(flags), jaxlib_version())
    os.environ["XLA_FLAGS"] = flags
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if "JAX_NUM_CPU_DEVICES" in os.environ:
        os.environ["JAX_NUM_CPU_DEVICES"] = str(devices)
    os.environ[ENV_VAR] = str(devices)
    return devices


def device_facts() -> dict[str, Any]:
    """Backend, device count and devices of this process's JAX (imports jax).

    Call after :func:`configure_devices`: the first call starts JAX's backends.
    """
    import jax

    devices = jax.devices()
    return {
        "backend": jax.default_backend(),
        "device_count": len(devices),
        "devices": [f"{device!r} kind={device.device_kind!r}" for device in devices],
    }


def package_versions() -> dict[str, str]:
    """Installed version of each of :data:`DISTRIBUTIONS`, ``"absent"`` when missing.

    Reads package metadata only: nothing is imported (torch stays unloaded).
    """
    versions = {}
    for name in DISTRIBUTIONS:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "absent"
    return versions


def suite_env(cache_dir: str) -> dict[str, str]:
    """The environment of a pytest run of the suites (the gate's, a matrix entry's):
    this process's, JAX's persistent compilation cache in ``cache_dir``
    (:func:`harness.devices.compile_cache.env`) and bytecode caching on.

    ``PYTHONDONTWRITEBYTECODE`` is dropped: with it, pytest cannot keep the modules its
    assertion rewriting makes (test modules, and every package of a pytest plugin:
    hypothesis alone is ~2 s) and every process (each xdist worker, each subprocess
    test) rewrote them from source again: a pytest process on two trivial tests took
    4.2 s instead of 2.2 s. The caches are ``__pycache__`` folders (gitignored).
    """
    env = {**os.environ, **compile_cache.env(cache_dir)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env
