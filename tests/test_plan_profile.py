"""``posttrain plan --run-steps N --profile DIR`` (:mod:`posttrain.plan.profile`): the trace
taken around the steps after the first, and the device's ops read back from it.

The device's events exist only on an accelerator: here a trace in the layout JAX 0.10.2
wrote on the lent v5e (``/device:TPU:0`` with ``Steps``, ``XLA Modules``, ``XLA Ops``
threads) is built by hand, and the real profiler runs on the CPU, whose trace has no device
ops and is refused in one line."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import re

import jax
import jax.numpy as jnp
import pytest

from posttrain.plan import chips as chips_module
from posttrain.plan import measure, profile
from tests.test_plan_chip import _Program


def _trace(events: list[dict]) -> dict:
    """A v5e-shaped trace: TPU 0 (pid 3) and TPU 1 (pid 4) with their threads, the host
    (pid 701), and ``events``: ``(pid, tid, name, ts, dur[, category])`` in microseconds."""
    meta = [
        {"ph": "M", "pid": 3, "name": "process_name", "args": {"name": "/device:TPU:0"}},
        {"ph": "M", "pid": 4, "name": "process_name", "args": {"name": "/device:TPU:1"}},
        {"ph": "M", "pid": 701, "name": "process_name", "args": {"name": "/host:CPU"}},
    ]
    for pid in (3, 4):
        for tid, name in ((1, "Steps"), (2, "XLA Modules"), (3, "XLA Ops")):
            meta.append(
                {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}}
            )
    meta.append(
        {"ph": "M", "pid": 701, "tid": 9, "name": "thread_name", "args": {"name": "python3"}}
    )
    xs = []
    for pid, tid, name, ts, dur, *category in events:
        e = {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}
        if category:
            e["args"] = {"hlo_category": category[0]}
        xs.append(e)
    return {"displayTimeUnit": "ns", "traceEvents": meta + xs}


#: two steps on TPU 0: a while loop (100 us) holding two fusions, then a fusion and a
#: convolution; the same op names on TPU 1, the Steps thread and the host, all ignored
EVENTS = [
    (3, 3, "while.1", 0.0, 100.0, "control flow"),
    (3, 3, "fusion.1", 10.0, 30.0, "loop fusion"),
    (3, 3, "fusion.2", 50.0, 40.0),
    (3, 3, "fusion.1", 120.0, 30.0, "loop fusion"),
    (3, 3, "convolution.4", 200.0, 50.0, "convolution"),
    (3, 1, "step 1", 0.0, 250.0),
    (4, 3, "fusion.1", 0.0, 900.0),
    (701, 9, "fusion.1", 0.0, 900.0),
]


def test_each_op_is_its_own_time_on_the_first_device_nothing_counted_twice():
    """The loop's 100 us less its body's 70: 30; fusion.1 twice, 60; the busy time is the
    thread's covered time (180 us), not the 250 of the durations summed."""
    found = profile.summary(_trace(EVENTS), steps=2)
    assert found.device == "/device:TPU:0" and found.steps == 2
    got = [(op.name, op.category, op.count, round(op.seconds * 1e6, 6)) for op in found.ops]
    assert got == [
        ("fusion.1", "loop fusion", 2, 60.0),
        ("convolution.4", "convolution", 1, 50.0),
        ("fusion.2", "", 1, 40.0),
        ("while.1", "control flow", 1, 30.0),
    ]
    assert found.busy_seconds == pytest.approx(180e-6)


@pytest.mark.parametrize(
    ("events", "own"),
    [
        ([(0, 10), (10, 5)], [10, 5]),  # back to back: the second starts as the first ends
        ([(0, 10), (2, 3), (6, 2)], [5, 3, 2]),  # two children
        ([(0, 10), (1, 8), (2, 3)], [2, 5, 3]),  # a grandchild counts against its parent only
        ([(5, 3), (0, 20)], [3, 17]),  # listed out of order
    ],
    ids=["siblings", "children", "grandchild", "unordered"],
)
def test_self_times_subtract_only_the_directly_nested(events, own):
    listed = [{"ts": ts, "dur": dur} for ts, dur in events]
    assert profile.self_times(listed) == own


def test_the_table_gives_each_op_per_step_and_the_busy_share_of_the_step():
    """Per step (2 steps): busy 90 us of a 0.2 ms step (45%); fusion.1 30 us = 0.03 ms a
    step, a third of the busy time, once a step; top=2 keeps two op rows."""
    found = profile.summary(_trace(EVENTS), steps=2)
    lines = profile.table(found, step_seconds=0.2e-3, top=2).splitlines()
    assert (
        lines[0]
        == "profile of 2 steps on /device:TPU:0: busy 0.1 ms a step of 0.2 ms (45.0%); 4 ops"
    )
    assert lines[2].split() == ["fusion.1", "loop", "fusion", "0.03", "33.3%", "1.0"]
    assert lines[3].split()[0] == "convolution.4"
    assert len(lines) == 5 and lines[4].startswith("by category: loop fusion 0.0 ms, ")
    assert "(none)" in lines[4]  # fusion.2 has no category


def test_the_record_holds_the_top_ops_as_plain_values():
    found = profile.summary(_trace(EVENTS), steps=2)
    written = json.loads(json.dumps(profile.record(found, top=1)))
    assert written["device"] == "/device:TPU:0" and written["steps"] == 2
    assert written["ops"] == [
        {"name": "fusion.1", "category": "loop fusion", "count": 2, "seconds": pytest.approx(6e-5)}
    ]


def test_a_trace_without_device_ops_and_bad_steps_are_refused():
    host_only = {"traceEvents": [e for e in _trace([])["traceEvents"] if e["pid"] == 701]}
    match = r"no device with an 'XLA Ops' thread \(processes: \['/host:CPU'\]\)"
    with pytest.raises(ValueError, match=match):
        profile.summary(host_only, 1)
    with pytest.raises(ValueError, match="steps=0 must be >= 1"):
        profile.summary(_trace(EVENTS), 0)


def test_read_takes_the_newest_trace_under_the_directory(tmp_path):
    with pytest.raises(
        FileNotFoundError, match=re.escape(f"no *.trace.json.gz under '{tmp_path}'")
    ):
        profile.read(tmp_path, 1)
    older = tmp_path / "plugins" / "profile" / "b" / "host.trace.json.gz"
    older.parent.mkdir(parents=True)
    with gzip.open(older, "wt") as f:
        json.dump(_trace([]), f)
    newer = tmp_path / "plugins" / "profile" / "a" / "host.trace.json.gz"
    newer.parent.mkdir(parents=True)
    with gzip.open(newer, "wt") as f:
        json.dump(_trace(EVENTS), f)
    os.utime(older, (1, 1))
    assert profile.read(tmp_path, 2).ops[0].name == "fusion.1"


def test_the_real_trace_is_written_and_read_only_where_a_device_ran_ops(tmp_path):
    """The real profiler: a trace lands under the directory. On the CPU its processes
    are the host's, so the summary refuses it in one line; on an accelerator (the v5e
    tier, issue 54) the device's op thread is read, and its ops' self times are
    positive and within the busy time."""
    f = jax.jit(lambda x: jnp.sin(x @ x).sum())
    x = jnp.ones((64, 64))
    f(x).block_until_ready()
    with profile.capture(tmp_path):
        f(x).block_until_ready()
    assert profile.trace_file(tmp_path).name.endswith(".trace.json.gz")
    if jax.default_backend() == "cpu":
        with pytest.raises(ValueError, match="no device with an 'XLA Ops' thread"):
            profile.read(tmp_path, 1)
        return
    read = profile.read(tmp_path, 1)
    assert read.steps == 1 and read.ops and read.busy_seconds > 0
    assert all(op.count >= 1 and op.seconds > 0 for op in read.ops)
    assert sum(op.seconds for op in read.ops) <= read.busy_seconds * (1 + 1e-9)


@pytest.mark.parametrize("profile_dir", [None, "trace-here"])
def test_the_trace_covers_the_steps_after_the_first(monkeypatch, profile_dir):
    """--profile: the capture opens after the first step (the compile) and closes after
    the last; without it, no capture."""
    seen = []

    @contextlib.contextmanager
    def capture(log_dir):
        seen.append(("open", log_dir, step.calls))
        yield
        seen.append(("close", log_dir, step.calls))

    monkeypatch.setattr(profile, "capture", capture)
    step = _Program(0, "")  # never fails
    ran = measure.run_program(step, 4, [], profile_dir)
    assert ran.steps == 4 and step.calls == 4
    expected = [("open", profile_dir, 1), ("close", profile_dir, 4)] if profile_dir else []
    assert seen == expected


@pytest.mark.parametrize("probe", [False, True])
def test_the_profile_option_lands_in_the_run_of_the_planned_program(monkeypatch, probe):
    """``PlanOptions.profile_dir`` (``--profile``) and ``probe_headroom``
    (``--probe-headroom``) reach ``run_program``, with the steps and the program the plan
    built (the chips and the compile stood in for: no TPU here)."""
    from posttrain import sharding
    from posttrain.plan import compile as plan_compile
    from posttrain.plan.options import PlanOptions

    program, seen, mesh = object(), [], sharding.make_mesh()

    def chips(topo):
        seen.append(("chips", topo.name))
        return ["chip"]

    def build(given, topo):
        seen.append(("build", given is options, topo.name))
        return None, {"train step": program}, mesh

    def run(*args):
        seen.append(("run", *args, sharding.current().mesh is mesh))
        return "measured"

    monkeypatch.setattr(chips_module, "chip_devices", chips)
    monkeypatch.setattr(plan_compile, "build_programs", build)
    monkeypatch.setattr(measure, "run_program", run)
    options = PlanOptions(
        model="qwen3-tiny",
        topology="v5e-1",
        run_steps=3,
        profile_dir="/tmp/somewhere",
        probe_headroom=probe,
    )
    assert measure.measure(options) == "measured"
    assert seen == [
        ("chips", "v5e-1"),
        ("build", True, "v5e-1"),
        ("run", program, 3, ["chip"], "/tmp/somewhere", probe, True),  # under the mesh
    ]


def _many(count: int = 45) -> dict:
    """A two-step trace of ``count`` ops on TPU 0 at step scale: op.NN runs once a step for
    (NN + 1) ms, the first ten in categories of their own (cat0 ... cat9, op.00 and
    op.10 both in cat0: a category sums its ops), the rest in none."""
    events, ts = [], 0.0
    for _ in range(2):
        for n in range(count):
            dur = (n + 1) * 1000.0
            category = [f"cat{n % 10}"] if n < 10 or n == 10 else []
            events.append((3, 3, f"op.{n:02d}", ts, dur, *category))
            ts += dur
    return _trace(events)


def test_the_table_at_step_scale_line_by_line():
    """Milliseconds a step, shares, runs a step; 15 ops by default; the categories summed
    (cat0: op.00 and op.10, 1 + 11 ms; none: op.11 ... op.44, 12 + ... + 45 = 969 ms),
    the largest eight."""
    found = profile.summary(_many(), steps=2)
    busy = sum(range(1, 46))  # ms a step: 1035
    lines = profile.table(found, step_seconds=2.07).splitlines()
    assert lines[0] == (
        f"profile of 2 steps on /device:TPU:0: busy {busy:.1f} ms a step of 2070.0 ms "
        "(50.0%); 45 ops"
    )
    assert lines[1].split() == ["op", "category", "ms/step", "share", "runs/step"]
    assert len(lines) == 2 + 15 + 1
    assert lines[2].split() == ["op.44", "45.00", f"{45 / busy:.1%}", "1.0"]
    assert lines[2].startswith("op.44" + " " * 40)  # the name column 44 wide
    assert lines[-1] == (
        "by category: (none) 969.0 ms, cat0 12.0 ms, cat9 10.0 ms, cat8 9.0 ms, "
        "cat7 8.0 ms, cat6 7.0 ms, cat5 6.0 ms, cat4 5.0 ms"
    )


def test_a_name_or_category_longer_than_its_column_is_cut_to_it():
    long, kind = "fusion." + "x" * 60, "convolution fusion of a very long kind"
    found = profile.summary(_trace([(3, 3, long, 0.0, 5.0, kind)]), steps=1)
    row = profile.table(found, step_seconds=1.0).splitlines()[2]
    assert row.startswith(f"{long[:44]} {kind[:22]} ") and long[:45] not in row


def test_an_idle_device_has_no_share():
    idle = profile.Summary("/device:TPU:0", 1, 0.0, (profile.OpTime("nop", "", 1, 0.0),))
    assert profile.table(idle, step_seconds=1.0).splitlines()[2].split()[-2] == "0.0%"


def test_the_record_keeps_40_ops_by_default():
    found = profile.summary(_many(), steps=2)
    written = profile.record(found)
    assert sorted(written) == ["busy_seconds", "device", "ops", "steps"]
    assert written["busy_seconds"] == pytest.approx(2 * 1.035)
    assert len(written["ops"]) == 40 and written["ops"][0]["name"] == "op.44"


def test_odd_traces_nameless_metadata_a_host_ops_thread_same_start_nesting():
    """A process or thread named by no args is nobody's; a host thread called XLA Ops is
    not a device's (the device is chosen, not the lowest pid); an op and the op nested in
    it that start together: the outer one is the longer; a trace with no events at all is
    refused like one without device ops."""
    trace = _trace(
        [
            (3, 3, "while.1", 0.0, 10.0),
            (3, 3, "fusion.1", 0.0, 4.0),  # starts with its loop
        ]
    )
    trace["traceEvents"] += [
        # a device of the profiler's own with no ops thread, before TPU 0 (the v5e's trace
        # had one on the CPU: /device:CUSTOM:Megascale Trace), and an ops thread of a
        # process nobody named
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:CUSTOM:x"}},
        {"ph": "M", "pid": 2, "tid": 1, "name": "thread_name", "args": {"name": "Trace"}},
        {"ph": "M", "pid": 0, "tid": 3, "name": "thread_name", "args": {"name": "XLA Ops"}},
        {"ph": "M", "pid": 1, "name": "process_name"},
        {"ph": "M", "pid": 1, "tid": 3, "name": "thread_name", "args": {"name": "XLA Ops"}},
        {"ph": "M", "pid": 3, "tid": 8, "name": "thread_name"},
        {"ph": "X", "pid": 1, "tid": 3, "name": "host.op", "ts": 0.0, "dur": 99.0},
    ]
    found = profile.summary(trace, steps=1)
    assert found.device == "/device:TPU:0"
    assert [(op.name, round(op.seconds * 1e6, 6)) for op in found.ops] == [
        ("while.1", 6.0),
        ("fusion.1", 4.0),
    ]
    with pytest.raises(ValueError, match="no device with an 'XLA Ops' thread"):
        profile.summary({}, 1)
