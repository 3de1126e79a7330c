"""``posttrain plan --run-steps``' checks of the chips and its run, at their edges: a
one-chip slice, a topology whose chip has no TPU kind, a single step, a step's keyword
arguments, and a refused step's memory figures. (tests/test_plan_chip.py holds the rest;
CI has no chip, so the devices here are stand-ins with a device's fields.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from posttrain.plan import chips, measure, topology


class _Chip:
    """A device as ``chip_devices`` and ``memory_peak`` read one."""

    def __init__(self, id_: int, kind: str = "TPU v5 lite", stats: dict | None = None):
        self.id, self.device_kind, self._stats = id_, kind, stats

    def memory_stats(self):
        return self._stats


def _on_tpu(monkeypatch, chips):
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    monkeypatch.setattr(jax, "devices", lambda: chips)


def test_a_one_chip_slice_runs_on_its_one_chip(monkeypatch):
    """v5e-1: the one device is the slice (its kind read from the first device)."""
    chip = _Chip(0, "TPU v5e")
    _on_tpu(monkeypatch, [chip])
    assert chips.chip_devices(topology.get("v5e-1")) == [chip]


def test_the_first_chip_in_id_order_names_the_generation(monkeypatch):
    """Chips of two kinds: the kind of the lowest id is the one judged and named."""
    _on_tpu(monkeypatch, [_Chip(1, "TPU v5 lite"), _Chip(0, "TPU v4")])
    with pytest.raises(ValueError) as error:
        chips.chip_devices(
            topology.Topology(
                name="v5e-2", chip=topology.CHIPS["v5e"], chips=2, libtpu_name="v5e:1x2"
            )
        )
    assert str(error.value) == (
        "--run-steps: the devices here are 'TPU v4', not v5e ('TPU v5 lite' or 'TPU v5e')"
    )


def test_a_chip_with_no_tpu_kind_is_refused_naming_none(monkeypatch):
    """An H200 plan on a TPU host: no device kind matches, the message says so."""
    _on_tpu(monkeypatch, [_Chip(0)])
    with pytest.raises(ValueError) as error:
        chips.chip_devices(topology.get("h200"))
    assert str(error.value) == (
        "--run-steps: the devices here are 'TPU v5 lite', not h200 (unknown kind)"
    )


class _Jitted:
    """A jitted function as ``run_program`` uses one: not called itself;
    ``lower(...).compile()`` gives the executable the steps call, whose
    ``memory_analysis()`` is ``memory`` (None: a backend with none), or fails with
    ``refusal``."""

    def __init__(self, call, memory=None, refusal: str = ""):
        self.call, self.memory, self.refusal = call, memory, refusal

    def lower(self, *args, **kwargs):
        return self

    def compile(self):
        if self.refusal:
            raise RuntimeError(self.refusal)
        return _Executable(self.call, self.memory)


class _Executable:
    def __init__(self, call, memory):
        self.call, self.memory = call, memory

    def memory_analysis(self):
        return self.memory

    def __call__(self, *args, **kwargs):
        return self.call(*args, **kwargs)


class _Step:
    """A program that records its keyword arguments and fails at call ``fail_at``."""

    def __init__(self, fail_at: int = 0, error: str = "", **kwargs):
        self.calls, self.fail_at, self.error = 0, fail_at, error
        self.args, self.kwargs, self.seen = (), kwargs, []
        self.jitted = _Jitted(self.step)

    def step(self, **kwargs):
        self.calls += 1
        self.seen.append(kwargs)
        if self.calls == self.fail_at:
            raise RuntimeError(self.error)
        return jnp.ones(())


def test_one_step_is_a_run_and_its_time_is_the_step_time():
    """--run-steps 1: one step, the first (compile included) is the step time."""
    ran = measure.run_program(_Step(), 1, [])
    assert ran.fits and ran.steps == 1
    assert ran.step_seconds == ran.first_step_seconds > 0


def test_each_step_gets_the_programs_keyword_arguments():
    step = _Step(rng=7)
    measure.run_program(step, 2, [])
    assert step.seen == [{"rng": 7}, {"rng": 7}]


def test_a_refused_step_reports_the_memory_the_chips_held():
    """RESOURCE_EXHAUSTED at the first step: no step ran, fits is False, and the peak and
    limit are the devices' (in use + reserved of the fullest, the smallest limit)."""
    devices = [
        _Chip(0, stats={"peak_bytes_in_use": 9, "peak_bytes_reserved": 1, "bytes_limit": 16}),
        _Chip(1, stats={"peak_bytes_in_use": 5, "peak_bytes_reserved": 7, "bytes_limit": 20}),
    ]
    refused = measure.run_program(_Step(1, "RESOURCE_EXHAUSTED: hbm"), 3, devices)
    assert refused.fits is False and refused.steps == 0
    assert refused.first_step_seconds == 0.0 and refused.step_seconds == 0.0
    assert (refused.peak_bytes, refused.bytes_limit) == (12, 16)
    assert refused.error == "RESOURCE_EXHAUSTED: hbm"


class _Clock:
    """``time.perf_counter`` for a program whose steps take ``durations`` seconds: each
    call of the program moves it on by the next one (load-free step times)."""

    def __init__(self, durations):
        self.now, self.durations = 100.0, list(durations)

    def __call__(self):
        return self.now

    def step(self):
        self.now += self.durations.pop(0)
        return jnp.ones(())


@pytest.mark.parametrize(
    ("durations", "median"),
    [([5.0, 1.0], 1.0), ([5.0, 1.0, 2.0, 3.0], 2.0), ([5.0, 3.0, 1.0, 2.0], 2.0)],
)
def test_the_step_time_is_the_median_of_the_steps_after_the_first(monkeypatch, durations, median):
    """The first step compiles: the step time is the median of the others alone."""
    clock = _Clock(durations)
    monkeypatch.setattr(measure.time, "perf_counter", clock)
    program = _Step()
    program.jitted = _Jitted(clock.step)
    devices = [
        _Chip(0, stats={"peak_bytes_in_use": 9, "peak_bytes_reserved": 1, "bytes_limit": 16})
    ]
    ran = measure.run_program(program, len(durations), devices)
    assert (ran.step_seconds, ran.first_step_seconds) == (median, 5.0)
    assert (ran.peak_bytes, ran.bytes_limit, ran.fits) == (10, 16, True)


def test_a_refusal_keeps_the_first_240_characters_of_its_line():
    line = "RESOURCE_EXHAUSTED: " + "x" * 300
    refused = measure.run_program(_Step(2, f"\n  {line}  \nmore"), 3, [])
    assert refused.error == line[:240] and refused.steps == 1


class _Memory:
    """``memory_analysis()``'s fields as XLA names them (a CompiledMemoryStats)."""

    argument_size_in_bytes, output_size_in_bytes, alias_size_in_bytes = 11, 5, 3
    temp_size_in_bytes, generated_code_size_in_bytes, peak_memory_in_bytes = 7, 2, 13


def test_the_run_records_the_memory_analysis_of_the_executable_it_ran():
    """The steps call the executable ``lower(...).compile()`` gave, and its memory
    analysis is the run's, under the plan's names; a refused run keeps it too."""
    step = _Step(3, "RESOURCE_EXHAUSTED: hbm")
    step.jitted.memory = _Memory()
    refused = measure.run_program(step, 4, [])
    assert step.calls == 3 and refused.steps == 2 and not refused.fits
    want = {"arguments": 11, "outputs": 5, "aliased": 3, "temporaries": 7, "code": 2}
    want["live_peak"] = 13
    assert refused.compiled == want
    assert measure.run_program(_Step(), 1, []).compiled == {}  # a backend with none


def test_a_compile_refused_for_memory_runs_no_step_and_has_no_analysis():
    step = _Step()
    step.jitted.refusal = "RESOURCE_EXHAUSTED: program too large\nmore"
    refused = measure.run_program(step, 2, [])
    assert step.calls == 0 and refused.steps == 0 and not refused.fits
    assert refused.compiled == {} and refused.error == "RESOURCE_EXHAUSTED: program too large"


@pytest.mark.parametrize(("run_steps", "cache_off"), [(0, True), (2, False)])
@pytest.mark.wiring
def test_only_a_deviceless_compile_turns_the_compilation_cache_off(
    monkeypatch, run_steps, cache_off
):
    """A deviceless plan compiles with JAX's persistent cache off (libtpu's compile-only
    client cannot load from it); --run-steps compiles for the chips here, cache allowed:
    the same plan run again on a chip compiles nothing. (The real qwen3-tiny step on this
    CPU stands in for the chip's program.)"""
    import contextlib

    from posttrain import _compat
    from posttrain.plan import PlanOptions
    from posttrain.plan import compile as plan_compile
    from tests.test_plan_chip import _tiny_step

    mesh, program = _tiny_step()
    entered = []

    @contextlib.contextmanager
    def no_cache():
        entered.append(True)
        yield

    monkeypatch.setattr(_compat, "no_persistent_compilation_cache", no_cache)
    monkeypatch.setattr(
        plan_compile, "build_programs", lambda options, topo: ("tiny", {"step": program}, mesh)
    )
    options = PlanOptions(model="qwen3-tiny", topology="v5e-1", run_steps=run_steps)
    _, stages = plan_compile.compile_stages(options)
    # it compiled (a TPU keeps this tiny step's temporaries at 0 bytes: not a witness)
    assert stages["step"].arguments > 0 and stages["step"].live_peak >= stages["step"].arguments
    assert entered == ([True] if cache_off else [])


@pytest.mark.host  # a table lookup: no program
def test_a_chips_peak_is_the_tables_by_its_kind_and_other_devices_have_none():
    """The denominator of a measured MFU: each TPU generation's kinds map to its table
    row (v5e 197e12, v5p 459e12, whichever case the runtime writes); a CPU, a GPU or no
    kind at all give 0."""
    assert chips.peak_flops(_Chip(0, "TPU v5 lite")) == 197e12
    assert chips.peak_flops(_Chip(0, "tpu V5E")) == 197e12
    assert chips.peak_flops(_Chip(0, "TPU v5")) == topology.CHIPS["v5p"].peak_flops == 459e12
    assert chips.peak_flops(_Chip(0, "TPU v6 lite")) == topology.CHIPS["v6e"].peak_flops
    assert chips.peak_flops(_Chip(0, "NVIDIA H200")) == 0.0
    assert chips.peak_flops(jax.devices("cpu")[0]) == 0.0
    assert chips.peak_flops(object()) == 0.0
