"""Where a compiled step's time goes, read from a JAX profiler trace: its ops, its matmuls.

Used by ``benchmarks/model_step.py`` for the ceiling of its "share" (a step whose every
other op took no time would still take its dots' time, so ``model FLOPs / dot seconds``
is the most GFLOP/s that step's matmuls, at the shapes XLA gave them, can reach) and
for its ``--ops`` list.

XLA's CPU runtime names each executed op in the trace (``args.hlo_op``, the HLO
instruction's name); an op counts as a dot when it is a ``dot`` or ``convolution``, or
a fusion whose computation holds one (XLA:CPU wraps its matmuls in ``ynn_fusion`` /
``onednn`` fusions, sometimes with an elementwise op fused in: that op's time is
counted as the dot's, which only raises the ceiling). Ops of one step may run at once
on the runtime's threads, so the figure is the union of the dots' intervals, not their
sum.

A plain ``dot`` or ``convolution`` outside a fusion runs in Eigen, asynchronously
(:func:`eigen_dots`): its trace event often ends when the contraction is handed to
Eigen's threads while the work goes on. A ``[2048, 256]^T [2048, 768]`` weight gradient of
~4 ms shows as a 0.5 ms event, then a gap in which no op runs (in the dense model step,
after the weight gradients of each layer's MLP). The gap right after such a dot's event,
until the next op starts, counts as the dot's; any part of its work that overlaps later
ops does not, so the ceiling stays an upper bound.
"""

from __future__ import annotations

import bisect
import collections
import glob
import gzip
import json
import re
import tempfile
from collections.abc import Callable
from typing import NamedTuple

import jax

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.-]+)\s*\(.*\)\s*->.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.-]+)\s*=\s*.*?\s([a-z][a-z0-9-]*)\(")
_CALLS = re.compile(r"calls=%?([\w.-]+)")
_DOT_OPCODES = frozenset({"dot", "convolution"})


Instruction = tuple[str, str, list[str]]  # (name, opcode, the computations it calls)


def _instructions(hlo: str) -> dict[str, list[Instruction]]:
    """``{computation: [(instruction, opcode, called computations)]}`` of an HLO module's
    text."""
    computations: dict[str, list[Instruction]] = {}
    current: list[Instruction] = []  # before the first computation: none
    for line in hlo.splitlines():
        if m := _COMPUTATION.match(line):
            current = computations.setdefault(m.group(1), [])
        elif m := _INSTRUCTION.match(line):
            current.append((m.group(1), m.group(2), _CALLS.findall(line)))
    return computations


def dot_instructions(hlo: str) -> set[str]:
    """Names of the instructions of an HLO module's text that are matmuls: ``dot`` and
    ``convolution`` instructions, and fusions whose called computation holds one
    (directly or through a nested fusion)."""
    holds = _instructions(hlo)
    memo: dict[str, bool] = {}

    def is_dot(op: str, calls: list[str]) -> bool:
        return op in _DOT_OPCODES or (op == "fusion" and any(map(has_dot, calls)))

    def has_dot(computation: str) -> bool:
        if computation not in memo:  # HLO's calls form no cycle
            memo[computation] = any(is_dot(op, calls) for _, op, calls in holds[computation])
        return memo[computation]

    return {
        name
        for instructions in holds.values()
        for name, op, calls in instructions
        if is_dot(op, calls)
    }


def eigen_dots(hlo: str) -> set[str]:
    """The plain ``dot`` and ``convolution`` instructions outside fusion bodies (the entry
    computation, ``while`` bodies ...): XLA:CPU runs them in Eigen, asynchronously."""
    computations = _instructions(hlo)
    fused = {  # the computations fusions call
        called
        for instructions in computations.values()
        for _, op, calls in instructions
        if op == "fusion"
        for called in calls
    }
    return {
        name
        for computation, instructions in computations.items()
        if computation not in fused
        for name, op, _ in instructions
        if op in _DOT_OPCODES
    }


def opcodes(hlo: str) -> collections.Counter:
    """How often each opcode occurs in an HLO module's text, fusion bodies included."""
    return collections.Counter(
        m.group(2) for line in hlo.splitlines() if (m := _INSTRUCTION.match(line))
    )


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``(start, end)`` intervals as disjoint intervals, sorted."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    return sum(end - start for start, end in _merged(intervals))


class Profile(NamedTuple):
    """The ops of ``calls`` calls of one program: ``ops`` holds ``(HLO instruction, start
    s, end s)`` for every op XLA's runtime executed."""

    ops: list[tuple[str, float, float]]
    calls: int


def profile(run: Callable[[], object], calls: int) -> Profile:
    """Runs ``run`` (one call of a compiled program, blocking on its result) ``calls``
    times under a JAX profiler trace and reads back the ops it executed."""
    with tempfile.TemporaryDirectory() as directory:
        jax.profiler.start_trace(directory)
        try:
            for _ in range(calls):
                run()
        finally:
            jax.profiler.stop_trace()
        # the trace in Chrome's JSON form, which jax.profiler writes beside its XSpace
        (path,) = glob.glob(f"{directory}/**/*.trace.json.gz", recursive=True)
        with gzip.open(path) as f:
            events = json.load(f)["traceEvents"]
    ops = [
        (e["args"]["hlo_op"], e["ts"] * 1e-6, (e["ts"] + e["dur"]) * 1e-6)  # us -> s
        for e in events
        if e.get("ph") == "X" and "hlo_op" in (e.get("args") or {})
    ]
    return Profile(ops, calls)


def _gap_after(busy: list[tuple[float, float]], end: float, done: float):
    """``[(start, done)]``: the idle part of ``[end, done]``, which begins once the ops
    running at ``end`` are done (``busy``, :func:`_merged`, holds every op; ``done`` is the
    next op's start, so no op starts in between); empty if there is none."""
    holding = bisect.bisect_right(busy, (end,)) - 1  # the busy stretch that began before end
    start = max(end, busy[holding][1]) if holding >= 0 else end
    return [(start, done)] if start < done else []


def dot_seconds(hlo: str, measured: Profile) -> float:
    """Seconds per call during which at least one matmul of the program whose HLO text is
    ``hlo`` ran (:func:`dot_instructions`), from its :func:`profile`; an asynchronous
    (Eigen) dot's also the time no traced op runs while it is outstanding (module
    docstring).

    Raises:
      RuntimeError: the profile names none of the program's matmuls (another program's
        profile, or a runtime that no longer names its ops).
    """
    dots, eigen = dot_instructions(hlo), eigen_dots(hlo)
    loops = {  # a loop's or conditional's event spans its body's ops: no op of its own
        name
        for instructions in _instructions(hlo).values()
        for name, op, _ in instructions
        if op in ("while", "conditional")
    }
    ops = sorted((op for op in measured.ops if op[0] not in loops), key=lambda op: op[1])
    starts = [op_start for _, op_start, _ in ops]
    busy = _merged([(op_start, op_end) for _, op_start, op_end in ops])
    intervals = []
    for at, (op, start, end) in enumerate(ops):
        if op in eigen:  # outstanding in the idle time until the next op starts
            after = max(at + 1, bisect.bisect_left(starts, end))  # not itself, if it took 0 s
            intervals += _gap_after(busy, end, starts[after] if after < len(starts) else end)
        if op in dots:
            intervals.append((start, end))
    if not intervals:
        raise RuntimeError("the profiler trace names none of the module's matmuls")
    return union_seconds(intervals) / measured.calls


def top_ops(measured: Profile, most: int) -> list[tuple[str, float]]:
    """``[(op kind, seconds per call)]``, the ``most`` costliest: the instructions' names
    without their ``.N`` suffix (``copy_fusion``, ``ynn_fusion``, ``while`` ...), summed.
    A ``while`` or ``conditional`` holds its body's ops, which are listed too."""
    totals: dict[str, float] = {}
    for op, start, end in measured.ops:
        kind = re.sub(r"\.\d+$", "", op)
        totals[kind] = totals.get(kind, 0.0) + (end - start) / measured.calls
    return sorted(totals.items(), key=lambda item: -item[1])[:most]
