"""``posttrain plan --run-steps N --probe-headroom`` (:mod:`posttrain.plan.headroom`): the
largest ballast a step runs beside, found by bisection, and where it lands.

CI has no chip: the step here is a stand-in whose memory is a number (it refuses with the
runtime's ``RESOURCE_EXHAUSTED`` when the ballast beside it passes its true headroom),
and the ballast a real allocation on the CPU's devices where it is the real one."""

from __future__ import annotations

import dataclasses
import math
import weakref

import jax
import numpy as np
import pytest

from posttrain.plan import headroom, measure, report, topology

GIB = 2**30
MIB = 2**20


class _Chip:
    """A device with ``free`` bytes beside the step: a step refuses when the ballast held
    is larger; ``hold`` fails itself past ``limit`` (an allocation larger than the HBM)."""

    def __init__(self, free: int, limit: int = 16 * GIB):
        self.free, self.limit, self.held, self.tries, self.alive = free, limit, 0, [], []

    def hold(self, size: int):
        assert all(ref() is None for ref in self.alive), "the last ballast was not freed"
        if size > self.limit:
            raise RuntimeError(f"RESOURCE_EXHAUSTED: allocating {size} bytes")
        self.held = size
        self.tries.append(size)
        ballast = _Ballast()
        self.alive.append(weakref.ref(ballast))
        return ballast

    def step(self):
        if self.held > self.free:
            raise RuntimeError("RESOURCE_EXHAUSTED: Error allocating device buffer")


class _Ballast:
    pass


@pytest.mark.parametrize(
    "free",
    [0, 1, 63 * MIB, 64 * MIB, 65 * MIB, int(2.70 * GIB), int(4.88 * GIB), 15 * GIB],
    ids=[
        "none",
        "one-byte",
        "under-one-step",
        "one-step",
        "over-one-step",
        "2.70G",
        "4.88G",
        "15G",
    ],
)
def test_the_probe_finds_the_largest_ballast_within_its_resolution(free):
    """Within one resolution below the true headroom, never above it, in as many tries as
    a bisection of the limit takes."""
    chip = _Chip(free)
    found = headroom.probe(chip.step, chip.hold, chip.limit)
    assert found % headroom.RESOLUTION == 0
    assert found <= free < found + headroom.RESOLUTION
    assert len(chip.tries) <= math.ceil(math.log2(chip.limit / headroom.RESOLUTION))


def test_a_ballast_the_device_cannot_hold_counts_as_not_fitting():
    """Past the limit the allocation itself refuses: the probe goes below it."""
    chip = _Chip(free=20 * GIB, limit=4 * GIB)
    assert headroom.probe(chip.step, chip.hold, limit=8 * GIB) == 4 * GIB


def test_an_error_other_than_memory_is_raised():
    def step():
        raise RuntimeError("INTERNAL: the chip fell over")

    with pytest.raises(RuntimeError, match="INTERNAL"):
        headroom.probe(step, lambda size: None, GIB)


@pytest.mark.parametrize(("limit", "resolution"), [(0, MIB), (-1, MIB), (GIB, 0)])
def test_a_limit_or_resolution_that_is_not_positive_is_refused(limit, resolution):
    with pytest.raises(ValueError, match=f"got {limit} and {resolution}"):
        headroom.probe(lambda: None, lambda size: None, limit, resolution)


def test_the_ballast_is_real_bytes_on_each_device():
    devices = jax.devices()[:2]
    held = measure.ballast(3 * MIB, devices)
    assert [a.nbytes for a in held] == [3 * MIB] * len(devices)
    assert [next(iter(a.devices())) for a in held] == devices
    assert not np.asarray(held[0]).any()


class _Program:
    """A program whose step refuses when more ballast than ``free`` is held, and counts
    the arguments made anew before each try (a refused step consumed its donated ones)."""

    def __init__(self, free: int):
        self.free, self.held, self.remade, self.kwargs = free, 0, 0, {"rng": 7}
        self.args = (self,)
        self.jitted = self

    def lower(self, *args, **kwargs):
        return self

    def compile(self):
        return self

    def memory_analysis(self):
        return None

    def __call__(self, *args, **kwargs):
        assert args == (self,) and kwargs == {"rng": 7}  # the arguments, made anew
        if self.held > self.free:
            raise RuntimeError("RESOURCE_EXHAUSTED: Error allocating device buffer")


def test_run_program_probes_after_its_steps_and_makes_the_arguments_anew(monkeypatch):
    """--probe-headroom: after the timed steps, each try remakes the arguments before it
    holds the ballast; the largest that ran is the Measured's headroom; the limit is the
    runtime's bytes_limit."""
    program = _Program(free=int(4.88 * GIB))
    order = []

    def remade(arg):
        assert arg is program
        order.append("args")
        return arg

    def hold(size, devices):
        assert devices == ["chip"]
        order.append("ballast")
        program.held = size
        return object()

    monkeypatch.setattr(measure, "_made_concrete", remade)
    monkeypatch.setattr(measure, "ballast", hold)
    monkeypatch.setattr(measure, "memory_peak", lambda devices: (11 * GIB, 16 * GIB))
    # (a one-byte limit is probed too: only 0 fits beside the step)
    ran = measure.run_program(program, 2, ["chip"], probe_headroom=True)
    assert ran.headroom_bytes == 4.875 * GIB  # 78 steps of 64 MiB
    tries = order[1:]  # the first: the timed steps' arguments
    assert tries == ["args", "ballast"] * (len(tries) // 2) and len(tries) >= 16


def test_no_probe_unless_asked_or_without_a_limit(monkeypatch):
    program = _Program(free=GIB)
    monkeypatch.setattr(measure, "ballast", lambda *a: pytest.fail("probed"))
    # a runtime with no statistics (the CPU's: bytes_limit 0) cannot be probed
    assert measure.run_program(program, 1, [], probe_headroom=True).headroom_bytes == -1
    # a chip's, unasked: no probe
    monkeypatch.setattr(measure, "memory_peak", lambda devices: (GIB, 16 * GIB))
    assert measure.run_program(program, 1, ["chip"]).headroom_bytes == -1


def test_the_table_sets_the_probed_headroom_beside_the_predicted_one():
    """A row ``headroom (probed)``: the plan's headroom (HBM - predicted peak), the probed
    ballast, the plan's error; none when not probed."""
    record = {
        "arguments": 3 * GIB,
        "outputs": 3 * GIB,
        "aliased": 3 * GIB,
        "temporaries": 10 * GIB,
        "code": 0,
        "kinds": {},
        "flops": 1e13,
        "bytes_accessed": 1e11,
        "model_flops": 1e13,
        "compile_seconds": 1.0,
        "cost_source": "compiled",
        "resident": 0,
    }
    figures = report.Figures(**record)
    v5e = topology.get("v5e-1")
    verdict = report.judge(figures, v5e)
    measured = measure.Measured(
        steps=2,
        step_seconds=0.5,
        first_step_seconds=9.0,
        peak_bytes=11 * GIB,
        bytes_limit=v5e.hbm_bytes,
        headroom_bytes=2 * GIB,
    )
    rows = report.against_the_chip(figures, verdict, measured, v5e).splitlines()
    probed = [r.split() for r in rows if r.startswith("headroom (probed)")]
    predicted = v5e.hbm_bytes - 13 * GIB  # arguments + temporaries
    error = f"{(predicted - 2 * GIB) / (2 * GIB):+.1%}"
    assert probed == [
        ["headroom", "(probed)", *report.gib(predicted).split(), "2.00", "GiB", error]
    ]
    unprobed = dataclasses.replace(measured, headroom_bytes=-1)
    table = report.against_the_chip(figures, verdict, unprobed, v5e)
    assert "headroom (probed)" not in table


@pytest.mark.parametrize(
    ("limit", "resolution", "free", "found"),
    [(1, 1, 5, 0), (3, 1, 1, 1), (16 * GIB + 1, headroom.RESOLUTION, 3 * GIB + 5, 3 * GIB)],
    ids=["one-byte-limit", "one-byte-steps", "limit-off-the-grid"],
)
def test_every_ballast_is_whole_bytes_and_the_smallest_limits_are_probed(
    limit, resolution, free, found
):
    """Limits and resolutions down to 1 byte are probed (1 byte of limit: only 0 can be
    held), and each size tried is an int of bytes even where the limit is not a multiple
    of the resolution."""
    chip = _Chip(free, limit=limit)
    assert headroom.probe(chip.step, chip.hold, limit, resolution) == found
    assert all(type(size) is int for size in chip.tries)
