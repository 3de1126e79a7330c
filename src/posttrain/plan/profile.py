"""``posttrain plan --run-steps N --profile DIR``: where the chip's step time goes.

The steps after the first (which compiles) run under JAX's profiler with the Python and
host tracers off (:func:`capture`): a TPU step of a 0.6B model is about 10^5 device ops, and
with the Python tracer on the host's events fill the trace's million-event limit before the
chip's (seen on a lent v5e, issue 55). The trace lands in ``DIR`` (TensorBoard's
``plugins/profile/<run>/`` layout: ``*.xplane.pb`` for XProf, ``*.trace.json.gz`` for
Perfetto), and :func:`summary` reads the ``trace.json.gz`` back into the ops that took the
device's time (:func:`table`).

The ``trace.json.gz`` is the Chrome trace event format: ``traceEvents``, with ``"M"``
metadata events naming each process (``/device:TPU:0``, ``/host:CPU``) and thread
(``XLA Ops``, ``XLA Modules``, ``Steps``), and ``"X"`` complete events with ``dur`` in
microseconds. Source: the Trace Event Format document (Google, 2016), and the trace JAX
0.10.2's profiler wrote on the v5e.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import json
import pathlib
from collections import defaultdict

import jax

#: the thread of a device's trace whose events are its HLO ops, one event per op run
OPS_THREAD = "XLA Ops"


@dataclasses.dataclass(frozen=True)
class OpTime:
    """One op's share of the profiled steps on one device.

    Attributes:
      name: the HLO op's name (``fusion.123``, ``convolution.4``, a custom call's).
      category: its ``hlo_category`` argument where the trace gives one, else ``""``.
      count: times it ran in the profiled steps.
      seconds: its total time over the profiled steps.
    """

    name: str
    category: str
    count: int
    seconds: float


@dataclasses.dataclass(frozen=True)
class Summary:
    """What the device did in the profiled steps.

    Attributes:
      device: the process the ops ran on (``/device:TPU:0``).
      steps: the steps profiled.
      busy_seconds: the ops' total time (the device's busy time).
      ops: every op, the longest total first.
    """

    device: str
    steps: int
    busy_seconds: float
    ops: tuple[OpTime, ...]


@contextlib.contextmanager
def capture(log_dir: str | pathlib.Path):
    """Traces what runs inside it into ``log_dir``, the device's ops without the host's
    Python events (module docstring)."""
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    options.host_tracer_level = 0
    jax.profiler.start_trace(str(log_dir), profiler_options=options)
    try:
        yield
    finally:
        jax.profiler.stop_trace()


def trace_file(log_dir: str | pathlib.Path) -> pathlib.Path:
    """The newest ``*.trace.json.gz`` under ``log_dir``.

    Raises:
      FileNotFoundError: none there (the profiler wrote no trace).
    """
    found = sorted(pathlib.Path(log_dir).rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no *.trace.json.gz under {str(log_dir)!r}")
    return found[-1]


def self_times(events: list[dict]) -> list[float]:
    """Each event's ``dur`` less the ``dur`` of the events nested directly inside it (a
    loop's op spans its body's ops on the same thread): what the op itself took, so the
    times sum to the thread's busy time, nothing counted twice. Same order as ``events``."""
    order = sorted(range(len(events)), key=lambda i: (events[i]["ts"], -events[i]["dur"]))
    own = [float(e["dur"]) for e in events]
    stack: list[int] = []  # the open events enclosing the current one, innermost last
    for i in order:
        start = events[i]["ts"]
        while stack and start >= events[stack[-1]]["ts"] + events[stack[-1]]["dur"]:
            stack.pop()
        if stack:
            own[stack[-1]] -= events[i]["dur"]
        stack.append(i)
    return own


def summary(trace: dict, steps: int) -> Summary:
    """The ops of the first device in ``trace`` (a decoded ``trace.json.gz``) that has an
    ``XLA Ops`` thread, summed by name over ``steps`` profiled steps.

    Raises:
      ValueError: ``steps`` < 1, or no device in the trace has an ``XLA Ops`` thread (a
        trace of the CPU backend, or one whose device events were dropped).
    """
    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1")
    events = trace.get("traceEvents", [])
    processes, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[e["pid"]] = e.get("args", {}).get("name", "")
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e["tid"])] = e.get("args", {}).get("name", "")
    devices = sorted(
        pid
        for (pid, _), name in threads.items()
        if name == OPS_THREAD and processes.get(pid, "").startswith("/device:")
    )
    if not devices:
        raise ValueError(
            f"the trace has no device with an {OPS_THREAD!r} thread (processes: "
            f"{sorted(set(processes.values()))})"
        )
    pid = devices[0]
    ops = [
        e
        for e in events
        if e.get("ph") == "X"
        and e.get("pid") == pid
        and threads.get((pid, e.get("tid"))) == OPS_THREAD
    ]
    totals: dict[str, list] = defaultdict(lambda: ["", 0, 0.0])
    for e, own in zip(ops, self_times(ops), strict=True):
        entry = totals[e["name"]]
        entry[0] = entry[0] or str(e.get("args", {}).get("hlo_category", ""))
        entry[1] += 1
        entry[2] += own * 1e-6
    ops = tuple(
        sorted(
            (OpTime(name, c, n, s) for name, (c, n, s) in totals.items()),
            key=lambda op: (-op.seconds, op.name),
        )
    )
    return Summary(processes[pid], steps, sum(op.seconds for op in ops), ops)


def read(log_dir: str | pathlib.Path, steps: int) -> Summary:
    """:func:`summary` of the newest trace under ``log_dir``.

    Raises:
      FileNotFoundError: no trace there; ValueError: as :func:`summary`.
    """
    with gzip.open(trace_file(log_dir), "rt") as f:
        return summary(json.load(f), steps)


def table(s: Summary, step_seconds: float, top: int = 15) -> str:
    """The ``top`` longest ops per step, for stdout: each op's milliseconds a step, its
    share of the device's busy time, its count a step; the busy time against the measured
    ``step_seconds`` (the rest: the device idle, waiting on the host or between programs),
    and by category."""
    per_step = s.busy_seconds / s.steps
    lines = [
        f"profile of {s.steps} steps on {s.device}: busy {per_step * 1e3:.1f} ms a step of "
        f"{step_seconds * 1e3:.1f} ms ({per_step / step_seconds:.1%}); {len(s.ops)} ops",
        f"{'op':<44} {'category':<22} {'ms/step':>9} {'share':>7} {'runs/step':>9}",
    ]
    for op in s.ops[:top]:
        share = op.seconds / s.busy_seconds if s.busy_seconds else 0.0
        lines.append(
            f"{op.name[:44]:<44} {op.category[:22]:<22} {op.seconds / s.steps * 1e3:>9.2f} "
            f"{share:>7.1%} {op.count / s.steps:>9.1f}"
        )
    by_category: dict[str, float] = defaultdict(float)
    for op in s.ops:
        by_category[op.category or "(none)"] += op.seconds
    ranked = sorted(by_category.items(), key=lambda kv: -kv[1])
    lines.append(
        "by category: " + ", ".join(f"{c} {t / s.steps * 1e3:.1f} ms" for c, t in ranked[:8])
    )
    return "\n".join(lines)


def record(s: Summary, top: int = 40) -> dict:
    """``s`` for the plan's JSON record: the device, steps, busy seconds and the ``top``
    ops (name, category, count, seconds over the profiled steps)."""
    return {
        "device": s.device,
        "steps": s.steps,
        "busy_seconds": s.busy_seconds,
        "ops": [dataclasses.asdict(op) for op in s.ops[:top]],
    }
