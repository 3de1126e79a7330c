"""Tests of the harness: device setup, the pytest plugin and the gate."""

from __future__ import annotations

import gc
import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
import types
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from harness.devices.devices import (
    BACKEND_OPT_FLAG,
    CODEGEN_SPLIT_FLAG,
    CORES,
    DEVICE_COUNT_FLAG,
    FUSION_EMITTERS_FLAG,
    configure_devices,
    forced_device_count,
    suite_env,
)
from harness.gate import gate, pytest_plugin, session_tuning
from posttrain import atomic
from posttrain.xla_flags import COLLECTIVE_TIMEOUT_FLAG

pytestmark = pytest.mark.host

DEVICE_ENV = ("XLA_FLAGS", "JAX_PLATFORMS", "JAX_NUM_CPU_DEVICES", "POSTTRAIN_DEVICES")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No device variables and no jax in sys.modules (both restored afterwards)."""
    for name in DEVICE_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delitem(sys.modules, "jax", raising=False)
    return monkeypatch


def _subprocess_env(**extra: str) -> dict[str, str]:
    """This environment without the outer pytest/xdist run's variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HYPOTHESIS_"))}
    return {**env, **extra}


# --- configure_devices --------------------------------------------------------------


LATE_DEVICE = """
import sys, time
from harness import configure_devices
configure_devices(8)
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P

def late(i):  # device 0's thread reaches the all-gather 65 s after the others
    if int(i[0]) == 0:
        time.sleep(65)
    return np.ones((1,), np.float32)

def body(i):
    y = jax.pure_callback(late, jax.ShapeDtypeStruct((1,), jnp.float32), i)
    return jax.lax.all_gather(y, "d", tiled=True)

mesh = Mesh(np.array(jax.devices()), ("d",))
step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P(), check_vma=False))
print(int(step(jnp.arange(8)).sum()))
"""


@pytest.mark.slow  # 65 s of a sleeping thread
def test_a_fake_device_65_s_late_to_a_collective_does_not_abort_the_process() -> None:
    """XLA:CPU's rendezvous aborts a process whose device thread is 60 s late (SIGABRT
    without configure_devices' timeout, measured): a busy 2-core machine is no hang."""
    env = {k: v for k, v in _subprocess_env().items() if k not in DEVICE_ENV}
    done = subprocess.run(
        [sys.executable, "-c", LATE_DEVICE], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "8"


def test_the_installed_xla_takes_the_collective_timeout() -> None:
    """A process on 4 fake devices with configure_devices' flags runs a collective (XLA
    aborts at start on a flag it does not know: the version gate is right here)."""
    code = (
        "from harness import configure_devices; configure_devices(4); import os, jax, "
        "jax.numpy as jnp; print(os.environ['XLA_FLAGS'].split()[-1]); "
        "print(int(jax.pmap(lambda x: jax.lax.psum(x, 'd'), 'd')(jnp.ones(4))[0]))"
    )
    env = {k: v for k, v in _subprocess_env().items() if k not in DEVICE_ENV}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [f"{COLLECTIVE_TIMEOUT_FLAG}=600", "4"]


def test_count_selects_cpu_and_sets_the_flag(clean_env: pytest.MonkeyPatch) -> None:
    """A positive count sets JAX_PLATFORMS=cpu, the XLA flags and POSTTRAIN_DEVICES."""
    assert configure_devices(4) == 4
    assert os.environ["XLA_FLAGS"] == (
        f"{DEVICE_COUNT_FLAG}=4 {BACKEND_OPT_FLAG}=0 {FUSION_EMITTERS_FLAG}=false "
        f"{CODEGEN_SPLIT_FLAG}={CORES} {COLLECTIVE_TIMEOUT_FLAG}=600"
    )  # the installed jaxlib (0.10.2) knows the timeout flag
    assert os.environ["JAX_PLATFORMS"] == "cpu"
    assert os.environ["POSTTRAIN_DEVICES"] == "4"


def test_existing_flag_is_replaced_and_other_flags_kept(clean_env: pytest.MonkeyPatch) -> None:
    """Every earlier device-count flag is replaced by one; other XLA flags survive."""
    clean_env.setenv(
        "XLA_FLAGS",
        f"--xla_cpu_a=1 {DEVICE_COUNT_FLAG}=2 --xla_b {DEVICE_COUNT_FLAG}=3",
    )
    configure_devices("16")
    tokens = os.environ["XLA_FLAGS"].split()
    assert tokens.count(f"{DEVICE_COUNT_FLAG}=16") == 1
    assert [t for t in tokens if t.startswith(DEVICE_COUNT_FLAG)] == [f"{DEVICE_COUNT_FLAG}=16"]
    assert {"--xla_cpu_a=1", "--xla_b"} <= set(tokens)


@pytest.mark.parametrize(
    "given",
    [
        f"{BACKEND_OPT_FLAG}=2",
        BACKEND_OPT_FLAG,
        f"{FUSION_EMITTERS_FLAG}=true",
        f"{CODEGEN_SPLIT_FLAG}=64",
    ],
)
def test_a_chosen_compile_flag_is_kept(clean_env: pytest.MonkeyPatch, given: str) -> None:
    """Fake devices get the fast-compile flags, except one XLA_FLAGS already sets."""
    clean_env.setenv("XLA_FLAGS", given)
    configure_devices(2)
    tokens = os.environ["XLA_FLAGS"].split()
    flag = given.split("=")[0]
    assert [t for t in tokens if t.split("=")[0] == flag] == [given]
    others = {BACKEND_OPT_FLAG: "0", FUSION_EMITTERS_FLAG: "false", CODEGEN_SPLIT_FLAG: str(CORES)}
    del others[flag]
    assert [f"{f}={v}" for f, v in others.items()] == [
        t for t in tokens if t.split("=")[0] in others
    ]


def test_env_var_then_default_eight(clean_env: pytest.MonkeyPatch) -> None:
    """Without an argument the count comes from POSTTRAIN_DEVICES, else 8."""
    assert configure_devices() == 8
    assert forced_device_count(os.environ["XLA_FLAGS"]) == 8
    clean_env.setenv("POSTTRAIN_DEVICES", "3")
    assert configure_devices() == 3
    assert forced_device_count(os.environ["XLA_FLAGS"]) == 3


def test_existing_platform_and_jax_num_cpu_devices(clean_env: pytest.MonkeyPatch) -> None:
    """JAX_PLATFORMS already set is kept; JAX_NUM_CPU_DEVICES (which wins in JAX) is rewritten."""
    clean_env.setenv("JAX_PLATFORMS", "cpu,tpu")
    clean_env.setenv("JAX_NUM_CPU_DEVICES", "2")
    configure_devices(5)
    assert os.environ["JAX_PLATFORMS"] == "cpu,tpu"
    assert os.environ["JAX_NUM_CPU_DEVICES"] == "5"


@pytest.mark.parametrize("value", ["real", " REAL ", 0, "0"])
def test_real_leaves_the_platform_alone(clean_env: pytest.MonkeyPatch, value: object) -> None:
    """'real' (or 0) returns 0 and touches neither XLA_FLAGS nor JAX_PLATFORMS."""
    clean_env.setenv("XLA_FLAGS", "--xla_other=1")
    assert configure_devices(value) == 0  # type: ignore[arg-type]
    assert os.environ["XLA_FLAGS"] == "--xla_other=1"
    assert "JAX_PLATFORMS" not in os.environ
    assert os.environ["POSTTRAIN_DEVICES"] == "real"


@pytest.mark.parametrize("value", ["-1", "eight", "2.5", ""])
def test_invalid_count_is_rejected(clean_env: pytest.MonkeyPatch, value: str) -> None:
    """A count that is neither a non-negative integer nor 'real' raises ValueError."""
    with pytest.raises(ValueError, match="must be a positive integer or 'real'"):
        configure_devices(value)


def test_jax_imported_with_another_count_raises(clean_env: pytest.MonkeyPatch) -> None:
    """Too late to take effect: RuntimeError names the count; the environment is unchanged."""
    clean_env.setitem(sys.modules, "jax", types.ModuleType("jax"))
    clean_env.setenv("XLA_FLAGS", f"{DEVICE_COUNT_FLAG}=4")
    with pytest.raises(RuntimeError, match="JAX was imported before the harness could set 8"):
        configure_devices(8)
    assert os.environ["XLA_FLAGS"] == f"{DEVICE_COUNT_FLAG}=4"
    assert "JAX_PLATFORMS" not in os.environ
    clean_env.delenv("XLA_FLAGS")
    with pytest.raises(RuntimeError, match="could set 2 devices"):
        configure_devices(2)  # no flag at all: JAX got its default single device


def test_jax_imported_with_the_same_count_is_a_no_op(clean_env: pytest.MonkeyPatch) -> None:
    """Configuring again with the count JAX already has succeeds (pytest calls it twice)."""
    clean_env.setitem(sys.modules, "jax", types.ModuleType("jax"))
    clean_env.setenv("XLA_FLAGS", f"{DEVICE_COUNT_FLAG}=8")
    assert configure_devices(8) == 8
    assert configure_devices("real") == 0


def test_importing_the_harness_changes_nothing() -> None:
    """Importing every harness module imports no jax and leaves the environment alone."""
    code = (
        "import os, sys; before = dict(os.environ)\n"
        "import harness, harness.devices.devices, harness.gate.pytest_plugin, harness.cli\n"
        "print('jax' in sys.modules, dict(os.environ) == before)\n"
    )
    env = _subprocess_env()
    for name in DEVICE_ENV:
        env.pop(name, None)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["False", "True"]


# --- the pytest plugin ----------------------------------------------------------------


def test_report_header_names_device_count_and_versions(request: pytest.FixtureRequest) -> None:
    """The header names the backend, JAX's device count and the installed jax version."""
    import jax

    lines = pytest_plugin.pytest_report_header(request.config)
    assert 1 <= len(lines) <= 2
    assert f"backend {jax.default_backend()}, {jax.device_count()} devices" in lines[0]
    assert f"jax {importlib.metadata.version('jax')}," in lines[1]
    assert "torch " in lines[1]  # named even when absent, without importing it


MARKED_TESTS = """
    import pytest

    def test_plain():
        pass

    @pytest.mark.devices(10_000)
    def test_needs_many_devices():
        pass

    @pytest.mark.devices(1)
    def test_needs_one_device():
        pass

    @pytest.mark.tpu
    def test_tpu_only():
        pass

    @pytest.mark.accelerator
    def test_any_accelerator():
        pass

    @pytest.mark.reference
    def test_reference():
        pass

    @pytest.mark.contract("tunix.sft.peft_trainer.PeftTrainer.train_step")
    def test_contract():
        pass
"""


def _device_count() -> int:
    import jax

    return jax.device_count()


def _backend() -> str:
    import jax

    return jax.default_backend()


def test_markers_skip_with_reasons(jax_started, pytester: pytest.Pytester, monkeypatch) -> None:
    """devices/tpu/accelerator/reference skip with reasons naming what is missing."""
    monkeypatch.setattr(pytest_plugin, "_missing_reference_modules", lambda: ("torch",))
    backend = _backend()
    backend_skips = [
        name
        for name, accepted in (("tpu", ("tpu",)), ("accelerator", ("tpu", "gpu")))
        if backend not in accepted
    ]
    pytester.makepyfile(MARKED_TESTS)
    result = pytester.runpytest("-rs", "--strict-markers")
    result.assert_outcomes(passed=5 - len(backend_skips), skipped=2 + len(backend_skips))
    result.stdout.fnmatch_lines_random(
        [
            f"*needs 10000 devices, {_device_count()} available*",
            "*needs torch and transformers; not importable: torch*",
            *(f"*needs a real {name} backend; running on {backend}*" for name in backend_skips),
        ]
    )


HOST_AND_DEVICE_TESTS = """
import pytest

@pytest.mark.host
def test_parses_a_flag():
    pass

def test_computes():
    pass
"""


@pytest.mark.parametrize(
    ("option", "left_out"), [("skip", 1), ("run", 0), ("auto", 0)], ids=["skip", "run", "auto-cpu"]
)
def test_host_tests_are_left_out_and_counted(
    jax_started, pytester: pytest.Pytester, option, left_out
) -> None:
    """--host-tests skip leaves out the tests marked host and says how many and why; run
    keeps them; auto keeps them on the CPU (it leaves them out on a TPU or GPU)."""
    pytester.makepyfile(HOST_AND_DEVICE_TESTS)
    result = pytester.runpytest("--host-tests", option, "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2 - left_out, deselected=left_out)
    line = f"*left out {left_out} tests marked host on {_backend()}: host code only*"
    if left_out:
        result.stdout.fnmatch_lines([line])
    else:
        result.stdout.no_fnmatch_line("*tests marked host*")


def test_a_backend_other_than_the_required_one_fails_the_session(
    jax_started, pytester: pytest.Pytester
) -> None:
    """--require-backend tpu on this CPU: the session stops before any test, exit 4, with
    one line naming both backends; never a green run of skips."""
    pytester.makepyfile(HOST_AND_DEVICE_TESTS)
    result = pytester.runpytest("--require-backend", "tpu", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    out = result.stdout.str() + result.stderr.str()
    assert f"--require-backend tpu, but JAX's backend is {_backend()}" in out
    assert "passed" not in out and "test_computes" not in out


@pytest.mark.parametrize(
    ("devices", "wanted", "problem"),
    [
        ("real", None, "did not come up"),
        ("8", "tpu", "did not come up"),
        ("8", None, None),
    ],
    ids=["real", "required", "fake-devices"],
)
def test_a_backend_that_did_not_come_up_fails_on_real_devices(
    monkeypatch, devices, wanted, problem
) -> None:
    """On real devices (or with a backend required) a backend that failed to start is an
    error; on fake devices the report says so and the tests decide."""
    monkeypatch.setenv("POSTTRAIN_DEVICES", devices)
    config = types.SimpleNamespace(getoption=lambda name: wanted)
    facts = {"backend": "unavailable (RuntimeError: no TPU)", "device_count": "0"}
    found = pytest_plugin.backend_problem(config, facts)
    assert (found is None) if problem is None else (problem in found and "no TPU" in found)


def test_strict_skips_turn_a_devices_skip_into_a_failure(
    jax_started, pytester: pytest.Pytester
) -> None:
    """Under --strict-skips the devices skip fails (in setup: an error); backend skips stay."""
    pytester.makepyfile(MARKED_TESTS)
    result = pytester.runpytest("--strict-skips", "-p", "no:cacheprovider")
    outcomes = result.parseoutcomes()
    assert outcomes["errors"] == 1
    # Only the devices skip fails: backend and reference skips stay skips.
    assert outcomes.get("passed", 0) + outcomes.get("skipped", 0) == 6
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "*ERROR at setup of test_needs_many_devices*",
            f"needs 10000 devices, {_device_count()} available (--strict-skips*",
        ]
    )


def test_invalid_marker_arguments_fail(jax_started, pytester: pytest.Pytester) -> None:
    """A devices marker without a positive int, or a contract without a name, fails the test."""
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.devices("8")
        def test_bad_devices():
            pass

        @pytest.mark.contract()
        def test_bad_contract():
            pass
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(errors=2)
    result.stdout.fnmatch_lines_random(
        ["*devices marker takes one positive int*", "*contract marker takes one non-empty name*"]
    )


CONVENTION_TESTS = """
import pytest

@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.convention(n)) for n in ("installed", "bound2")]
)
def test_by_convention(name):
    pass

@pytest.mark.convention("bound3_update")
def test_main_only():
    pass

def test_any_release():
    pass
"""


@pytest.mark.parametrize(
    ("chosen", "kept"),
    [
        (
            None,
            {
                "test_by_convention[installed]",
                "test_by_convention[bound2]",
                "test_main_only",
                "test_any_release",
            },
        ),
        ("installed", {"test_by_convention[installed]", "test_any_release"}),
        ("bound2", {"test_by_convention[bound2]"}),
        ("bound2,bound3_update", {"test_by_convention[bound2]", "test_main_only"}),
    ],
    ids=["all", "release-row", "emulated-row", "two"],
)
def test_conventions_option_keeps_a_rows_tests(jax_started, pytester, chosen, kept) -> None:
    """--conventions keeps the tests marked with a chosen convention, and the unmarked
    ones for 'installed' (a release row); the matrix selects each row's tests by it."""
    pytester.makepyfile(CONVENTION_TESTS)
    args = ["-p", "no:cacheprovider", "-v", "--strict-markers"]
    result = pytester.runpytest(*args, *(["--conventions", chosen] if chosen else []))
    ran = {line.split("::")[1].split(" ")[0] for line in result.outlines if " PASSED" in line}
    assert ran == kept
    assert result.ret == pytest.ExitCode.OK


CONTRACT_TESTS = """
import pytest

@pytest.mark.contract("tunix.a")
@pytest.mark.convention("bound2")
def test_a_emulated():
    pass

@pytest.mark.contract("tunix.a")
def test_a():
    pass

@pytest.mark.contract("tunix.b")
def test_b():
    pass

def test_unpinned():
    pass
"""


@pytest.mark.parametrize(
    ("options", "kept"),
    [
        (["--contract", "tunix.a"], {"test_a_emulated", "test_a"}),
        (["--contract", "tunix.a", "--conventions", "installed"], {"test_a"}),
        (["--contract", "tunix.c"], set()),
    ],
    ids=["one-contract", "with-conventions", "unknown"],
)
def test_contract_option_keeps_one_matrix_column(jax_started, pytester, options, kept) -> None:
    """--contract NAME keeps the tests marked contract(NAME), whatever their convention
    unless --conventions also selects (how bisect runs one column)."""
    pytester.makepyfile(CONTRACT_TESTS)
    result = pytester.runpytest("-p", "no:cacheprovider", "-v", "--strict-markers", *options)
    ran = {line.split("::")[1].split(" ")[0] for line in result.outlines if " PASSED" in line}
    assert ran == kept


def test_a_convention_marker_without_one_name_is_a_usage_error(jax_started, pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.convention("a", "b")
        def test_bad_convention():
            pass
        """
    )
    result = pytester.runpytest("--conventions", "a")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*test_bad_convention: convention marker takes one name*"])


def test_junit_has_environment_and_contract_properties(
    jax_started, pytester: pytest.Pytester
) -> None:
    """The JUnit report carries backend, device count and versions, and each contract name."""
    pytester.makepyfile(MARKED_TESTS)
    pytester.runpytest("--junitxml=out.xml")
    root = ET.parse(pytester.path / "out.xml").getroot()
    props = {p.get("name"): p.get("value") for p in root.iter("property")}
    assert props["device_count"] == str(_device_count())
    assert props["backend"] == _backend()
    assert props["version.jax"] == importlib.metadata.version("jax")
    assert props["contract"] == "tunix.sft.peft_trainer.PeftTrainer.train_step"


def test_devices_too_late_is_a_usage_error(jax_started, pytester: pytest.Pytester) -> None:
    """Asking for another device count once JAX is up is refused with a one-line error."""
    other = _device_count() + 1
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest("--devices", str(other))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*JAX was imported before the harness could set {other}*"])


@pytest.fixture
def restore_hypothesis_profile():
    from hypothesis import settings

    name = settings.get_current_profile_name()
    yield settings
    settings.load_profile(name)


@pytest.mark.parametrize(
    ("env", "profile", "max_examples"),
    [
        ({"CI": "true"}, "ci", 20),
        ({}, "dev", 10),
        ({"CI": "true", "HYPOTHESIS_PROFILE": "thorough"}, "thorough", 200),
        ({"CI": "true", "POSTTRAIN_DEVICES": "real"}, "chip", 4),
        ({"POSTTRAIN_DEVICES": " Real "}, "chip", 4),
        ({"POSTTRAIN_DEVICES": "real", "HYPOTHESIS_PROFILE": "ci"}, "ci", 20),
    ],
    ids=[
        "ci-from-CI",
        "dev-default",
        "env-names-thorough",
        "chip-on-real",
        "chip-on-real-spelled-loosely",
        "env-wins-on-real",
    ],
)
def test_hypothesis_profile_follows_the_environment(
    monkeypatch, restore_hypothesis_profile, env, profile, max_examples
) -> None:
    """HYPOTHESIS_PROFILE names the profile; else chip on real devices, ci when CI is set,
    else dev."""
    for name in ("CI", "HYPOTHESIS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("POSTTRAIN_DEVICES", "8")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = restore_hypothesis_profile
    # As under CI, where hypothesis loads its own derandomized profile on import:
    # ours must not inherit from it.
    settings.register_profile("loaded-before", derandomize=True, max_examples=3)
    settings.load_profile("loaded-before")
    config = types.SimpleNamespace(getoption=lambda name, default=None: None)
    session_tuning.load_hypothesis_profile(config)  # type: ignore[arg-type]
    assert settings.get_current_profile_name() == profile
    assert settings.default.max_examples == max_examples
    assert settings.default.deadline is None
    assert settings.default.derandomize is (profile in ("ci", "chip"))
    if profile in ("ci", "chip"):  # derandomized: a database would replay the same examples
        from hypothesis import HealthCheck

        assert settings.default.database is None
        assert HealthCheck.too_slow in settings.default.suppress_health_check


@pytest.fixture
def restore_gc():
    threshold = gc.get_threshold()
    yield
    gc.set_threshold(*threshold)
    gc.freeze()  # the session froze its imports after collection; keep them frozen


def test_gc_tuning_freezes_the_heap_and_makes_full_collections_rarer(
    monkeypatch, restore_gc
) -> None:
    """tune_gc collects the young generations, freezes what is alive and raises the
    full-collection threshold; finish_gc collects the young generations and freezes the rest;
    POSTTRAIN_GC_TUNING=0 changes nothing. (gc.collect is counted, not run: on a worker's
    heap each full walk takes ~1.5 s.)"""
    collections = []
    monkeypatch.setattr(gc, "collect", lambda *args: collections.append(args) or 0)
    gc.set_threshold(700, 10, 10)
    frozen = gc.get_freeze_count()
    alive = [[] for _ in range(1000)]  # tracked containers, new since the last freeze
    monkeypatch.setenv("POSTTRAIN_GC_TUNING", "0")
    assert pytest_plugin.tune_gc() is False
    # Nothing frozen: the 1000 new containers stay out. (Not "== frozen": a frozen object
    # another thread frees, e.g. in an earlier test's async checkpoint, leaves the count.)
    assert collections == [] and gc.get_freeze_count() < frozen + len(alive)
    assert gc.get_threshold() == (700, 10, 10)
    monkeypatch.delenv("POSTTRAIN_GC_TUNING")
    assert pytest_plugin.tune_gc() is True
    assert collections == [(1,)] and gc.get_freeze_count() >= frozen + len(alive)
    assert gc.get_threshold() == (700, 10, pytest_plugin.GC_GEN2_THRESHOLD)
    frozen = gc.get_freeze_count()
    more = [[] for _ in range(1000)]
    pytest_plugin.finish_gc()
    assert collections == [(1,), (1,)] and gc.get_freeze_count() >= frozen + len(more)


# --- the gate -------------------------------------------------------------------------

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="2" failures="1" skipped="2" tests="7" time="3.25">
  <properties><property name="backend" value="cpu"/><property name="device_count" value="8"/>
  </properties>
  <testcase classname="tests.test_a" name="test_ok" time="0.1"/>
  <testcase classname="tests.test_a.TestGroup" name="test_bad[x.y-2]" time="0.2">
    <failure message="AssertionError: assert 1 == 2&#10;second line">tb</failure></testcase>
  <testcase classname="tests.test_a" name="test_setup_error" time="0.0">
    <error message="failed on setup with &quot;ValueError: boom&quot;">tb</error></testcase>
  <testcase classname="" name="tests.test_broken" time="0.0">
    <error message="collection failure">ImportError: no module</error></testcase>
  <testcase classname="tests.test_a" name="test_skip" time="0.0">
    <skipped type="pytest.skip" message="needs a real tpu backend; running on cpu">s</skipped>
  </testcase>
  <testcase classname="tests.test_a" name="test_xfail" time="0.0">
    <skipped type="pytest.xfail" message="known bug"/></testcase>
  <testcase classname="gone.module" name="test_elsewhere" time="0.0"/>
</testsuite></testsuites>
"""


def test_summary_parser_counts_and_names_failures(tmp_path: Path) -> None:
    """Counts, readable node ids, first message lines and suite properties come from the XML."""
    (tmp_path / "tests").mkdir()
    for name in ("test_a.py", "test_broken.py"):
        (tmp_path / "tests" / name).write_text("")
    junit = tmp_path / "junit.xml"
    junit.write_text(JUNIT)
    summary = gate.summarize_junit(junit, root=tmp_path)
    assert summary["counts"] == {
        "passed": 2,
        "failed": 1,
        "error": 2,
        "skipped": 2,
        "total": 7,
    }
    assert summary["failures"] == [
        {
            "id": "tests/test_a.py::TestGroup::test_bad[x.y-2]",
            "outcome": "failed",
            "message": "AssertionError: assert 1 == 2",
        },
        {
            "id": "tests/test_a.py::test_setup_error",
            "outcome": "error",
            "message": 'failed on setup with "ValueError: boom"',
        },
        {"id": "tests/test_broken.py", "outcome": "error", "message": "collection failure"},
    ]
    assert summary["skip_reasons"] == {
        "needs a real tpu backend; running on cpu": 1,
        "known bug": 1,
    }
    assert summary["properties"] == {"backend": "cpu", "device_count": "8"}
    assert summary["junit_time_s"] == 3.25


def test_the_one_screen_summary_lists_at_most_max_listed_of_each_kind(tmp_path: Path) -> None:
    """The printed summary: a rule, the verdict with both times, the counts, the first
    MAX_LISTED failures (FAILED / ERROR  labels) then how many more and where, the first
    MAX_LISTED skip reasons with their counts, the reports, and the counts' last line."""
    many = gate.MAX_LISTED + 2
    summary = {
        **gate.empty_summary(),
        "counts": {"passed": 3, "failed": many - 1, "error": 1, "skipped": many, "total": 0},
        "failures": [
            {"id": f"t::f{i}", "outcome": "failed" if i else "error", "message": f"m{i}"}
            for i in range(many)
        ],
        "skip_reasons": {f"why {i}": i + 1 for i in range(many)},
        "message": "gate failed (pytest exit 1)",
        "wall_time_s": 12.345,
        "junit_time_s": 10.0,
        "junit": "reports/junit-gate.xml",
        "sizes": ["size: 1 modules over 400 lines (split them): a.py (401)"],
    }
    lines = gate.format_summary(summary, tmp_path / "s.json").splitlines()
    assert lines[:3] == [
        "-" * 24 + " posttrain-harness gate " + "-" * 24,
        "gate failed (pytest exit 1) in 12.3 s (tests 10.0 s)",
        f"passed 3, failed {many - 1}, errors 1, skipped {many} (of 0)",
    ]
    listed = lines[lines.index("failures and errors:") + 1 : lines.index("skip reasons:")]
    assert listed[0] == "  ERROR  t::f0: m0" and listed[1] == "  FAILED t::f1: m1"
    assert len(listed) == gate.MAX_LISTED + 1
    assert listed[-1] == f"  ... and 2 more in {tmp_path / 's.json'}"
    reasons = lines[lines.index("skip reasons:") + 1 : -3]
    assert reasons == [f"  {i + 1:4d} x why {i}" for i in range(gate.MAX_LISTED)]
    assert lines[-3] == "size: 1 modules over 400 lines (split them): a.py (401)"
    assert lines[-2] == f"reports: reports/junit-gate.xml, {tmp_path / 's.json'}"
    assert lines[-1] == f"gate: 3 passed, {many} failed, {many} skipped"
    clean = {**summary, "failures": [], "skip_reasons": {}, "junit": None, "sizes": []}
    assert "failures and errors:" not in gate.format_summary(clean, tmp_path / "s.json")
    assert gate.format_summary(clean, tmp_path / "s.json").splitlines()[-2] == (
        f"reports: {tmp_path / 's.json'}"
    )


def test_an_empty_summary_counts_every_outcome_as_zero() -> None:
    """A run that wrote no JUnit report: every outcome and the total 0, nothing listed."""
    assert gate.empty_summary() == {
        "counts": {"passed": 0, "failed": 0, "error": 0, "skipped": 0, "total": 0},
        "failures": [],
        "skip_reasons": {},
        "junit_time_s": 0.0,
        "properties": {},
        "sizes": [],
    }


@pytest.mark.parametrize(
    ("pytest_code", "executed", "expected"),
    [
        (5, 0, (1, "gate ran no tests")),
        (0, 0, (1, "gate ran no tests")),
        (0, 4, (0, "gate passed")),
        (1, 4, (1, "gate failed (pytest exit 1)")),
        (2, 0, (2, "gate failed (pytest exit 2)")),
    ],
    ids=["no-tests-collected", "all-skipped", "passed", "failed", "interrupted"],
)
def test_gate_exit_status(pytest_code, executed, expected) -> None:
    """pytest's status passes through, except that running no test is a failure (1)."""
    assert gate.gate_exit_status(pytest_code, executed) == expected


def test_write_atomic_leaves_no_temporary(tmp_path: Path) -> None:
    """The file has the new text and no temporary file is left beside it."""
    target = tmp_path / "out" / "summary.json"
    atomic.write_text(target, "first")
    atomic.write_text(target, "second")
    assert target.read_text() == "second"
    assert [p.name for p in target.parent.iterdir()] == ["summary.json"]


def _run_gate(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "harness.cli", "gate", *args],
        cwd=cwd,
        env=_subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow  # the mapping is test_gate_exit_status; the wiring, the devices-skip test
def test_gate_on_no_tests_exits_1(tmp_path: Path) -> None:
    """pytest's exit 5 (nothing collected) becomes gate exit 1, said and recorded."""
    (tmp_path / "empty").mkdir()
    run = _run_gate(tmp_path, "--jobs", "0", "--", "-p", "no:cacheprovider", "empty")
    assert run.returncode == 1, run.stdout + run.stderr
    assert "gate ran no tests" in run.stdout
    summary = json.loads((tmp_path / "reports" / "gate-summary.json").read_text())
    assert (summary["exit_code"], summary["pytest_exit_code"]) == (1, 5)
    assert run.stdout.rstrip().splitlines()[-1] == "gate: 0 passed, 0 failed, 0 skipped"


def test_gate_fails_a_devices_skip_and_summarises_it(tmp_path: Path) -> None:
    """Under xdist (one worker) the gate deselects slow tests, fails a devices skip and lists
    the failure."""
    (tmp_path / "test_gate_sample.py").write_text(
        textwrap.dedent(
            """
            import pytest

            def test_ok():
                pass

            @pytest.mark.devices(10_000)
            def test_needs_many_devices():
                pass

            @pytest.mark.slow
            def test_slow():
                raise AssertionError("slow tests are not in the gate")
            """
        )
    )
    run = _run_gate(tmp_path, "--jobs", "1", "--devices", "8", "--", "-p", "no:cacheprovider")
    assert run.returncode == 1, run.stdout + run.stderr
    summary = json.loads((tmp_path / "reports" / "gate-summary.json").read_text())
    assert summary["counts"] == {
        "passed": 1,
        "failed": 0,
        "error": 1,  # failed in setup, before any fixture ran
        "skipped": 0,
        "total": 2,
    }
    [failure] = summary["failures"]
    assert failure["id"] == "test_gate_sample.py::test_needs_many_devices"
    assert "needs 10000 devices, 8 available" in failure["message"]
    assert summary["properties"]["device_count"] == "8"  # written by the xdist controller
    assert "ERROR  test_gate_sample.py::test_needs_many_devices: failed on setup" in run.stdout
    assert run.stdout.rstrip().splitlines()[-1] == "gate: 1 passed, 1 failed, 0 skipped"


def test_suite_env_caches_bytecode_and_compiles(monkeypatch, tmp_path) -> None:
    """The suites' pytest runs may write bytecode (pytest keeps its rewritten modules) and
    use the persistent compilation cache; the rest of the environment is kept."""
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.setenv("POSTTRAIN_SOMETHING", "kept")
    env = suite_env(str(tmp_path / "cache"))
    assert "PYTHONDONTWRITEBYTECODE" not in env
    assert env["POSTTRAIN_SOMETHING"] == "kept"
    assert env["JAX_COMPILATION_CACHE_DIR"] == str((tmp_path / "cache").resolve())
    assert os.environ["PYTHONDONTWRITEBYTECODE"] == "1"  # this process is left alone


def test_gate_default_compile_cache_is_per_user_not_per_checkout(monkeypatch, tmp_path):
    """A fresh clone reuses the user's compiles: the default cache is outside the checkout."""
    from harness import cli

    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    args = cli._parser().parse_args(["gate"])
    assert args.compile_cache == str(tmp_path / "posttrain-harness" / "jax-compile")


def test_the_chip_profile_is_there_for_hypothesis_own_option(restore_hypothesis_profile):
    """``--hypothesis-profile chip`` (hypothesis loads it after our plugin) finds it."""
    settings = restore_hypothesis_profile
    chosen = {"hypothesis_profile": "chip"}
    config = types.SimpleNamespace(getoption=lambda name, default=None: chosen.get(name))
    session_tuning.load_hypothesis_profile(config)  # type: ignore[arg-type]
    assert settings.get_profile("chip").max_examples == session_tuning.PROFILE_EXAMPLES["chip"]
