"""pytest plugin of the harness: device source, markers, environment report, profiles, GC.

Loaded through the ``pytest11`` entry point ``posttrain_harness``, so before any
conftest or test module imports JAX. ``--devices`` is applied in
``pytest_load_initial_conftests`` (before conftests are imported) and again,
idempotently, in ``pytest_configure``; pytest-xdist workers load this plugin and
parse the same command line, so they set the same device count. Nothing here
imports JAX at module level; the hooks that need it import it after the device
source is set.

Markers:
    devices(n): needs at least n devices; skipped when fewer exist, failed under
        ``--strict-skips`` (the gate), where a silent skip would hide a test.
    tpu, gpu, accelerator: needs that real backend (several: any of them).
    slow: left out of the gate unless ``--slow``.
    reference: needs torch and transformers.
    contract(name): pins upstream symbol ``name``; recorded as the JUnit
        testcase property ``contract`` for the reports.
    convention(name): exercises Tunix train-step convention ``name`` (``installed``:
        the installed release's own trainer). ``--conventions a,b`` keeps the tests
        marked with one of them, and the unmarked ones when ``installed`` is among
        them: how the matrix runs a release row (``installed``) or an emulated one.

``--upstream-deprecations record`` (the matrix): a deprecation raised from upstream
code is recorded on its test instead of raised (:mod:`harness.deprecations`).

Garbage collection: after collection the objects alive (the imported JAX, Flax,
Tunix, torch: ~370k) are frozen out of the cyclic collector and full collections
are made 100x rarer (:func:`tune_gc`); at the end of the session the young
generations are collected and the heap is frozen (:func:`finish_gc`).
``POSTTRAIN_GC_TUNING=0`` keeps Python's defaults.
"""

from __future__ import annotations

import functools
import gc
import importlib.util
import os
from collections.abc import Sequence
from typing import Any

import pytest

from harness import deprecation_recorder
from harness import devices as _devices

MARKERS: tuple[str, ...] = (
    "devices(n): needs at least n JAX devices; skipped when fewer exist "
    "(a failure under --strict-skips)",
    "tpu: needs a real TPU backend",
    "gpu: needs a real GPU backend",
    "accelerator: needs a real accelerator backend (TPU or GPU)",
    "slow: slow test; the gate leaves it out unless --slow",
    "reference: needs torch and transformers (HF reference implementations)",
    "aot: compiles for a TPU slice through libtpu (the tpu extra); skipped where libtpu "
    "is not installed (a failure under --strict-skips)",
    "contract(name): pins the upstream symbol `name`; reports group results by it",
    "convention(name): exercises Tunix train-step convention `name` (see --conventions)",
)
# Backend markers -> the jax.default_backend() values they accept.
BACKEND_MARKERS: dict[str, tuple[str, ...]] = {
    "tpu": ("tpu",),
    "gpu": ("gpu",),
    "accelerator": ("tpu", "gpu"),
}
REFERENCE_MODULES: tuple[str, ...] = ("torch", "transformers")
GC_ENV_VAR = "POSTTRAIN_GC_TUNING"
PROFILE_EXAMPLES = {"ci": 20, "dev": 10, "thorough": 200}
"""hypothesis ``max_examples`` of each profile (``HYPOTHESIS_PROFILE``)."""
# Full (generation 2) collections after this many generation-1 ones (Python's default: 10).
GC_GEN2_THRESHOLD = 1000


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("posttrain-harness")
    group.addoption(
        "--devices",
        dest="posttrain_devices",
        metavar="N|real",
        default=None,
        help=f"N fake CPU devices, or 'real' for the real accelerators "
        f"(default: ${_devices.ENV_VAR} or {_devices.DEFAULT_DEVICES})",
    )
    group.addoption(
        "--strict-skips",
        dest="strict_skips",
        action="store_true",
        default=False,
        help="fail, instead of skipping, a test whose devices(n) marker asks for more "
        "devices than exist (the gate sets this)",
    )
    group.addoption(
        "--upstream-deprecations",
        dest="upstream_deprecations",
        choices=("error", "record"),
        default="error",
        help="'record': a deprecation raised from upstream code is shown, not raised, and "
        "recorded on the test as the JUnit property upstream_deprecations (the matrix's warn "
        "cells; harness/deprecations.py); 'error' (default): filterwarnings decides",
    )
    group.addoption(
        "--conventions",
        dest="conventions",
        metavar="NAME,...",
        default=None,
        help="keep only the tests marked convention(NAME) for these names, and the "
        "unmarked ones when 'installed' is among them (default: every test)",
    )
    group.addoption(
        "--contract",
        dest="contract",
        metavar="NAME",
        default=None,
        help="keep only the tests marked contract(NAME) (a matrix column; bisect runs one)",
    )


def _apply_devices(value: str | None) -> int:
    try:
        return _devices.configure_devices(value)
    except (ValueError, RuntimeError) as error:
        raise pytest.UsageError(f"posttrain-harness: {error}") from None


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(
    early_config: pytest.Config, parser: pytest.Parser, args: list[str]
) -> None:
    # Before conftests are imported: one that imports jax then sees the devices.
    _apply_devices(early_config.known_args_namespace.posttrain_devices)


@pytest.hookimpl(tryfirst=True)  # before hypothesis's plugin loads --hypothesis-profile
def pytest_configure(config: pytest.Config) -> None:
    _apply_devices(config.getoption("posttrain_devices"))
    for line in MARKERS:
        config.addinivalue_line("markers", line)
    _load_hypothesis_profile(config)
    if config.getoption("upstream_deprecations") == "record":
        config.pluginmanager.register(
            deprecation_recorder.Recorder(), "posttrain_upstream_deprecations"
        )


def _load_hypothesis_profile(config: pytest.Config) -> None:
    """Registers the ci/dev/thorough profiles and loads the one the environment names.

    ``HYPOTHESIS_PROFILE`` names it; otherwise ``ci`` when ``CI`` is set, else
    ``dev``. hypothesis's own ``--hypothesis-profile`` option wins over both.
    """
    try:
        from hypothesis import HealthCheck, settings
    except ImportError:  # the plugin works without hypothesis installed
        return
    # A new profile inherits from the loaded one; start from hypothesis's defaults,
    # not from the "ci" profile hypothesis itself loads when it detects CI.
    settings.load_profile("default")
    # deadline=None everywhere: XLA compile times are spiky, a deadline only flakes.
    settings.register_profile(
        "ci",
        derandomize=True,
        deadline=None,
        max_examples=PROFILE_EXAMPLES["ci"],
        print_blob=True,
        database=None,  # derandomized: a database would only replay the same examples
        suppress_health_check=[HealthCheck.too_slow],
    )
    settings.register_profile("dev", deadline=None, max_examples=PROFILE_EXAMPLES["dev"])
    settings.register_profile("thorough", deadline=None, max_examples=PROFILE_EXAMPLES["thorough"])
    if config.getoption("hypothesis_profile", None):
        return
    name = os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev")
    try:
        settings.load_profile(name)
    except Exception as error:  # hypothesis.errors.InvalidArgument for an unknown name
        raise pytest.UsageError(f"HYPOTHESIS_PROFILE={name!r}: {error}") from None


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


_gc_tuned = False


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    # After collection: the test modules have imported what the tests use. Once per
    # process: inner pytester sessions would each pay another full collection.
    global _gc_tuned
    if not _gc_tuned:
        _gc_tuned = tune_gc()


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


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    if _gc_tuned:
        finish_gc()


@functools.cache
def environment_facts() -> dict[str, str]:
    """Backend, device count and upstream versions of this process, as strings.

    Imports jax (after the device source is set); cached per process.
    """
    try:
        facts = _devices.device_facts()
        found = {"backend": str(facts["backend"]), "device_count": str(facts["device_count"])}
    except Exception as error:  # a broken jax install must still be reported, not crash
        found = {"backend": f"unavailable ({type(error).__name__}: {error})", "device_count": "0"}
    for name, version in _devices.package_versions().items():
        found[f"version.{name}"] = version
    return found


def pytest_report_header(config: pytest.Config) -> list[str]:
    facts = environment_facts()
    requested = os.environ.get(_devices.ENV_VAR, "?")
    strict = "on" if config.getoption("strict_skips") else "off"
    versions = ", ".join(f"{name} {facts[f'version.{name}']}" for name in _devices.DISTRIBUTIONS)
    return [
        f"posttrain-harness: backend {facts['backend']}, {facts['device_count']} devices "
        f"(--devices {requested}), strict skips {strict}",
        f"versions: {versions}",
    ]


def _junit_xml(config: pytest.Config) -> Any:
    """The junitxml plugin's report object, when this process writes one."""
    try:  # record_testsuite_property is a no-op under xdist; the stash key is not.
        from _pytest.junitxml import xml_key
    except ImportError:
        return None
    return config.stash.get(xml_key, None)


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    xml = _junit_xml(session.config)
    if xml is None:  # no --junitxml, or an xdist worker (the controller writes it)
        return
    xml.add_global_property("devices_option", os.environ.get(_devices.ENV_VAR, "?"))
    xml.add_global_property("strict_skips", str(session.config.getoption("strict_skips")))
    for name, value in environment_facts().items():
        xml.add_global_property(name, value)


def _marker_int(marker: pytest.Mark) -> int:
    args: Sequence[object] = marker.args
    if len(args) != 1 or marker.kwargs or type(args[0]) is not int or args[0] < 1:
        pytest.fail(f"devices marker takes one positive int, got {marker}", pytrace=False)
    return args[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    chosen = config.getoption("conventions")
    contract = config.getoption("contract")
    if chosen is None and contract is None:
        return
    names = {name.strip() for name in (chosen or "").split(",") if name.strip()}
    kept, dropped = [], []
    for item in items:
        marker = item.get_closest_marker("convention")
        if chosen is None:
            wanted = True
        else:
            wanted = "installed" in names if marker is None else _one_name(item, marker) in names
        if contract is not None:
            pinned = item.get_closest_marker("contract")
            wanted = wanted and pinned is not None and _contract_name(pinned) == contract
        (kept if wanted else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def _one_name(item: pytest.Item, marker: pytest.Mark) -> str:
    args: Sequence[object] = marker.args
    if len(args) != 1 or marker.kwargs or not isinstance(args[0], str) or not args[0]:
        raise pytest.UsageError(
            f"{item.nodeid}: {marker.name} marker takes one name, got {marker.args}"
        )
    return args[0]


def _contract_name(marker: pytest.Mark) -> str:
    args: Sequence[object] = marker.args
    if len(args) != 1 or marker.kwargs or not isinstance(args[0], str) or not args[0]:
        pytest.fail(f"contract marker takes one non-empty name, got {marker}", pytrace=False)
    return args[0]


@functools.cache
def _missing_reference_modules() -> tuple[str, ...]:
    # find_spec, not import: importing torch costs seconds and is the test's business.
    return tuple(name for name in REFERENCE_MODULES if importlib.util.find_spec(name) is None)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    contract = item.get_closest_marker("contract")
    if contract is not None:
        item.user_properties.append(("contract", _contract_name(contract)))

    wanted = [name for name in BACKEND_MARKERS if item.get_closest_marker(name) is not None]
    if wanted:
        backend = environment_facts()["backend"]
        if not any(backend in BACKEND_MARKERS[name] for name in wanted):
            pytest.skip(f"needs a real {' or '.join(wanted)} backend; running on {backend}")

    markers = list(item.iter_markers("devices"))
    if markers:
        needed = max(_marker_int(marker) for marker in markers)
        available = int(environment_facts()["device_count"])
        if available < needed:
            reason = f"needs {needed} devices, {available} available"
            if item.config.getoption("strict_skips"):
                pytest.fail(
                    f"{reason} (--strict-skips: a devices skip fails the gate; "
                    f"run with --devices {needed} or more)",
                    pytrace=False,
                )
            pytest.skip(f"{reason} (--devices {needed} runs it)")

    if item.get_closest_marker("reference") is not None and _missing_reference_modules():
        missing = ", ".join(_missing_reference_modules())
        pytest.skip(f"reference test needs torch and transformers; not importable: {missing}")

    if item.get_closest_marker("aot") is not None and importlib.util.find_spec("libtpu") is None:
        reason = "needs libtpu to compile for a TPU slice: install the tpu extra"
        if item.config.getoption("strict_skips"):
            pytest.fail(f"{reason} (--strict-skips: the gate runs the aot tests)", pytrace=False)
        pytest.skip(reason)
