"""Ctrl-C and SIGTERM while a ``posttrain`` command runs: one line, exit 130 / 143.

Inside :func:`interrupts` both signals raise ``KeyboardInterrupt("SIGINT" | "SIGTERM")``
in the main thread, so ``finally`` blocks and context managers clean up, and the CLI
prints ``posttrain: interrupted (SIGTERM)``. Before raising, the handler quiets what
would otherwise print tracebacks on the way out (#40): the ``absl`` logger (Orbax logs
each save it abandons, with its traceback, from the main thread and from its background
threads, which fail again at interpreter shutdown), and uncaught exceptions of other
threads.

A Python signal handler runs only when the main thread is back in Python: a long XLA
call (``posttrain generate``'s whole decode loop is one) delays it until the call ends
(18-22 s), and a streaming decode, whose host callbacks run on another thread, could hang
once the main thread unwound. With ``immediate=True`` a watchdog thread, woken by the
signal's byte on the wakeup fd (:func:`signal.set_wakeup_fd`, written from the C-level
handler at once), prints the line and ends the process with ``os._exit``: for commands
that write only through atomic renames (a temporary left behind is swept by the next
writer, :mod:`posttrain.atomic`). Without it (the training commands, which unwind to
abandon Orbax's saves) the same watchdog waits :data:`GRACE_S` for the main thread to
unwind, then ends the process with the line and the same status: a main thread blocked
in native code that never returns (a collective that deadlocked on fake CPU devices, seen
in the matrix's GRPO run) no longer ignores SIGTERM until SIGKILL.

An interrupt can abandon an XLA compile: JAX's wait for it returns on the signal, the
compile goes on in XLA's threads, and the interpreter's shutdown then waited for the rest
of it (on this CPU; ``tests/test_signals.py``) or, on a v5e, crashed in ifrt's
``PjRtLoadedExecutable::Create`` when it finished (SIGSEGV instead of 143). So the
``posttrain`` console script ends an interrupted command through :func:`leave`, which
skips the shutdown: it waits for the other Python threads (Orbax's) as the shutdown would,
up to :data:`GRACE_S`, runs the exit handlers registered through :func:`at_exit` (the
checkpoint sweep), and calls ``os._exit``.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import NoReturn

#: The exit status of each signal (128 + its number, as a shell reports it).
EXIT_CODES = {"SIGINT": 130, "SIGTERM": 143}

#: Seconds an interrupted command (not ``immediate``) has to unwind before the watchdog
#: ends the process without its clean-up.
GRACE_S = 30.0


def quiet() -> None:
    """Silences what reports the abandoned work of an interrupted command: the ``absl``
    logger (Orbax) and uncaught exceptions in other threads."""
    logging.getLogger("absl").disabled = True
    threading.excepthook = lambda args: None


def line(name: str, prog: str = "posttrain", detail: str = "") -> str:
    """The one line an interrupted command prints (``prog``: ``posttrain-harness``;
    ``detail``: after the signal's name, inside the parentheses)."""
    return f"{prog}: interrupted ({name}{detail})"


@contextlib.contextmanager
def interrupts(*, immediate: bool = False, grace: float = GRACE_S) -> Iterator[None]:
    """SIGINT / SIGTERM raise ``KeyboardInterrupt(name)`` in the main thread after
    :func:`quiet`; with ``immediate`` a watchdog exits the process at once instead, and
    without it the watchdog exits ``grace`` seconds after the signal if the main thread
    has not left this context by then (see the module docstring). Outside the main
    thread: nothing changes. A SIGINT the parent made the process ignore (a shell's
    background job) stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        quiet()
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, interrupt)}
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, interrupt)
    stop = _watchdog(set(previous), 0.0 if immediate else grace)
    try:
        yield
    finally:
        stop()
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _watchdog(signums: set[int], delay: float):
    """Starts the thread that exits ``delay`` seconds after the first of ``signums``
    unless its stop was called by then; returns its stop."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    old = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    stopped = threading.Event()

    def watch() -> None:
        while data := os.read(read_end, 1):
            if data[0] in signums:
                if delay and stopped.wait(delay):
                    return  # the main thread unwound in time
                name = signal.Signals(data[0]).name
                late = f"; no clean-up: still running {delay:g} s after it" if delay else ""
                os.write(2, (line(name, detail=late) + "\n").encode())
                os._exit(EXIT_CODES[name])

    thread = threading.Thread(target=watch, name="posttrain-interrupt", daemon=True)
    thread.start()

    def stop() -> None:
        stopped.set()
        signal.set_wakeup_fd(old)
        os.close(write_end)  # the watcher reads EOF and returns
        thread.join()
        os.close(read_end)

    return stop


_AT_EXIT: list[tuple[Callable[..., object], tuple]] = []


def at_exit(function: Callable[..., object], *args) -> None:
    """Registers ``function(*args)`` with :mod:`atexit`, and for :func:`leave`, which
    runs it instead when an interrupted command ends its process."""
    atexit.register(function, *args)
    _AT_EXIT.append((function, args))


def leave(status: int, grace: float = GRACE_S) -> NoReturn:
    """Ends the process of an interrupted command with ``status`` without the interpreter's
    shutdown (see the module docstring): stops the other non-daemon threads as the shutdown
    would (:func:`_stop_threads`), waiting ``grace`` seconds at most, runs the
    :func:`at_exit` handlers (newest first; one that raises prints one line, the others
    still run), flushes stdout and stderr, ``os._exit``."""
    stopper = threading.Thread(target=_stop_threads, name="posttrain-leave", daemon=True)
    stopper.start()
    stopper.join(grace)
    while _AT_EXIT:
        function, args = _AT_EXIT.pop()
        atexit.unregister(function)
        try:
            function(*args)
        except Exception as error:  # as atexit would: report it, run the rest
            print(f"posttrain: at exit: {type(error).__name__}: {error}", file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken pipe: nothing to flush
            stream.flush()
    os._exit(status)


def _stop_threads() -> None:
    """What the interpreter's shutdown does before its exit handlers (CPython's
    ``threading._shutdown``): the callbacks of ``threading._register_atexit`` (the one of
    ``concurrent.futures``, which wakes the idle workers of every thread pool, Orbax's, to
    end), then a join of every other non-daemon thread. Without the callbacks, the idle
    workers of Orbax's pools never end (30 s, the whole grace, measured for an interrupted
    ``posttrain sft`` here)."""
    for callback in list(threading._threading_atexits):  # CPython's, as its shutdown runs them
        callback()
    others = (threading.current_thread(), threading.main_thread())
    for thread in threading.enumerate():
        if thread not in others and not thread.daemon:
            thread.join()


def exit_status(interrupt: KeyboardInterrupt) -> tuple[str, int]:
    """``(signal name, exit status)`` of a ``KeyboardInterrupt`` raised by
    :func:`interrupts` (a bare one is Ctrl-C's)."""
    name = interrupt.args[0] if interrupt.args and interrupt.args[0] in EXIT_CODES else "SIGINT"
    return name, EXIT_CODES[name]
