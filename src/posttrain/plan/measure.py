"""``posttrain plan --run-steps N``: the planned step run on the chips themselves, measured
beside what the plan predicted.

The plan's program (:func:`posttrain.plan.compile.build_programs`, the trainer's own step)
is built on this process's real devices instead of libtpu's deviceless ones, its abstract
arguments made concrete on their shardings (floats 0, integers 1: a step's time and memory
do not depend on the values), and called ``N`` times. Measured:

- peak HBM per device: ``peak_bytes_in_use + peak_bytes_reserved`` of
  ``Device.memory_stats()`` (on a TPU the program's temporaries are reserved apart from
  ``bytes_in_use``), the largest over the devices, against the plan's peak;
- the step time: the median of the steps after the first (the first compiles), each
  timed until its results are ready, against the plan's floor and estimate;
- the MFU: the step's model FLOPs over ``step time x peak FLOP/s x chips``;
- the executable's own ``memory_analysis()``: the steps run the program compiled here
  (``lower`` + ``compile`` on the concrete arguments, timed in the first step), so its
  arguments, outputs, aliased bytes, temporaries and code, against the plan's, tell a
  compile that differs from the plan's apart from a runtime holding less than its program.

A program the chip cannot hold fails in the run with ``RESOURCE_EXHAUSTED``; that is a
measurement too (``fits`` false), the plan's refusal checked against the chip's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

from posttrain import sharding
from posttrain.plan import chips, headroom, profile, report, topology
from posttrain.plan import compile as plan_compile


@dataclasses.dataclass(frozen=True, kw_only=True)
class Measured:
    """One program run on the chips.

    Attributes:
      steps: steps run (0 when the first did not fit).
      step_seconds: median wall time of the steps after the first, each until its
        results were ready (the only step's time when ``steps`` is 1).
      first_step_seconds: the first step's, compile included.
      peak_bytes: the largest ``peak_bytes_in_use + peak_bytes_reserved`` over the devices
        (0 where the runtime gives no memory statistics).
      bytes_limit: the smallest ``bytes_limit`` over the devices: the HBM a program may use.
      fits: whether the steps ran (false: the runtime refused them for lack of memory).
      error: the runtime's first line when it refused them, else ``""``.
      compiled: the ``memory_analysis()`` of the executable the steps ran, compiled on
        these devices (:func:`posttrain.plan.report.memory_of`: ``arguments``,
        ``outputs``, ``aliased``, ``temporaries``, ``code``, bytes a device holds); ``{}``
        when the compiler refused the program or the backend gives none (and in records
        written before it was measured).
      headroom_bytes: the largest ballast per device beside which one more step ran
        (:func:`posttrain.plan.headroom.probe`, ``--probe-headroom``); -1 when not probed.
    """

    steps: int
    step_seconds: float
    first_step_seconds: float
    peak_bytes: int
    bytes_limit: int
    fits: bool = True
    error: str = ""
    compiled: dict = dataclasses.field(default_factory=dict)
    headroom_bytes: int = -1


def concrete(tree):
    """``tree`` with each ``ShapeDtypeStruct`` leaf made an array on its sharding: floats
    0, integers and booleans 1 (masks on, token ids in range).

    One compiled program makes every leaf that has a sharding, a second the others. A
    program per leaf cost a model of unstacked layers hundreds of compiles, each dearer on
    a TPU host than on a CPU (issue 54).
    """
    leaves, treedef = jax.tree.flatten(tree)
    specs = {i: leaf for i, leaf in enumerate(leaves) if isinstance(leaf, jax.ShapeDtypeStruct)}
    for placed in (True, False):
        group = {i: s for i, s in specs.items() if (s.sharding is not None) == placed}
        if not group:
            continue
        shapes = list(group.values())

        def make(shapes=shapes):
            return [jnp.full(s.shape, _fill(s.dtype), s.dtype) for s in shapes]

        shardings = [s.sharding for s in shapes] if placed else None
        for i, value in zip(group, jax.jit(make, out_shardings=shardings)(), strict=True):
            leaves[i] = value
    return jax.tree.unflatten(treedef, leaves)


def _fill(dtype) -> int:
    return 0 if jnp.issubdtype(dtype, jnp.floating) else 1


def _made_concrete(arg):
    if isinstance(arg, nnx.Module | nnx.Optimizer):
        nnx.update(arg, concrete(nnx.state(arg)))
        return arg
    return concrete(arg)


def memory_peak(devices) -> tuple[int, int]:
    """``(max peak_bytes_in_use + peak_bytes_reserved, min bytes_limit)`` over ``devices``;
    ``(0, 0)`` where the runtime keeps no statistics."""
    peaks, limits = [], []
    for device in devices:
        stats = device.memory_stats() or {}
        peaks.append(
            int(stats.get("peak_bytes_in_use", 0)) + int(stats.get("peak_bytes_reserved", 0))
        )
        limits.append(int(stats.get("bytes_limit", 0)))
    return max(peaks, default=0), min(limits, default=0)


def run_program(
    program, steps: int, devices, profile_dir: str | None = None, probe_headroom: bool = False
) -> Measured:
    """Compiles ``program`` (:class:`posttrain.plan.steps.Program`) on its concrete
    arguments and runs that executable ``steps`` times; each step timed until its results
    are ready, the first from before the compile. With ``profile_dir``, the steps after
    the first run under :func:`posttrain.plan.profile.capture` into it. With
    ``probe_headroom`` (and a runtime that reports ``bytes_limit``), the steps are then
    run beside ballast (:func:`probe_headroom_of`).

    Raises:
      ValueError: ``steps`` < 1.
    """
    if steps < 1:
        raise ValueError(f"run_steps={steps} must be >= 1")
    args = tuple(_made_concrete(a) for a in program.args)
    seconds, memory = [], {}
    try:
        start = time.perf_counter()
        # the steps run this executable: its memory analysis is the program the chips ran
        executable = program.jitted.lower(*args, **program.kwargs).compile()
        memory = report.memory_of(executable)
        with contextlib.ExitStack() as tracing:
            for index in range(steps):
                if index == 1 and profile_dir is not None:  # the steps after the compile
                    tracing.enter_context(profile.capture(profile_dir))
                jax.block_until_ready(executable(*args, **program.kwargs))
                done = time.perf_counter()
                seconds.append(done - start)
                start = done
    except Exception as e:  # XlaRuntimeError: RESOURCE_EXHAUSTED when it does not fit
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
        peak, limit = memory_peak(devices)
        return Measured(
            steps=len(seconds),
            step_seconds=0.0,
            first_step_seconds=seconds[0] if seconds else 0.0,
            peak_bytes=peak,
            bytes_limit=limit,
            fits=False,
            error=first[:240],
            compiled=memory,
        )
    peak, limit = memory_peak(devices)
    steady = seconds[1:] or seconds
    probed = -1
    if probe_headroom and limit > 0:
        probed = probe_headroom_of(program, executable, devices, limit)
    return Measured(
        steps=steps,
        step_seconds=statistics.median(steady),
        first_step_seconds=seconds[0],
        peak_bytes=peak,
        bytes_limit=limit,
        compiled=memory,
        headroom_bytes=probed,
    )


def ballast(size: int, devices) -> list:
    """``size`` bytes (int8 zeros) made on each of ``devices``."""
    return [
        jax.jit(
            functools.partial(jnp.zeros, (size,), jnp.int8),
            out_shardings=jax.sharding.SingleDeviceSharding(device),
        )()
        for device in devices
    ]


def probe_headroom_of(program, executable, devices, limit: int) -> int:
    """:func:`posttrain.plan.headroom.probe` of ``executable``: before each try the
    program's arguments are made anew (a step refused after dispatch has consumed its
    donated ones), then the ballast is held on ``devices``, then one step runs."""
    args: list = []

    def step():
        jax.block_until_ready(executable(*args, **program.kwargs))

    def hold(size: int):
        args[:] = [_made_concrete(a) for a in program.args]  # before the ballast
        return ballast(size, devices)

    return headroom.probe(step, hold, limit)


def measure(options) -> Measured:
    """Builds ``options``' SFT step on this process's chips and runs it
    ``options.run_steps`` times (:func:`run_program`).

    Raises:
      ValueError: the devices here are not the topology's
        (:func:`posttrain.plan.chips.chip_devices`).
    """
    topo = topology.get(options.topology)
    devices = chips.chip_devices(topo)
    _, programs, mesh = plan_compile.build_programs(options, topo)
    program = programs[plan_compile.main_stage(programs)]
    with sharding.use_mesh(mesh, sharding.DEFAULT_RULES, jax_context=False):
        return run_program(
            program, options.run_steps, devices, options.profile_dir, options.probe_headroom
        )
