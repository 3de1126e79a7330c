"""The harness plugin's command line (:mod:`harness.gate.plugin_options`): each option's
default and parsed value under the name the plugin reads, the values it refuses, and the
help a user reads in ``pytest --help`` (docs/testing.md and docs/matrix.md send readers
there)."""

from __future__ import annotations

import pytest

from harness.devices import devices as _devices

pytestmark = pytest.mark.host

# dest -> (its default, the arguments that set it, the value they give)
OPTIONS = {
    "posttrain_devices": (None, ["--devices", "8"], "8"),
    "strict_skips": (False, ["--strict-skips"], True),
    "upstream_deprecations": ("error", ["--upstream-deprecations", "record"], "record"),
    "require_backend": (None, ["--require-backend", "tpu"], "tpu"),
    "host_tests": ("auto", ["--host-tests", "skip"], "skip"),
    "chip_variants": ("auto", ["--chip-variants", "all"], "all"),
    "compile_report": (None, ["--compile-report", "r.jsonl"], "r.jsonl"),
    "resume": (False, ["--resume"], True),
    "emulate_chip_precision": (False, ["--emulate-chip-precision"], True),
    "conventions": (None, ["--conventions", "partial,main"], "partial,main"),
    "contract": (None, ["--contract", "tunix.sft.PeftTrainer"], "tunix.sft.PeftTrainer"),
}

# the group's page in `pytest --help`, in order: each option as invoked, then its help
HELP = (
    (
        "--devices=N|real",
        "N fake CPU devices, or 'real' for the real accelerators (default: "
        f"${_devices.ENV_VAR} or {_devices.DEFAULT_DEVICES})",
    ),
    (
        "--strict-skips",
        "fail, instead of skipping, a test whose devices(n) marker asks for more devices "
        "than exist (the gate sets this)",
    ),
    (
        "--upstream-deprecations={error,record}",
        "'record': a deprecation raised from upstream code is shown, not raised, and "
        "recorded on the test as the JUnit property upstream_deprecations (the matrix's "
        "warn cells; harness/gate/deprecations.py); 'error' (default): filterwarnings "
        "decides",
    ),
    (
        "--require-backend=NAME",
        "fail the session unless JAX's backend is NAME (tox -e tpu: tpu), instead of "
        "running the suites on whatever came up",
    ),
    (
        "--host-tests={auto,run,skip}",
        "tests marked host or wiring: 'auto' (default) leaves them out on a real "
        "accelerator and runs them on the CPU; 'run' runs them everywhere; 'skip' leaves "
        "them out everywhere",
    ),
    (
        "--chip-variants={auto,all,sampled}",
        "tests marked chip_sample(id, ...): 'auto' (default) runs only the named variants "
        "on a real accelerator and every variant on the CPU; 'all' every variant "
        "everywhere; 'sampled' the named ones everywhere",
    ),
    (
        "--compile-report=PATH",
        "write a JSON line per test to PATH as it ends: its wall, JAX tracing, lowering and "
        "XLA compile seconds, programs and persistent-cache hits, with the totals at the end "
        "(one process: not with -n; harness/gate/compile_report.py)",
    ),
    (
        "--resume",
        "with --compile-report PATH: continue the run PATH records (a run stopped by a time "
        "limit): deselect the tests it holds a line for and append to it",
    ),
    (
        "--emulate-chip-precision",
        "multiply float32 at the default precision as a TPU does (one bfloat16 pass): "
        "finds the float32 comparisons that need matmul_precision, without a TPU",
    ),
    (
        "--conventions=NAME,...",
        "keep only the tests marked convention(NAME) for these names, and the unmarked ones "
        "when 'installed' is among them (default: every test)",
    ),
    (
        "--contract=NAME",
        "keep only the tests marked contract(NAME) (a matrix column; bisect runs one)",
    ),
)


def test_each_option_has_its_default_and_gives_its_value(jax_started, pytester):
    """Unset, each option holds its default (False, not None, for the switches); set, the
    value given, under the dest the plugin reads."""
    unset = pytester.parseconfig()
    for dest, (default, _, _) in OPTIONS.items():
        value = unset.getoption(dest)
        assert value == default and type(value) is type(default), (dest, value)
    every = [arg for _, args, _ in OPTIONS.values() for arg in args]
    given = pytester.parseconfig(*every)
    for dest, (_, args, value) in OPTIONS.items():
        assert given.getoption(dest) == value, (args, given.getoption(dest))


@pytest.mark.parametrize(
    "option, value",
    [("--upstream-deprecations", "warn"), ("--host-tests", "always"), ("--chip-variants", "some")],
    ids=["deprecations", "host-tests", "chip-variants"],
)
def test_an_option_of_choices_refuses_another_value(jax_started, pytester, option, value):
    result = pytester.runpytest(option, value)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*argument {option}: invalid choice: '{value}'*"])


def test_the_help_page_lists_every_option_once_with_its_help(jax_started, pytester, monkeypatch):
    """``pytest --help`` has the group posttrain-harness holding exactly these options, each
    with its metavar or choices and its help (wide enough that argparse wraps nothing)."""
    monkeypatch.setenv("COLUMNS", "1000")
    lines = pytester.runpytest("--help").stdout.lines
    start = lines.index("posttrain-harness:") + 1
    end = lines.index("", start)
    page = " ".join(" ".join(lines[start:end]).split())
    assert page == " ".join(f"{invocation} {text}" for invocation, text in HELP)


@pytest.mark.parametrize("dest", [d for d in OPTIONS if d != "posttrain_devices"])
def test_an_option_whose_dest_another_plugin_took_is_refused_not_shared(
    jax_started, pytester, dest
):
    """Each option's dest is pytest's from its flag, so a plugin registered earlier with an
    option of that dest stops the session (the harness plugin fails to load) instead of the
    two sharing one value. Skipped on a pytest that checks no dests."""
    pytester.makepyfile(
        probe="def pytest_addoption(parser):\n"
        "    parser.addoption('--probe-a', dest='probe_b')\n    parser.addoption('--probe-b')\n"
    )
    pytester.syspathinsert()
    try:
        pytester.parseconfig("-p", "probe")
    except ValueError:
        pass
    else:
        pytest.skip("this pytest lets a derived dest share another option's")
    pytester.makepyfile(
        taker=f"def pytest_addoption(parser):\n    parser.addoption('--taker', dest={dest!r})\n"
    )
    with pytest.raises(Exception) as refused:
        pytester.parseconfig("-p", "taker")
    cause = refused.value.__cause__
    assert isinstance(cause, ValueError), refused.value
    assert str(cause).startswith(f"option dest '{dest}' already used by ['--taker']"), cause
