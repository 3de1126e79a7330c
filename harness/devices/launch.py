"""A local multi-process launcher for JAX, in the spirit of ``torchrun``:
``posttrain-harness launch -n N [--devices-per-process M] -- COMMAND ...``.

It starts N copies of COMMAND on this machine, each with M fake CPU devices
(``--xla_force_host_platform_device_count``) and the variables
:func:`posttrain.distributed.initialize` reads (a free coordinator port on 127.0.0.1, the
process count and id), so that the N processes form one JAX runtime of N x M devices
with gloo collectives: what a pod slice's hosts are, on one machine.

- Each line a process prints (stdout and stderr, each read by line from its own pipe)
  is printed with a ``[rank i]`` prefix. A library that writes to the same stream in
  pieces from its own threads (gloo's "Rank 0 is connected to ..." on stdout) can put a
  piece on the same line as the program's; the launcher cannot part them.
- The first process to exit non-zero stops the others: SIGTERM, then SIGKILL after
  ``grace`` seconds. One line names it and its status or signal. The launcher's exit
  status is that process's (``128 + signal`` for a signal), or 0 when every process
  exits 0. It never waits on a process that can no longer finish: a peer of a dead
  rank blocks in a collective, and is stopped within ``grace`` seconds.
- ``posttrain`` as COMMAND runs this interpreter's ``posttrain.cli`` with ``python -P``:
  the working directory is not put on ``sys.path``, so a ``tokenizers.py`` lying there is
  never imported in place of the package.
- Ranks die with their launcher. SIGTERM, SIGHUP or Ctrl-C of the launcher stops them as
  a failing rank does (SIGTERM, SIGKILL after ``grace``); a SIGKILL of the launcher
  reaches them through Linux's parent-death signal (``PR_SET_PDEATHSIG``), which a small
  shim sets before it execs the command.
- Bad input, found before any process starts (one line, exit 2): N or M below 1 or over
  :data:`MAX_PROCESSES` / :data:`MAX_DEVICES_PER_PROCESS`, a command that is not an
  executable file, a negative or non-finite ``grace``, or a ``--mesh`` in the command
  whose axis sizes do not multiply to N x M.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from posttrain import distributed

MAX_PROCESSES = 64
"""Ranks on this one machine (each a JAX process of a few hundred MB): a pod slice's hosts."""
MAX_DEVICES_PER_PROCESS = 512
"""Fake CPU devices a rank's XLA creates (``--xla_force_host_platform_device_count``)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check(
    num_processes: int, devices_per_process: int, command: Sequence[str], grace: float = 10.0
) -> None:
    """Raises ValueError (one line) when the launch cannot work; see the module docstring."""
    if not (math.isfinite(grace) and grace >= 0):
        raise ValueError(f"--grace {grace}: expected a finite number of seconds >= 0")
    if num_processes < 1:
        raise ValueError(f"-n {num_processes}: expected at least 1 process")
    if num_processes > MAX_PROCESSES:
        raise ValueError(f"-n {num_processes}: expected at most {MAX_PROCESSES} processes")
    if devices_per_process < 1:
        raise ValueError(f"--devices-per-process {devices_per_process}: expected at least 1")
    if devices_per_process > MAX_DEVICES_PER_PROCESS:
        raise ValueError(
            f"--devices-per-process {devices_per_process}: expected at most "
            f"{MAX_DEVICES_PER_PROCESS}"
        )
    if not command:
        raise ValueError("no command after --; e.g. launch -n 2 -- posttrain forward")
    mesh = _mesh_option(command)
    if mesh is not None:
        from posttrain import flags, sharding

        axes = flags.parse_flag("--mesh", mesh, sharding.parse_mesh_spec)
        product = 1
        for size in axes.values():
            product *= size
        total = num_processes * devices_per_process
        if product != total:
            raise ValueError(
                f"--mesh {mesh} has {product} devices, but -n {num_processes} x "
                f"--devices-per-process {devices_per_process} gives {total}"
            )


def _mesh_option(command: Sequence[str]) -> str | None:
    for i, arg in enumerate(command):
        if arg == "--mesh" and i + 1 < len(command):
            return command[i + 1]
        if arg.startswith("--mesh="):
            return arg.split("=", 1)[1]
    return None


# Runs first in each rank: asks Linux to SIGKILL it when the launcher (argv[1], its
# parent) dies, leaves at once if the launcher is already gone, then becomes the command.
_PARENT_DEATH_SHIM = (
    "import ctypes, os, signal, sys\n"
    "try:\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG\n"
    "except (AttributeError, OSError):\n"
    "    pass  # not Linux: the launcher's own signal handling still stops the ranks\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(1)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def _with_parent_death(program: list[str]) -> list[str]:
    """``program`` started through :data:`_PARENT_DEATH_SHIM` (``program[0]``: a path)."""
    return [sys.executable, "-P", "-c", _PARENT_DEATH_SHIM, str(os.getpid()), *program]


def _program(command: Sequence[str]) -> list[str]:
    if command[0] == "posttrain":
        # -P: the working directory stays off sys.path (no module planted there is run)
        return [sys.executable, "-P", "-m", "posttrain.cli", *command[1:]]
    if command[0] in ("python", "python3"):
        return [sys.executable, *command[1:]]
    found = shutil.which(command[0])
    if found is None and os.sep in command[0] and os.path.exists(command[0]):
        raise ValueError(f"command {command[0]!r} is not an executable file")
    if found is None:
        raise ValueError(f"command {command[0]!r} not found on PATH")
    return [found, *command[1:]]


def _environment(rank: int, count: int, devices: int, port: int) -> dict[str, str]:
    env = dict(os.environ)
    flags = [
        f
        for f in env.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    env.update(
        {
            distributed.COORDINATOR: f"127.0.0.1:{port}",
            distributed.NUM_PROCESSES: str(count),
            distributed.PROCESS_ID: str(rank),
            "POSTTRAIN_DEVICES": str(devices),
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"]),
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def describe(status: int) -> str:
    """``exited with status 3`` or ``was killed by SIGKILL`` for a ``Popen.returncode``."""
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = f"signal {-status}"
        return f"was killed by {name}"
    return f"exited with status {status}"


def launch(
    num_processes: int,
    command: Sequence[str],
    *,
    devices_per_process: int = 4,
    grace: float = 10.0,
    out=None,
) -> int:
    """Runs ``command`` in ``num_processes`` processes; returns the launch's exit status
    (see the module docstring). ``out``: where the prefixed lines go (default stdout).

    Raises:
      ValueError: bad input (:func:`check`), before any process starts.
    """
    check(num_processes, devices_per_process, command, grace)
    program = _with_parent_death(_program(command))
    out = out or sys.stdout
    port = free_port()
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    readers = []

    def pump(rank: int, stream) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            with lock:
                print(f"[rank {rank}] {line}", file=out, flush=True)
        stream.close()

    restore = _stop_on_signals()
    try:
        for rank in range(num_processes):
            # stdout and stderr on their own pipes, each read by line: with PYTHONUNBUFFERED
            # a print is several writes, and a library's stderr line (gloo's) written
            # between them would split it on a shared pipe.
            proc = subprocess.Popen(
                program,
                env=_environment(rank, num_processes, devices_per_process, port),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
            procs.append(proc)
            for stream in (proc.stdout, proc.stderr):
                reader = threading.Thread(target=pump, args=(rank, stream), daemon=True)
                reader.start()
                readers.append(reader)
        status = _supervise(procs, grace, out, lock)
    except BaseException:
        _stop(procs, grace)
        raise
    finally:
        restore()
    for reader in readers:
        reader.join(timeout=grace)
    return status


class Stopped(BaseException):
    """The launcher received SIGTERM or SIGHUP (:attr:`signum`); its ranks are stopped."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def _stop_on_signals():
    """SIGTERM and SIGHUP raise :class:`Stopped` in the main thread while ranks run (so
    the launch stops them); returns the function that puts the old handlers back."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def stop(signum, frame):
        raise Stopped(signum)

    old = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}

    def restore() -> None:
        for sig, handler in old.items():
            signal.signal(sig, handler)

    return restore


def _supervise(procs: list[subprocess.Popen], grace: float, out, lock) -> int:
    """Waits for every process; on the first non-zero exit, stops the others."""
    while True:
        codes = [p.poll() for p in procs]
        failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            rank, code = failed[0]
            running = [r for r, c in enumerate(codes) if c is None]
            with lock:
                what = f"rank {rank} {describe(code)}"
                tail = f"; stopping rank(s) {', '.join(map(str, running))}" if running else ""
                print(f"posttrain-harness launch: {what}{tail}", file=sys.stderr, flush=True)
            _stop(procs, grace)
            return 128 - code if code < 0 else code
        if all(code == 0 for code in codes):
            return 0
        time.sleep(0.05)


def _stop(procs: list[subprocess.Popen], grace: float) -> None:
    """SIGTERM to each running process's group, SIGKILL after ``grace`` seconds."""
    for p in procs:
        if p.poll() is None:
            _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(p, signal.SIGKILL)
            p.wait()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
