"""The command line of the harness's pytest plugin (:mod:`harness.gate.pytest_plugin`): its
options with their help, and its markers' descriptions (``pytest --markers``)."""

from __future__ import annotations

import pytest

from harness.devices import devices as _devices

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
    "host: exercises host code only (CLI parsing, reports, git, local processes); left "
    "out on a real accelerator unless --host-tests run",
    "wiring: checks that a value reaches where it acts (a config field, an option, a "
    "fixture's quirk, a refusal), which no chip's arithmetic changes; left out on a real "
    "accelerator unless --host-tests run",
    "chip_sample(id, ...): a real accelerator runs only the variants with these ids (the "
    "CPU every one) unless --chip-variants all",
    "matmul_precision(name): runs under jax.default_matmul_precision(name) (float32 "
    "comparisons pin it: a TPU's default matmul is one bfloat16 pass)",
    "convention(name): exercises Tunix train-step convention `name` (see --conventions)",
)


def add_options(parser: pytest.Parser) -> None:
    """The plugin's options, in the group ``posttrain-harness`` (its ``pytest_addoption``).

    Each dest is the one pytest derives from the flag (``--strict-skips``: ``strict_skips``;
    pytest 9 then refuses another plugin's option of that dest instead of sharing it), but
    ``--devices``'s ``posttrain_devices``; unset, an option is argparse's ``None`` (a
    switch ``False``) unless it names a default."""
    group = parser.getgroup("posttrain-harness")
    group.addoption(
        "--devices",
        dest="posttrain_devices",
        metavar="N|real",
        help=f"N fake CPU devices, or 'real' for the real accelerators "
        f"(default: ${_devices.ENV_VAR} or {_devices.DEFAULT_DEVICES})",
    )
    group.addoption(
        "--strict-skips",
        action="store_true",
        help="fail, instead of skipping, a test whose devices(n) marker asks for more "
        "devices than exist (the gate sets this)",
    )
    group.addoption(
        "--upstream-deprecations",
        choices=("error", "record"),
        default="error",
        help="'record': a deprecation raised from upstream code is shown, not raised, and "
        "recorded on the test as the JUnit property upstream_deprecations (the matrix's warn "
        "cells; harness/gate/deprecations.py); 'error' (default): filterwarnings decides",
    )
    _add_chip_options(group)
    group.addoption(
        "--conventions",
        metavar="NAME,...",
        help="keep only the tests marked convention(NAME) for these names, and the "
        "unmarked ones when 'installed' is among them (default: every test)",
    )
    group.addoption(
        "--contract",
        metavar="NAME",
        help="keep only the tests marked contract(NAME) (a matrix column; bisect runs one)",
    )


def _add_chip_options(group) -> None:
    """The options of a run on real chips: the backend required, the host tests, the
    chip's precision emulated on the CPU."""
    group.addoption(
        "--require-backend",
        metavar="NAME",
        help="fail the session unless JAX's backend is NAME (tox -e tpu: tpu), instead "
        "of running the suites on whatever came up",
    )
    group.addoption(
        "--host-tests",
        choices=("auto", "run", "skip"),
        default="auto",
        help="tests marked host or wiring: 'auto' (default) leaves them out on a real "
        "accelerator and runs them on the CPU; 'run' runs them everywhere; 'skip' leaves "
        "them out everywhere",
    )
    group.addoption(
        "--chip-variants",
        choices=("auto", "all", "sampled"),
        default="auto",
        help="tests marked chip_sample(id, ...): 'auto' (default) runs only the named "
        "variants on a real accelerator and every variant on the CPU; 'all' every variant "
        "everywhere; 'sampled' the named ones everywhere",
    )
    group.addoption(
        "--compile-report",
        metavar="PATH",
        help="write a JSON line per test to PATH as it ends: its wall, JAX tracing, lowering "
        "and XLA compile seconds, programs and persistent-cache hits, with the totals at "
        "the end (one process: not with -n; harness/gate/compile_report.py)",
    )
    group.addoption(
        "--resume",
        action="store_true",
        help="with --compile-report PATH: continue the run PATH records (a run stopped by a "
        "time limit): deselect the tests it holds a line for and append to it",
    )
    group.addoption(
        "--emulate-chip-precision",
        action="store_true",
        help="multiply float32 at the default precision as a TPU does (one bfloat16 pass): "
        "finds the float32 comparisons that need matmul_precision, without a TPU",
    )
