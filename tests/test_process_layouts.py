"""Multi-process data layouts the gate never builds for real, simulated in one process:
a real mesh of the fake CPU devices, its devices dealt to P simulated processes, each
process's view of the batch sharding (the rows its devices hold), and the collectives
(``process_allgather``) stood in by threads meeting at a barrier. Replicated layouts
(a mesh axis that does not shard the batch, ``tensor``, spanning processes) make two
processes read the same data shards: the row count and each step's target-token count
must still count every shard once (``distributed.sum_by_key``), exactly as one process
reading every shard counts them."""

from __future__ import annotations

import itertools
import threading

import jax
import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from posttrain import distributed, sharding
from posttrain.training import data
from tests.strategies import factorisations, mesh_id, scaled

MICRO_BATCHES = 4  # per simulated run: two optimizer steps
GRAD_ACCUM = 2


class ProcessView:
    """A batch sharding as one simulated process sees it: only its devices addressable."""

    def __init__(self, sharding, devices) -> None:
        self._sharding, self._devices = sharding, set(devices)

    def addressable_devices_indices_map(self, shape):
        every = self._sharding.devices_indices_map(shape)
        return {d: index for d, index in every.items() if d in self._devices}


class Collectives:
    """``process_allgather`` across threads standing for processes: each thread gives its
    array and gets every thread's, stacked in process order (a lockstep collective: a
    process that calls it more or fewer times than the others breaks the barrier)."""

    def __init__(self, processes: int) -> None:
        self.processes = processes
        self.local = threading.local()
        self._barrier = threading.Barrier(processes, timeout=20)
        self._slots: list = [None] * processes

    def process_allgather(self, x, tiled=False):
        assert not tiled
        self._slots[self.local.index] = np.asarray(x)
        self._barrier.wait()
        every = np.stack(self._slots)
        self._barrier.wait()  # every process has read before the next call writes
        return every

    def run(self, fn):
        """``[fn(p) for p in range(processes)]``, each in its own thread."""
        results: list = [None] * self.processes
        errors: list = []

        def body(p):
            self.local.index = p
            try:
                results[p] = fn(p)
            except BaseException as error:  # noqa: BLE001 (re-raised below)
                errors.append(error)
                self._barrier.abort()

        threads = [threading.Thread(target=body, args=(p,)) for p in range(self.processes)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


def _shard_rows(shard: int, n: int) -> dict[str, np.ndarray]:
    """Packed-looking SFT rows of data shard ``shard``: ``n`` rows of 8 tokens with
    segments and padding (target counts differ from row to row)."""
    rng = np.random.default_rng(100 + shard)
    seg = (rng.random((n, 8)) > 0.3).astype(np.int32) * (1 + rng.integers(0, 2, (n, 8)))
    return {
        "input_tokens": rng.integers(0, 50, (n, 8)).astype(np.int32),
        "segment_ids": seg,
        "input_mask": (seg > 0).astype(np.int32),
    }


@st.composite
def layouts(draw):
    """``(mesh shape, processes, deal, global batch, data_shards)``: a mesh over the
    devices (8 by default) on data / fsdp / tensor, its devices dealt to 1, 2, 4 or 8
    processes (those that divide the devices) in mesh order (blocks) or round robin; a
    global batch of one or two rows per batch shard; the data shards by default (one per
    row block a process holds) or one per row."""
    devices = jax.device_count()
    shape = draw(st.sampled_from(factorisations(devices, ("data", "fsdp", "tensor"))))
    processes = draw(st.sampled_from([p for p in (1, 2, 4, 8) if devices % p == 0]))
    deal = draw(st.sampled_from(["blocks", "round-robin"]))
    batch_shards = shape.get("data", 1) * shape.get("fsdp", 1)
    global_batch = batch_shards * draw(st.sampled_from([1, 2]))
    per_row = draw(st.booleans())
    return shape, processes, deal, global_batch, (global_batch if per_row else None)


def _devices_of(mesh, processes: int, deal: str) -> list[list]:
    flat = list(mesh.devices.flat)
    per = len(flat) // processes
    if deal == "blocks":
        return [flat[p * per : (p + 1) * per] for p in range(processes)]
    return [flat[p::processes] for p in range(processes)]


@pytest.mark.devices(2)  # two simulated processes need a device each
@settings(max_examples=scaled(30))
@given(layout=layouts())
def test_replicated_and_split_layouts_count_every_shard_once(layout):
    """For every simulated layout a process can run (its rows one range of whole shards):
    the processes together read every shard; each process's part of each micro-batch is
    exactly the global batch's rows its devices hold; the run's row count and each
    step's target-token count, reduced across the processes, equal one process's
    reading of every shard, whether other processes read the same shards or not."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        _check_layout(layout, monkeypatch)


def _check_layout(layout, monkeypatch) -> None:
    from posttrain.sft.options import SFTConfig
    from posttrain.training.shards import data_shards

    shape, processes, deal, global_batch, shards_option = layout
    mesh = sharding.make_mesh(shape)
    devices = _devices_of(mesh, processes, deal)
    batch = sharding.batch_sharding(mesh)
    collectives = Collectives(processes)
    local_rows = distributed.local_rows
    monkeypatch.setattr(
        distributed,
        "local_rows",
        lambda s, rows: local_rows(ProcessView(s, devices[collectives.local.index]), rows),
    )
    monkeypatch.setattr(distributed, "process_count", lambda: processes)
    from jax.experimental import multihost_utils

    monkeypatch.setattr(multihost_utils, "process_allgather", collectives.process_allgather)
    cfg = SFTConfig(data_shards=shards_option)

    def plan(p):
        try:
            return data_shards(cfg, mesh, global_batch), None
        except ValueError as error:
            return None, str(error)

    plans = collectives.run(plan)
    if any(error for _, error in plans):  # a layout no process can run: refused, named
        assert all("not one range" in e or "not whole shards" in e for _, e in plans if e)
        event("refused")
        return
    (shards, _), *_ = (p for p, _ in plans)
    assert {shards} == {p[0] for p, _ in plans}
    reads = [p[1] for p, _ in plans]
    assert set().union(*map(set, reads)) == set(range(shards))
    event("replicated" if sum(map(len, reads)) > shards else "disjoint")
    rows = {s: _shard_rows(s, 5 + s % 3) for s in range(shards)}

    def run(p):
        mine = {s: rows[s] for s in reads[p]}
        n_rows = distributed.sum_by_key(
            {s: len(r["input_tokens"]) for s, r in mine.items()}, shards
        )
        stream = data.sharded_batches(
            mine,
            shards,
            global_batch,
            GRAD_ACCUM,
            seed=5,
            step_total=lambda counts: distributed.sum_by_key(counts, shards),
        )
        return n_rows, list(itertools.islice(stream, MICRO_BATCHES))

    got = collectives.run(run)
    monkeypatch.setattr(distributed, "process_count", lambda: 1)
    whole = list(
        itertools.islice(
            data.sharded_batches(rows, shards, global_batch, GRAD_ACCUM, seed=5), MICRO_BATCHES
        )
    )
    assert len(whole) == MICRO_BATCHES
    for p, (n_rows, micro) in enumerate(got):
        assert n_rows == sum(len(r["input_tokens"]) for r in rows.values()), (p, reads)
        start, stop = local_rows(ProcessView(batch, devices[p]), global_batch)
        assert len(micro) == MICRO_BATCHES
        for i, (mine, full) in enumerate(zip(micro, whole, strict=True)):
            for key in full:
                np.testing.assert_array_equal(mine[key], full[key][start:stop], err_msg=key)
            step = whole[i - i % GRAD_ACCUM : i - i % GRAD_ACCUM + GRAD_ACCUM]
            want = sum(int(data.count_targets({k: b[k] for k in rows[0]}).sum()) for b in step)
            assert set(mine["step_target_tokens"].tolist()) == {want}, (p, reads)


@pytest.mark.devices(8)  # the fixed layouts: 8 devices dealt to 2, 4 and 8 processes
def test_the_simulation_reaches_replicated_layouts():
    """The layouts above include processes reading the same shards (tensor across
    processes), processes reading disjoint ones, and refused ones: the property covers
    each kind (checked on fixed layouts, not left to the draw)."""
    kinds = set()
    for shape in ({"data": 2, "tensor": 4}, {"fsdp": 8}, {"data": 4, "tensor": 2}):
        mesh = sharding.make_mesh(shape)
        batch = sharding.batch_sharding(mesh)
        for processes, deal in itertools.product([2, 4, 8], ["blocks", "round-robin"]):
            ranges = []
            for devices in _devices_of(mesh, processes, deal):
                try:
                    ranges.append(distributed.local_rows(ProcessView(batch, devices), 8))
                except ValueError:
                    ranges.append(None)
            if None in ranges:
                kinds.add("refused")
            elif len(set(ranges)) < len(ranges):
                kinds.add("replicated")
            else:
                kinds.add("disjoint")
        assert mesh_id(shape)
    assert kinds == {"refused", "replicated", "disjoint"}
