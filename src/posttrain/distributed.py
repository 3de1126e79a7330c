"""Several processes as one JAX runtime: ``jax.distributed`` set up from the environment.

On a pod slice JAX runs one process per host, and each process sees only its own
devices; ``jax.distributed.initialize`` joins them into one set of global devices that a
mesh can span. This module does that once per process, before any computation, from
one of two sources:

- the local launcher (``posttrain-harness launch``, :mod:`harness.devices.launch`) sets
  :data:`COORDINATOR`, :data:`NUM_PROCESSES` and :data:`PROCESS_ID`; on the CPU backend
  the cross-process collectives are gloo's (``jax_cpu_collectives_implementation``), and
  SIGTERM ends the process at once (JAX's preemption notifier would hold it);
- ``POSTTRAIN_DISTRIBUTED=auto`` on a real TPU or GPU cluster: ``jax.distributed.initialize()``
  with no arguments, which reads the platform's own environment (Cloud TPU metadata,
  SLURM, Open MPI).

Without either, nothing happens: one process, its own devices, as before.
"""

from __future__ import annotations

import os
import signal
import threading

import numpy as np

COORDINATOR = "POSTTRAIN_COORDINATOR"
"""``host:port`` of process 0's coordination service."""
NUM_PROCESSES = "POSTTRAIN_NUM_PROCESSES"
PROCESS_ID = "POSTTRAIN_PROCESS_ID"
AUTO = "POSTTRAIN_DISTRIBUTED"
"""``auto``: let ``jax.distributed.initialize()`` find the cluster itself."""

_initialized = False


def launched() -> bool:
    """Whether this process was started by the local launcher (its variables are set)."""
    return COORDINATOR in os.environ


def initialize() -> None:
    """Joins this process to the others, once, before JAX computes anything.

    Raises:
      ValueError: the launcher's variables are incomplete or not integers (one line
        naming the variable).
    """
    global _initialized
    if _initialized:
        return
    if launched():
        import jax

        coordinator = os.environ[COORDINATOR]
        count = _int_variable(NUM_PROCESSES)
        index = _int_variable(PROCESS_ID)
        if not 0 <= index < count:
            raise ValueError(f"{PROCESS_ID}={index}: expected 0 <= id < {NUM_PROCESSES}={count}")
        if os.environ.get("JAX_PLATFORMS", "") == "cpu":
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator, num_processes=count, process_id=index)
        # JAX's preemption notifier takes SIGTERM over (a cloud's "you will be preempted"),
        # so a launched rank outlived the launcher's SIGTERM until its SIGKILL, `grace`
        # seconds later. Under the local launcher SIGTERM means stop: its default again.
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    elif os.environ.get(AUTO, "") == "auto":
        import jax

        jax.distributed.initialize()
    _initialized = True


def _int_variable(name: str) -> int:
    value = os.environ.get(name)
    try:
        return int(value or "")
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected an integer (set by the launcher)") from None


def process_index() -> int:
    """This process's index, 0 in a single process."""
    import jax

    return jax.process_index()


def process_count() -> int:
    """The number of processes, 1 in a single process."""
    import jax

    return jax.process_count()


def is_writer() -> bool:
    """Whether this process writes what is written once per run (process 0): metrics,
    logs, ``run.json``, exports."""
    return process_index() == 0


def host_array(x):
    """``x`` (a ``jax.Array``, or anything ``np.asarray`` takes) as a host NumPy array in
    every process.

    A value this process holds whole (fully addressable, or replicated) is read here;
    one sharded across processes is gathered from all of them
    (``multihost_utils.process_allgather``), which is a collective: every process must
    call this for the same arrays in the same order.
    """
    import jax

    if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def local_rows(sharding, rows: int) -> tuple[int, int]:
    """``[start, stop)``: the rows of a ``[rows, ...]`` array with ``sharding`` that this
    process's devices hold (all of them in one process; the same range in processes
    that hold the batch replicated).

    Raises:
      ValueError: the rows this process holds are not one contiguous range.
    """
    held = sorted(
        {
            (index[0].start or 0, rows if index[0].stop is None else index[0].stop)
            for index in sharding.addressable_devices_indices_map((rows,)).values()
        }
    )
    start, stop = held[0]
    for lo, hi in held[1:]:
        if lo > stop:
            raise ValueError(f"this process holds rows {held} of {rows}: not one range")
        stop = max(stop, hi)
    return start, stop


def sum_by_key(counts: dict[int, int], keys: int) -> int:
    """The sum over ``range(keys)`` of each key's count, the counts being spread over the
    processes (a key counted in several processes, which hold the same data, counts
    once): a collective, every process calls it; one process sums its own."""
    if process_count() == 1:
        return int(sum(counts.values()))
    from jax.experimental import multihost_utils

    mine = np.zeros((keys,), np.int32)
    for key, count in counts.items():
        mine[key] = count
    every = np.asarray(multihost_utils.process_allgather(mine))  # [processes, keys]
    return int(every.max(axis=0).sum())


class OtherProcessFailed(RuntimeError):
    """Another process failed in a :class:`together` block; its own error is in its output."""


class together:  # noqa: N801 (a context manager, read as a phrase)
    """``with together("read the data"):`` a block every process runs, which may fail in
    some: on leaving it, every process learns whether all succeeded (a collective). One
    that failed raises its own error; the others raise :class:`OtherProcessFailed` naming
    the failed processes, instead of waiting for them at the next collective. One
    process: nothing added."""

    def __init__(self, what: str) -> None:
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, traceback) -> bool:
        if process_count() == 1:
            return False
        from jax.experimental import multihost_utils

        failed = np.asarray(multihost_utils.process_allgather(np.int32(error is not None))).reshape(
            -1
        )
        if error is None and failed.any():
            ranks = ", ".join(str(i) for i in np.flatnonzero(failed))
            raise OtherProcessFailed(
                f"process(es) {ranks} could not {self.what} (their error is in their output)"
            )
        return False


def on_writer(fn, what: str):
    """``fn()`` in process 0 only, its result there (None elsewhere); every process learns
    whether it succeeded (a collective), and the others raise :class:`OtherProcessFailed`
    when it did not, instead of waiting for it at the next collective. One process:
    ``fn()``."""
    if process_count() == 1:
        return fn()
    with together(what):
        return fn() if is_writer() else None


def barrier(name: str) -> None:
    """Waits until every process reaches ``barrier(name)`` (a no-op in one process)."""
    if process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
