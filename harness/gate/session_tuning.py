"""What the harness's pytest plugin tunes in a session: hypothesis profiles and GC.

Profiles (``HYPOTHESIS_PROFILE``, else :func:`default_profile`): ``ci``
(derandomized, no deadline: XLA compiles are spiky), ``dev``, ``thorough``, and
``chip``, the default on real devices. Garbage collection: :func:`tune_gc` after
collection, :func:`finish_gc` at the end of the session (``POSTTRAIN_GC_TUNING=0``
keeps Python's defaults). Nothing here runs on import.
"""

from __future__ import annotations

import gc
import os

import pytest

from harness.devices import devices

GC_ENV_VAR = "POSTTRAIN_GC_TUNING"
PROFILE_EXAMPLES = {"ci": 20, "dev": 10, "thorough": 200, "chip": 4}
"""hypothesis ``max_examples`` of each profile (``HYPOTHESIS_PROFILE``). ``chip``, the
default on real devices, where every example's compiles cost far more: on one v5e,
tests/test_moe.py's first property (8 examples under ``ci``) ran 250 s before it was
stopped, against 7.7 s for the whole file on 2 CPU cores (issue 54)."""
# Full (generation 2) collections after this many generation-1 ones (Python's default: 10).
GC_GEN2_THRESHOLD = 1000


def load_hypothesis_profile(config: pytest.Config) -> None:
    """Registers the ci/chip/dev/thorough profiles and loads the one the environment names.

    ``HYPOTHESIS_PROFILE`` names it; otherwise :func:`default_profile`. hypothesis's own
    ``--hypothesis-profile`` option wins over both (and may name ``chip``).
    """
    try:
        from hypothesis import HealthCheck, settings
    except ImportError:  # the plugin works without hypothesis installed
        return
    # A new profile inherits from the loaded one; start from hypothesis's defaults,
    # not from the "ci" profile hypothesis itself loads when it detects CI.
    settings.load_profile("default")
    # deadline=None everywhere: XLA compile times are spiky, a deadline only flakes.
    for derandomized in ("ci", "chip"):  # CI and real chips: the same examples each run
        settings.register_profile(
            derandomized,
            derandomize=True,
            deadline=None,
            max_examples=PROFILE_EXAMPLES[derandomized],
            print_blob=True,
            database=None,  # derandomized: a database would only replay the same examples
            suppress_health_check=[HealthCheck.too_slow],
        )
    settings.register_profile("dev", deadline=None, max_examples=PROFILE_EXAMPLES["dev"])
    settings.register_profile("thorough", deadline=None, max_examples=PROFILE_EXAMPLES["thorough"])
    if config.getoption("hypothesis_profile", None):  # --hypothesis-profile NAME: its choice
        return
    name = os.environ.get("HYPOTHESIS_PROFILE") or default_profile()
    try:
        settings.load_profile(name)
    except Exception as error:  # hypothesis.errors.InvalidArgument for an unknown name
        raise pytest.UsageError(f"HYPOTHESIS_PROFILE={name!r}: {error}") from None


def default_profile() -> str:
    """``chip`` on real devices, else ``ci`` when ``CI`` is set, else ``dev``."""
    if os.environ.get(devices.ENV_VAR, "").strip().lower() == devices.REAL:
        return "chip"
    return "ci" if os.environ.get("CI") else "dev"


def tune_gc() -> bool:
    """Collects the young generations, freezes the objects alive now and makes full
    collections 100x rarer.

    The suites keep every traced and lowered program alive in JAX's caches, so the
    heap grows to ~800k tracked objects and each full collection walks all of them
    (~0.5 s on this 2-core machine): 20 of them took 9 s of a 100 s single-process
    run (``gc.callbacks``), as long as the XLA compiles they sit next to. Frozen,
    the imports are never walked again; with ``GC_GEN2_THRESHOLD`` the same run
    makes 2 full collections (0.5 s) and peaks at 2.0 GB instead of 1.4 GB. Young
    cycles (generations 0 and 1) are collected as before.

    Returns whether it tuned (``POSTTRAIN_GC_TUNING=0``: nothing is changed).
    """
    if os.environ.get(GC_ENV_VAR, "1").strip() == "0":
        return False
    gc.collect(1)  # the young garbage; a full walk of the imports costs ~0.6 s a worker
    gc.freeze()
    gen0, gen1, _ = gc.get_threshold()
    gc.set_threshold(gen0, gen1, GC_GEN2_THRESHOLD)
    return True


def finish_gc() -> None:
    """At the end of a tuned session: the young generations collected, then the whole
    heap frozen.

    pytest >= 9 collects twice more after the session (``unraisableexception``: in
    ``pytest_unconfigure`` and its cleanup), each a full collection walking every object
    the tests left in JAX's caches (~1.5 s a worker here, at the end of the gate's wall
    time). Collected here, the young garbage's finalizers still run while pytest's
    unraisable hook records what they raise; frozen, pytest's own collections find
    nothing left to walk. Garbage already in the oldest generation is not finalized:
    with ``GC_GEN2_THRESHOLD`` the tests' full collections are rare anyway.
    """
    gc.collect(1)
    gc.freeze()
