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
    host: exercises host code only (CLI parsing, reports, git, local processes); left
        out, and counted, on a real accelerator (``--devices real`` on a TPU or GPU),
        whose tier is for what the chip computes (``--host-tests run`` keeps them).
    wiring: a value reaching where it acts, which no chip's arithmetic changes; left out
        there as host is. chip_sample(id, ...): a real accelerator runs only the named
        variants (``--chip-variants all`` runs every one). :mod:`harness.gate.chip_tier`.
    matmul_precision(name): the test (and its fixtures) run under
        ``jax.default_matmul_precision(name)``; ``--emulate-chip-precision`` finds the
        comparisons that need it (:mod:`harness.gate.chip_precision`).
    contract(name): pins upstream symbol ``name``; recorded as the JUnit
        testcase property ``contract`` for the reports.
    convention(name): exercises Tunix train-step convention ``name`` (``installed``:
        the installed release's own trainer). ``--conventions a,b`` keeps the tests
        marked with one of them, and the unmarked ones when ``installed`` is among
        them: how the matrix runs a release row (``installed``) or an emulated one.

Real devices (``--devices real``): a backend that does not come up fails the session
(never a run that skips everything), ``--require-backend tpu`` fails it on any other
backend, and hypothesis loads the ``chip`` profile (each compile costs a chip far more
than the CPU: the properties are explored on the CPU, sampled on the chip).

``--compile-report PATH``: per test, its tracing, lowering and XLA compile seconds, as JSON
lines (:mod:`harness.gate.compile_report`; one process, not with ``-n``).

``--upstream-deprecations record`` (the matrix): a deprecation raised from upstream
code is recorded on its test instead of raised (:mod:`harness.gate.deprecations`).

Hypothesis profiles and garbage collection: :mod:`harness.gate.session_tuning`; the
options and the markers' descriptions: :mod:`harness.gate.plugin_options`.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Sequence
from typing import Any

import pytest

from harness.devices import devices as _devices
from harness.gate import (
    chip_precision,
    chip_tier,
    compile_report,
    deprecation_recorder,
    plugin_options,
    session_tuning,
)
from harness.gate.session_tuning import (  # noqa: F401 (re-exported: tests and tools read them here)
    GC_ENV_VAR,
    GC_GEN2_THRESHOLD,
    PROFILE_EXAMPLES,
    finish_gc,
    tune_gc,
)

# Backend markers -> the jax.default_backend() values they accept.
BACKEND_MARKERS: dict[str, tuple[str, ...]] = {
    "tpu": ("tpu",),
    "gpu": ("gpu",),
    "accelerator": ("tpu", "gpu"),
}
REFERENCE_MODULES: tuple[str, ...] = ("torch", "transformers")


def pytest_addoption(parser: pytest.Parser) -> None:
    plugin_options.add_options(parser)


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
    for line in plugin_options.MARKERS:
        config.addinivalue_line("markers", line)
    session_tuning.load_hypothesis_profile(config)
    config.pluginmanager.register(chip_precision.Pinning(), "posttrain_matmul_precision")
    if config.getoption("emulate_chip_precision"):
        import jax  # noqa: F401 (the device source is set: JAX may start)

        config.add_cleanup(chip_precision.emulate())
    _register_compile_report(config)
    if config.getoption("upstream_deprecations") == "record":
        config.pluginmanager.register(
            deprecation_recorder.Recorder(), "posttrain_upstream_deprecations"
        )


def _register_compile_report(config: pytest.Config) -> None:
    """``--compile-report PATH [--resume]``: :class:`~harness.gate.compile_report.CompileReport`,
    in a run of one process (xdist's workers would each truncate PATH, and its controller
    runs no test)."""
    path = config.getoption("compile_report")
    resume = config.getoption("resume")
    if path is None:
        if resume:
            raise pytest.UsageError("--resume: needs --compile-report PATH, the run to continue")
        return
    if hasattr(config, "workerinput") or config.getoption("numprocesses", default=None):
        raise pytest.UsageError(
            f"--compile-report {path}: needs a run of one process, without -n (xdist)"
        )
    try:
        report = compile_report.CompileReport(path, resume=resume)
    except OSError as error:
        raise pytest.UsageError(
            f"--compile-report {path}: cannot be written ({error.strerror})"
        ) from None
    except ValueError as error:  # --resume on a file that is no report
        raise pytest.UsageError(f"--compile-report {path} --resume: {error}") from None
    config.pluginmanager.register(report, "posttrain_compile_report")


_gc_tuned = False


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    # After collection: the test modules have imported what the tests use. Once per
    # process: inner pytester sessions would each pay another full collection.
    global _gc_tuned
    if not _gc_tuned:
        _gc_tuned = tune_gc()


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


def backend_problem(config: pytest.Config, facts: dict[str, str]) -> str | None:
    """Why the session must not run on the backend that came up; ``None`` when it may.

    On real devices a backend that did not start is an error, not a run that skips
    every test; ``--require-backend NAME`` refuses any other backend.
    """
    backend = facts["backend"]
    wanted = config.getoption("require_backend")
    real = os.environ.get(_devices.ENV_VAR, "").strip().lower() == _devices.REAL
    if backend.startswith("unavailable") and (real or wanted):
        return f"posttrain-harness: the JAX backend did not come up: {backend}"
    if wanted and backend != wanted:
        return (
            f"posttrain-harness: --require-backend {wanted}, but JAX's backend is {backend} "
            f"({facts['device_count']} devices)"
        )
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    problem = backend_problem(session.config, environment_facts())
    if problem:
        pytest.exit(problem, returncode=pytest.ExitCode.USAGE_ERROR)
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


_LEFT_OUT = pytest.StashKey[dict[str, int]]()


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    """A module whose ``chip_sample`` marker names no variant of its test fails to collect
    (:func:`harness.gate.chip_tier.unknown_samples`), on every backend."""
    report = yield
    # a module's or class's own items: every variant, before a node id or -k narrows them
    # (the session's report holds only the ones a node id named)
    if report.passed and isinstance(collector, (pytest.Module, pytest.Class)):
        problem = chip_tier.unknown_samples(report.result)
        if problem is not None:
            return pytest.CollectReport(report.nodeid, "failed", problem, [])
    return report


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if _LEFT_OUT in config.stash:
        backend = environment_facts()["backend"]
        for line in chip_tier.summary_lines(config.stash[_LEFT_OUT], backend):
            terminalreporter.write_line(line)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    left_out = chip_tier.select(config, items, environment_facts()["backend"])
    if left_out:
        config.stash[_LEFT_OUT] = left_out
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
    _check_markers(item)


def _check_markers(item: pytest.Item) -> None:
    """Records the contract; skips (or fails, under ``--strict-skips``) what the markers
    say this session cannot run."""
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
