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

A plain ``dot`` or ``convolution`` instruction runs in Eigen, asynchronously: its trace
event often ends when the contraction is handed to Eigen's threads, while the work goes
on (a ``[2048, 256]^T [2048, 768]`` weight gradient of ~4 ms shows as a 0.5 ms event, then
a gap with no op; in the model step, all 29 weight gradients). Such a dot is outstanding until the first traced op that reads its
result starts (:func:`async_dot_readers`), or, if its result leaves the program, until
the call ends; the time in that window when no traced op runs is counted as its own.
That leaves out the part of its work that overlaps other ops, so the ceiling stays an
upper bound.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import re
import tempfile
from collections.abc import Callable
from typing import NamedTuple

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.-]+)\s*\(.*\)\s*->.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.-]+)\s*=\s*.*?\s([a-z][a-z0-9-]*)\(")
_CALLS = re.compile(r"calls=%?([\w.-]+)")
_OPERANDS = re.compile(r"%([\w.-]+)")
_DOT_OPCODES = frozenset({"dot", "convolution"})


def dot_instructions(hlo: str) -> set[str]:
    """Names of the instructions of an HLO module's text that are matmuls: ``dot`` and
    ``convolution`` instructions, and fusions whose called computation holds one
    (directly or through a nested fusion)."""
    holds: dict[str, list[tuple[str, str, list[str]]]] = {}
    current: list[tuple[str, str, list[str]]] = []  # before the first computation: none
    for line in hlo.splitlines():
        if m := _COMPUTATION.match(line):
            current = holds.setdefault(m.group(1), [])
        elif m := _INSTRUCTION.match(line):
            current.append((m.group(1), m.group(2), _CALLS.findall(line)))
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


def async_dot_readers(hlo: str) -> dict[str, set[str]]:
    """``{dot: readers}`` for each plain ``dot`` or ``convolution`` of the module's entry
    computation (an Eigen op, asynchronous in XLA:CPU's runtime): the instructions that read
    its result, through any number of ``bitcast``, ``tuple`` and ``get-tuple-element``
    (which the runtime does not trace)."""
    entry: dict[str, tuple[str, set[str]]] = {}  # name -> (opcode, operands)
    inside = False
    for line in hlo.splitlines():
        if m := _COMPUTATION.match(line):
            inside = line.lstrip().startswith("ENTRY")
        elif inside and (m := _INSTRUCTION.match(line)):
            args = line[m.end() :].split(")", 1)[0]  # the operand list
            entry[m.group(1)] = (m.group(2), set(_OPERANDS.findall(args)))
    untraced = {"bitcast", "tuple", "get-tuple-element"}

    def readers(name: str) -> set[str]:
        found = set()
        for reader, (op, operands) in entry.items():
            if name in operands:
                found |= readers(reader) if op in untraced else {reader}
        return found

    return {name: readers(name) for name, (op, _) in entry.items() if op in _DOT_OPCODES}


def opcodes(hlo: str) -> collections.Counter:
    """How often each opcode occurs in an HLO module's text, fusion bodies included."""
    return collections.Counter(
        m.group(2) for line in hlo.splitlines() if (m := _INSTRUCTION.match(line))
    )


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


class Profile(NamedTuple):
    """The ops of ``calls`` calls of one program: ``ops`` holds ``(HLO instruction, start
    s, end s)`` for every op XLA's runtime executed, ``spans`` ``(start s, end s)`` of each
    call (empty where unknown)."""

    ops: list[tuple[str, float, float]]
    calls: int
    spans: tuple[tuple[float, float], ...] = ()


_CALL = "op_profile.call"  # the trace annotation around each call


def profile(run: Callable[[], object], calls: int) -> Profile:
    """Runs ``run`` (one call of a compiled program, blocking on its result) ``calls``
    times under a JAX profiler trace and reads back the ops it executed."""
    import jax

    with tempfile.TemporaryDirectory() as directory:
        jax.profiler.start_trace(directory)
        try:
            for _ in range(calls):
                with jax.profiler.TraceAnnotation(_CALL):
                    run()
        finally:
            jax.profiler.stop_trace()
        # the trace in Chrome's JSON form, which jax.profiler writes beside its XSpace
        (path,) = glob.glob(f"{directory}/**/*.trace.json.gz", recursive=True)
        with gzip.open(path) as f:
            events = json.load(f)["traceEvents"]

    def seconds(e):
        return e["ts"] * 1e-6, (e["ts"] + e["dur"]) * 1e-6  # us -> s

    complete = [e for e in events if e.get("ph") == "X"]
    ops = [(e["args"]["hlo_op"], *seconds(e)) for e in complete if "hlo_op" in e.get("args", {})]
    spans = tuple(sorted(seconds(e) for e in complete if e.get("name") == _CALL))
    return Profile(ops, calls, spans)


def _idle(ops: list[tuple[str, float, float]], start: float, end: float):
    """``[(start, end)]``: the parts of ``[start, end]`` in which none of ``ops`` (sorted by
    start) runs."""
    gaps, reach = [], start
    for _, op_start, op_end in ops:  # sorted by start
        if op_start >= end:
            break
        if op_start > reach:
            gaps.append((reach, op_start))
        reach = max(reach, op_end)
    return gaps + ([(reach, end)] if reach < end else [])


def dot_seconds(hlo: str, measured: Profile) -> float:
    """Seconds per call during which at least one matmul of the program whose HLO text is
    ``hlo`` ran (:func:`dot_instructions`), from its :func:`profile`; an asynchronous
    (Eigen) dot's also the time no traced op runs while it is outstanding (module
    docstring).

    Raises:
      RuntimeError: the profile names none of the program's matmuls (another program's
        profile, or a runtime that no longer names its ops).
    """
    dots, readers = dot_instructions(hlo), async_dot_readers(hlo)
    ops = sorted(measured.ops, key=lambda op: op[1])
    intervals = []
    for op, start, end in ops:
        if op in readers:  # an Eigen dot: outstanding until a reader starts or the call ends
            reads = [s for name, s, _ in ops if name in readers[op] and s >= end]
            ends = [span_end for span_start, span_end in measured.spans if span_start <= start]
            done = min(reads or [e for e in ends if e >= end] or [end])
            intervals += _idle(ops, end, done)
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
