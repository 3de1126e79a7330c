"""harness.tools.op_profile: which HLO instructions are matmuls, the union of their intervals in
a profiler trace, and the per-kind totals (benchmarks/model_step.py's ceiling and --ops)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import pytest

from harness.tools.op_profile import (
    Profile,
    dot_instructions,
    dot_seconds,
    eigen_dots,
    opcodes,
    profile,
    top_ops,
    union_seconds,
)

pytestmark = pytest.mark.host

#: the same seconds summed in another order (a few float64 roundings of ~1e-3 s)
REORDERED_SUM_RTOL = 1e-12

# A module in XLA's text form with each case by construction: a matmul fusion (the dot as
# its root), a fusion whose dot sits in a nested fusion, a plain dot and a convolution in a
# while body, a loop fusion and a transpose with none (whose metadata names a dot_general,
# as a transpose's may), and names with and without the leading %.
HLO = """HloModule jit_step, is_scheduled=true

%fused_dot (param_0: f32[4,4], param_1: f32[4,4]) -> f32[4,4] {
  %param_0 = f32[4,4]{1,0} parameter(0)
  %param_1 = f32[4,4]{1,0} parameter(1)
  ROOT %dot.1 = f32[4,4]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}
}

%inner (p: f32[4,4]) -> f32[4,4] {
  %p = f32[4,4]{1,0} parameter(0)
  ROOT %dot.2 = f32[4,4]{1,0} dot(%p, %p), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%outer (q: f32[4,4]) -> f32[4,4] {
  %q = f32[4,4]{1,0} parameter(0)
  %nested = f32[4,4]{1,0} fusion(%q), kind=kCustom, calls=%inner
  ROOT %neg.1 = f32[4,4]{1,0} negate(%nested)
}

%relu (r: f32[4,4]) -> f32[4,4] {
  %r = f32[4,4]{1,0} parameter(0)
  %zero = f32[] constant(0)
  %b = f32[4,4]{1,0} broadcast(%zero), dimensions={}
  ROOT %max.1 = f32[4,4]{1,0} maximum(%r, %b)
}

%body (s: f32[4,4]) -> f32[4,4] {
  %s = f32[4,4]{1,0} parameter(0)
  dot.3 = f32[4,4]{1,0} dot(%s, %s), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %conv.1 = f32[1,4,4]{2,1,0} convolution(%s, %s), window={size=1}, dim_labels=b0f_0io->b0f
  ROOT %t.1 = f32[4,4]{0,1} transpose(dot.3), metadata={op_name="jit(step)/dot_general"}
}

ENTRY %main (a: f32[4,4]) -> f32[4,4] {
  %a = f32[4,4]{1,0} parameter(0)
  %ynn_fusion.7 = f32[4,4]{1,0} fusion(%a, %a), kind=kCustom, calls=%fused_dot
  %outer_fusion = f32[4,4]{1,0} fusion(%ynn_fusion.7), kind=kLoop, calls=%outer
  %loop_fusion = f32[4,4]{1,0} fusion(%outer_fusion), kind=kLoop, calls=%relu
  ROOT %while.1 = f32[4,4]{1,0} while(%loop_fusion), condition=%cond, body=%body
}
"""


def test_dot_instructions_are_the_dots_and_the_fusions_holding_one():
    """Dots, convolutions and fusions holding one at any depth; never a loop fusion, a
    transpose whose metadata names a dot, or a while whose body holds dots."""
    assert dot_instructions(HLO) == {
        "dot.1",
        "dot.2",
        "dot.3",
        "conv.1",
        "ynn_fusion.7",
        "nested",
        "outer_fusion",
    }


def test_opcodes_counts_every_instruction_of_every_computation():
    """Each instruction's opcode, in fusion and loop bodies too, with or without ROOT and
    the leading %; a transpose whose metadata names a dot_general is a transpose."""
    assert opcodes(HLO) == {
        "parameter": 7,
        "dot": 3,
        "fusion": 4,
        "negate": 1,
        "constant": 1,
        "broadcast": 1,
        "maximum": 1,
        "convolution": 1,
        "transpose": 1,
        "while": 1,
    }


@pytest.mark.parametrize(
    "intervals, expected",
    [
        ([], 0.0),
        ([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)], 4.0),  # overlapping pair, then a gap
        ([(5.0, 6.0), (0.0, 10.0), (2.0, 3.0)], 10.0),  # unsorted, nested
        ([(0.0, 1.0), (1.0, 2.0)], 2.0),  # touching
    ],
)
def test_union_seconds(intervals, expected):
    assert union_seconds(intervals) == pytest.approx(expected)


def test_top_ops_sums_by_kind_per_call_costliest_first():
    ops = [
        ("copy_fusion.1", 0.0, 1.0),
        ("ynn_fusion", 0.0, 0.5),
        ("copy_fusion.12", 4.0, 6.0),
        ("while", 0.0, 0.25),
    ]
    assert top_ops(Profile(ops, calls=2), most=2) == [("copy_fusion", 1.5), ("ynn_fusion", 0.25)]


def test_dot_seconds_from_a_real_trace():
    """A compiled program of two matmuls and a relu: the trace names both matmuls (once
    per call), and dot_seconds is exactly the union of their events' intervals per call,
    counted here from the trace (XLA:CPU runs these fusions synchronously: no Eigen
    dot's gap to add), leaving out the relu between them: inside the ops' span, which
    lies inside a call's wall time. Every figure is read from the same trace, so load
    (which stretches any op) changes none of these relations; how much of a step the
    matmuls take is benchmarks/model_step.py's to report, not a gate's to assert. A
    profile whose matmuls are missing is an error."""
    f = jax.jit(lambda a, b: jax.nn.relu(a @ b) @ b)
    a = jnp.ones((256, 256), jnp.float32)
    hlo = f.lower(a, a).compile().as_text()
    dots = dot_instructions(hlo)  # the two fusions and the dot inside each
    f(a, a).block_until_ready()
    start = time.perf_counter()
    measured = profile(lambda: f(a, a).block_until_ready(), calls=2)
    wall = (time.perf_counter() - start) / 2  # a call's wall time, the profiler's included
    assert measured.calls == 2
    ran = [name for name, _, _ in measured.ops if name in dots]
    assert len(set(ran)) == 2 and len(ran) == 4, ran  # each matmul once per call
    assert not eigen_dots(hlo)  # the hand count below has no gaps to add
    span = union_seconds([(start, end) for _, start, end in measured.ops]) / 2
    by_hand = union_seconds([(start, end) for name, start, end in measured.ops if name in dots])
    seconds = dot_seconds(hlo, measured)
    assert seconds == by_hand / 2
    assert 0 < seconds < span < wall  # the relu's event lies between the matmuls' events
    others = Profile([op for op in measured.ops if op[0] not in dots], calls=2)
    message = "^the profiler trace names none of the module's matmuls$"
    with pytest.raises(RuntimeError, match=message):
        dot_seconds(hlo, others)


# An entry computation with two plain dots (one read through a bitcast, one leaving through
# the ROOT tuple), a matmul fusion, and a while loop and a conditional whose body holds a
# third plain dot.
ASYNC_HLO = """HloModule jit_step, is_scheduled=true

%fused_dot (p0: f32[4,4]) -> f32[4,4] {
  %p0 = f32[4,4]{1,0} parameter(0)
  ROOT %dot.9 = f32[4,4]{1,0} dot(%p0, %p0), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%neg (p1: f32[16]) -> f32[16] {
  %p1 = f32[16]{0} parameter(0)
  ROOT %negate.1 = f32[16]{0} negate(%p1)
}

%body (s: f32[4,4]) -> f32[4,4] {
  %s = f32[4,4]{1,0} parameter(0)
  %dot.3 = f32[4,4]{1,0} dot(%s, %s), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  ROOT %add_fusion = f32[4,4]{1,0} fusion(%dot.3), kind=kLoop, calls=%neg
}

ENTRY %main (a: f32[4,4], b: f32[4,4]) -> (f32[16], f32[4,4]) {
  %a = f32[4,4]{1,0} parameter(0)
  %b = f32[4,4]{1,0} parameter(1)
  %dot.1 = f32[4,4]{1,0} dot(%a, %b), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  %bitcast.1 = f32[16]{0} bitcast(%dot.1)
  %neg_fusion = f32[16]{0} fusion(%bitcast.1), kind=kLoop, calls=%neg
  %dot.2 = f32[4,4]{1,0} dot(%a, %a), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  %ynn_fusion = f32[4,4]{1,0} fusion(%b), kind=kCustom, calls=%fused_dot
  %while.1 = f32[4,4]{1,0} while(%a), condition=%cond, body=%body
  %conditional.1 = f32[4,4]{1,0} conditional(%p, %a, %a), branch_computations={%body, %body}
  ROOT %tuple = (f32[16]{0}, f32[4,4]{1,0}) tuple(%neg_fusion, %dot.2)
}
"""


def test_eigen_dots_are_the_plain_dots_outside_fusion_bodies():
    """The entry's and a while body's plain dots run in Eigen; a dot inside a fusion body
    is part of that fusion (a matmul fusion's, or a nested one's)."""
    assert eigen_dots(ASYNC_HLO) == {"dot.1", "dot.2", "dot.3"}
    assert eigen_dots(HLO) == {"dot.3", "conv.1"}  # the while body's; the rest are fused


def test_dot_seconds_counts_the_gap_after_an_eigen_dot_s_event():
    """An Eigen dot's event may end at hand-off: the idle time after it, from when the ops
    running at its end are done until the next op starts, counts as the dot's. dot.1: 1 s
    and the gap [2, 3] after other_fusion; dot.2: 0.5 s and [6, 6.5] after neg_fusion;
    dot.3, inside a loop and a conditional whose events span their body: 0.5 s and
    [7.5, 8.5]; dot.2 as the last op: its event; dot.1 while ops run past the next op's
    start: its event; a 0 s event as the first op: the gap to the next op. A matmul fusion counts
    its event only. The events come in any order."""
    ops = [
        ("dot.1", 0.0, 1.0),
        ("other_fusion", 0.5, 2.0),  # on the other core, past dot.1's event
        ("neg_fusion", 3.0, 6.0),  # from before dot.2 to past its event
        ("dot.2", 4.0, 4.5),
        ("ynn_fusion", 6.5, 7.0),
        ("while.1", 7.0, 10.0),
        ("conditional.1", 7.0, 10.0),
        ("dot.3", 7.0, 7.5),
        ("add_fusion", 8.5, 10.0),
        ("dot.1", 12.0, 12.5),
        ("other_fusion", 12.2, 14.0),
        ("neg_fusion", 13.0, 14.5),  # starts while other_fusion still runs: no gap
        ("dot.2", 15.0, 15.5),
    ]
    expected = (2.0 + 1.0 + 0.5 + 1.5 + 0.5 + 0.5) / 2
    assert dot_seconds(ASYNC_HLO, Profile(ops[::-1], calls=2)) == pytest.approx(expected)
    first = [("dot.2", 0.0, 0.0), ("neg_fusion", 1.0, 2.0)]  # a hand-off rounded to 0 us
    assert dot_seconds(ASYNC_HLO, Profile(first, calls=1)) == pytest.approx(1.0)


def test_an_eigen_dot_of_a_real_trace_counts_its_work():
    """On XLA:CPU as installed, a transposed-lhs matmul (a weight gradient's form) is an
    Eigen dot, and dot_seconds counts each of its events from its start to the start of
    the next op (the tanh that waits for its result), whether the event lasted its work or
    only its hand-off to Eigen's threads (both happen; the synthetic case above pins the
    rule): counted here from the same trace, so load changes none of it; less than a
    call's wall time."""
    f = jax.jit(lambda a, b: jnp.tanh(a.T @ b))
    a, b = jnp.ones((1024, 256), jnp.float32), jnp.ones((1024, 768), jnp.float32)
    hlo = f.lower(a, b).compile().as_text()
    (dot,) = eigen_dots(hlo)
    f(a, b).block_until_ready()
    start = time.perf_counter()
    measured = profile(lambda: f(a, b).block_until_ready(), calls=5)
    wall = (time.perf_counter() - start) / 5  # a call's wall time, the profiler's included
    assert dot in {name for name, _, _ in measured.ops}
    events = [(start, end) for _, start, end in measured.ops]
    one_at_a_time = sum(e - s for s, e in events)
    assert union_seconds(events) == pytest.approx(one_at_a_time, rel=REORDERED_SUM_RTOL)
    starts = sorted(start for start, _ in events)
    by_hand = sum(
        max(end, min((s for s in starts if s >= end and s > start), default=end)) - start
        for name, start, end in measured.ops
        if name == dot
    )
    own = sum(end - start for name, start, end in measured.ops if name == dot)
    seconds = dot_seconds(hlo, measured)
    assert seconds == pytest.approx(by_hand / 5, rel=REORDERED_SUM_RTOL)
    assert own / 5 <= seconds < wall
