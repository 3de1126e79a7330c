"""Ctrl-C and SIGTERM of a ``posttrain`` command (#40): one line, exit 130 / 143, no
tracebacks, checkpoints whole or absent, and ``generate`` gone at once even inside a
long XLA call (:mod:`posttrain.signals`)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from posttrain import signals

pytestmark = pytest.mark.host


def subprocess_env() -> dict[str, str]:
    """The environment of a subprocess test, read when it starts (a mutation run sets its
    mutant's variable after collection), importing the `posttrain` this process imported
    (a mutation run's copy too)."""
    here = os.path.dirname(os.path.dirname(signals.__file__))
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}


@pytest.fixture
def restored_quiet():
    """:func:`signals.quiet` changes process-wide state: put it back."""
    hook, absl = threading.excepthook, logging.getLogger("absl").disabled
    yield
    threading.excepthook = hook
    logging.getLogger("absl").disabled = absl


@pytest.fixture
def restored_hooks():
    """A failed :func:`stops.clean_stop` leaves its hooks and filter for the exit: put
    them back for the next tests."""
    hooks, filters = (sys.excepthook, sys.unraisablehook), list(logging.getLogger("absl").filters)
    yield
    sys.excepthook, sys.unraisablehook = hooks
    logging.getLogger("absl").filters[:] = filters


@pytest.fixture
def sigint_default():
    """SIGINT as an interactive Python has it (a gate started as a shell's background job
    inherits SIGINT ignored, and Python then installs no handler); put back after."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT"])
def test_a_signal_raises_its_name_after_quieting_orbax(restored_quiet, sigint_default, name):
    assert not logging.getLogger("absl").disabled
    with pytest.raises(KeyboardInterrupt) as interrupt, signals.interrupts():
        os.kill(os.getpid(), getattr(signal, name))
        time.sleep(5)  # the handler raises here, at once
    assert signals.exit_status(interrupt.value) == (name, {"SIGTERM": 143, "SIGINT": 130}[name])
    assert logging.getLogger("absl").disabled  # Orbax's abandoned saves say nothing
    assert signal.getsignal(signal.SIGTERM) is not None  # restored on the way out
    assert signals.exit_status(KeyboardInterrupt()) == ("SIGINT", 130)  # a bare Ctrl-C


def test_a_sigint_the_parent_ignored_stays_ignored(restored_quiet):
    """A background job's SIGINT (ignored by its shell) is left as it is: the run goes on."""
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with signals.interrupts():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)  # nothing is raised
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


def test_an_interrupted_training_command_sweeps_unfinished_checkpoints_at_exit(
    tmp_path, monkeypatch, restored_hooks
):
    """The sweep is registered with atexit (it must run after Orbax's threads stopped)
    and removes exactly Orbax's temporaries."""
    from posttrain.training import checks, stops

    registered = []
    monkeypatch.setattr(signals.atexit, "register", lambda *a: registered.append(a))
    monkeypatch.setattr(signals, "_AT_EXIT", [])
    with pytest.raises(KeyboardInterrupt), stops.clean_stop(str(tmp_path)):
        raise KeyboardInterrupt("SIGTERM")
    sweep = (checks.sweep_partial_checkpoints, tmp_path / "checkpoints")
    assert registered == [sweep]
    pending = signals._AT_EXIT  # leave() runs it too
    assert pending == [(sweep[0], sweep[1:])]
    root = tmp_path / "checkpoints"
    for name in ("3", "4.orbax-checkpoint-tmp", "5.orbax-checkpoint-tmp-1712", "actor/2"):
        (root / name / "model_params").mkdir(parents=True)
    (root / "3" / "commit_success.txt").write_text("")
    (root / "actor" / "3.orbax-checkpoint-tmp").mkdir()  # grpo's actor
    removed = checks.sweep_partial_checkpoints(root)
    assert sorted(str(p.relative_to(root)) for p in removed) == [
        "4.orbax-checkpoint-tmp",
        "5.orbax-checkpoint-tmp-1712",
        "actor/3.orbax-checkpoint-tmp",
    ]
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == [
        "3",
        "3/commit_success.txt",
        "3/model_params",
        "actor",
        "actor/2",
        "actor/2/model_params",
    ]


LONG_C_CALL = textwrap.dedent(
    """
    import hashlib
    import sys
    from posttrain import signals

    mode = sys.argv[1]
    grace = {"grace": 1.0}.get(mode, signals.GRACE_S)
    with signals.interrupts(immediate=mode == "immediate", grace=grace):
        print("running", flush=True)
        # a minute in C, like generate's decode loop in XLA: no Python handler runs
        hashlib.pbkdf2_hmac("sha256", b"x", b"y", 50_000_000)
    """
)


@pytest.mark.parametrize(
    ("immediate", "detail"),
    [(True, ""), (False, "; no clean-up: still running 0.2 s after it")],
)
def test_the_watchdog_exits_while_the_main_thread_is_in_a_c_call(
    restored_quiet, monkeypatch, capfd, immediate, detail
):
    """In this process, ``os._exit`` recorded instead: SIGTERM while the main thread is
    in a C call (no Python handler runs until it returns); the watchdog prints the line
    and exits with 143 at once (``immediate``) or after the grace (0.2 s; the call lasts
    about 2 s here, the signal comes at 0.2 s), then the handler raises when the call
    returns."""
    import hashlib

    exits = []
    monkeypatch.setattr(signals.os, "_exit", exits.append)
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
    grace = signals.interrupts(immediate=immediate, grace=0.2)
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"), grace:
        hashlib.pbkdf2_hmac("sha256", b"x", b"y", 3_000_000)  # about 2 s in C
    assert exits == [143]
    assert capfd.readouterr().err == f"posttrain: interrupted (SIGTERM{detail})\n"


def _sigterm_inside_a_long_c_call(tmp_path, mode: str) -> tuple[int, str, float]:
    """Runs :data:`LONG_C_CALL` in ``mode``, sends SIGTERM once it runs; ``(exit status,
    stderr, seconds from the signal to the exit)``."""
    return _sigterm_once_it_prints(tmp_path, LONG_C_CALL, mode, "running", timeout=20)


def _sigterm_once_it_prints(
    tmp_path, source: str, mode: str, ready: str, timeout: float
) -> tuple[int, str, float]:
    """Runs the script ``source`` with the argument ``mode``, sends SIGTERM 0.5 s after it
    prints the line ``ready``, waits ``timeout`` seconds at most; ``(exit status, stderr,
    seconds from the signal to the exit)``."""
    script = tmp_path / "script.py"
    script.write_text(source)
    with subprocess.Popen(
        [sys.executable, str(script), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=subprocess_env(),
        text=True,
    ) as proc:
        try:
            assert proc.stdout.readline() == f"{ready}\n"
            time.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
            start = time.monotonic()
            status = proc.wait(timeout=timeout)
            waited = time.monotonic() - start
        finally:
            proc.kill()
            proc.wait()
        return status, proc.stderr.read(), waited


def test_immediate_exits_at_once_on_sigterm_inside_a_long_c_call(tmp_path):
    """With ``immediate`` (``posttrain generate``) the process is gone within seconds of
    SIGTERM although the main thread is inside a long C call (generate: XLA's decode
    loop), with the one line and 143; without, it would wait for the call to end."""
    status, err, waited = _sigterm_inside_a_long_c_call(tmp_path, "immediate")
    assert (status, err) == (143, "posttrain: interrupted (SIGTERM)\n")
    assert waited < 5, waited


def test_a_command_that_does_not_unwind_ends_after_the_grace_with_its_status(tmp_path):
    """Without ``immediate`` (the training commands) a main thread stuck in native code
    (the long C call here; a collective that deadlocked on fake CPU devices in the
    matrix's GRPO run) cannot run the handler: the watchdog ends the process ``grace``
    seconds after SIGTERM, with one line that says no clean-up ran, and 143."""
    status, err, waited = _sigterm_inside_a_long_c_call(tmp_path, "grace")
    line = "posttrain: interrupted (SIGTERM; no clean-up: still running 1 s after it)\n"
    assert (status, err) == (143, line)
    assert 1 <= waited < 6, waited


@pytest.mark.devices(8)
@pytest.mark.parametrize(("command", "immediate"), [("generate", True), ("sft", False)])
def test_only_generate_exits_immediately(monkeypatch, capsys, command, immediate):
    """generate writes only through atomic renames, so it may end at once; the training
    commands unwind (Orbax, the run directory)."""
    from posttrain import cli

    seen = []
    real = signals.interrupts
    monkeypatch.setattr(signals, "interrupts", lambda **kw: seen.append(kw) or real())
    cli.main([command, "--seed", "-1"])  # refused before any work
    assert seen == [{"immediate": immediate}]


ABANDONED_COMPILE = textwrap.dedent(
    """
    import sys

    import jax
    import jax.numpy as jnp

    from posttrain import signals

    def chain(x):
        for i in range(300):
            x = jnp.tanh(x @ x + i) * jnp.sin(x)
        return x.sum()

    lowered = jax.jit(jax.grad(chain)).trace(jnp.ones((64, 64))).lower()
    try:
        with signals.interrupts():
            print("compiling", flush=True)
            lowered.compile()  # over 40 s of XLA:CPU compile here
    except KeyboardInterrupt as interrupt:
        name, status = signals.exit_status(interrupt)
        print(signals.line(name), file=sys.stderr)
        if sys.argv[1] == "leave":
            signals.leave(status)
        sys.exit(status)
    """
)


def test_an_interrupted_compile_does_not_hold_the_exit(tmp_path):
    """SIGTERM during an XLA compile: JAX's wait returns with the interrupt while XLA's
    threads go on compiling; :func:`signals.leave` (the ``posttrain`` script's way out)
    ends the process within seconds with the one line and 143. Through the interpreter's
    shutdown (``sys.exit``, the script's ``exit``) the exit waited for the rest of the
    compile (more than the 40 s this test waits, on this CPU), and a v5e crashed when it
    finished."""
    status, err, waited = _sigterm_once_it_prints(
        tmp_path, ABANDONED_COMPILE, "leave", "compiling", timeout=40
    )
    assert (status, err) == (143, "posttrain: interrupted (SIGTERM)\n")
    assert waited < 10, waited


def test_leave_waits_for_the_threads_runs_the_exit_handlers_and_exits(monkeypatch, capfd):
    """``leave``: the threads first, as the shutdown stops them (threading's exit callbacks,
    which end the idle workers of the thread pools, then a join of the other non-daemon
    threads: Orbax's), then the :func:`signals.at_exit` handlers newest first, one that
    raises reported in one line without stopping the rest, then ``os._exit(status)``."""
    events = []
    wake = threading.Event()
    # the real callbacks would end this process's thread pools for the tests after
    monkeypatch.setattr(
        threading, "_threading_atexits", [lambda: (events.append("woken"), wake.set())]
    )
    monkeypatch.setattr(signals, "_AT_EXIT", [])
    monkeypatch.setattr(signals.atexit, "register", lambda *a: None)
    monkeypatch.setattr(signals.atexit, "unregister", lambda f: events.append(("unregister", f)))
    monkeypatch.setattr(signals.os, "_exit", lambda status: events.append(("exit", status)))
    worker = threading.Thread(target=lambda: (wake.wait(), events.append("thread")))
    worker.start()
    forever = threading.Event()  # a daemon thread (tqdm's monitor) is never waited for
    threading.Thread(target=forever.wait, daemon=True).start()

    class ClosedPipe:  # stdout gone: nothing to flush, no error
        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

    def fails():
        raise OSError("no such file")

    signals.at_exit(events.append, "first")
    signals.at_exit(fails)
    signals.at_exit(events.append, "last")
    monkeypatch.setattr(signals.sys, "stdout", ClosedPipe())
    start = time.monotonic()
    try:
        signals.leave(143, grace=5)
    finally:
        forever.set()
    assert time.monotonic() - start < 2  # neither the daemon thread nor this one waited for
    assert events == [
        "woken",
        "thread",
        ("unregister", events.append),
        "last",
        ("unregister", fails),
        ("unregister", events.append),
        "first",
        ("exit", 143),
    ]
    assert capfd.readouterr().err == "posttrain: at exit: OSError: no such file\n"
    assert signals._AT_EXIT == []


def test_leave_waits_for_a_stuck_thread_no_longer_than_the_grace(monkeypatch):
    """A thread that never ends (a stuck save) holds the exit ``grace`` seconds at most."""
    monkeypatch.setattr(threading, "_threading_atexits", [])
    monkeypatch.setattr(signals, "_AT_EXIT", [])
    exits = []
    monkeypatch.setattr(signals.os, "_exit", exits.append)
    stop = threading.Event()
    stuck = threading.Thread(target=stop.wait)
    stuck.start()
    try:
        start = time.monotonic()
        signals.leave(130, grace=0.3)
        waited = time.monotonic() - start
    finally:
        stop.set()
        stuck.join()
    assert exits == [130]
    assert 0.3 <= waited < 2, waited


@pytest.mark.parametrize(("status", "left"), [(143, [143]), (130, [130]), (0, []), (2, [])])
def test_the_console_script_leaves_only_after_an_interrupt(monkeypatch, status, left):
    """``posttrain`` (``cli.run``): an interrupt's status ends through ``leave``; any other
    is ``sys.exit``'s."""
    from posttrain import cli

    seen = []
    monkeypatch.setattr(cli, "main", lambda: status)
    monkeypatch.setattr(signals, "leave", seen.append)
    with pytest.raises(SystemExit) as exit_:
        cli.run()
    assert (seen, exit_.value.code) == (left, status)
