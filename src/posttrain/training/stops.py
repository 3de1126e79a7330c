"""How a training run stops when it cannot go on: interrupted, or out of disk (#40).

:func:`clean_stop` wraps a run (``posttrain sft``, ``dpo``, ``grpo``, ``distill``):

- any stop (Ctrl-C, SIGTERM, an error) leaves the checkpoints whole or absent: Orbax's
  unfinished ``*.orbax-checkpoint-tmp*`` are swept at exit, once its save threads have
  stopped (:func:`posttrain.training.checks.sweep_partial_checkpoints`);
- a full disk (``ENOSPC``, ``EDQUOT``, or ``EFBIG`` past a file-size limit) is one line
  naming the path and the bytes that did not fit when the writer says
  (:class:`DiskFullError`, exit 2), instead of Orbax logging each failed write of each
  save thread with its traceback (1,034-1,186 lines before): while the run goes on,
  :class:`DiskFullFilter` drops the ``absl`` records of a full disk and the cascade of
  errors that follows the first one.

A full disk in Orbax's save threads reaches the main thread as tensorstore's message
(``Failed writing: "<path>": Failed to write <n> bytes to file <fd>: No space left on
device [os_error_code='28']``); a full disk in our own writes (metrics, the export) as an
``OSError``. Both are recognised by :func:`disk_full_line`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import pathlib
import re
import sys
import threading
from collections.abc import Iterator

from posttrain import signals

#: The errors of a write that found no room: no space, over quota, over a size limit.
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)'?")
_FAILED_WRITING = re.compile(r'Failed writing: "([^"]+)"')
_BYTES = re.compile(r"Failed to write (\d+) bytes")
_CHECKPOINT = re.compile(r"^(.*/)(\d+)\.orbax-checkpoint-tmp(/|$)")


class DiskFullError(ValueError):
    """A write of the run found the disk (or its quota, or the file-size limit) full."""


def disk_full_line(error: BaseException, output: str | pathlib.Path) -> str | None:
    """The one line of a full disk met by a run writing into ``output`` (``None``: the
    error is something else): what was being written, the bytes that did not fit when
    the writer said, and what to do."""
    code = getattr(error, "errno", None)
    if not isinstance(code, int):
        match = _OS_ERROR_CODE.search(str(error))
        code = int(match.group(1)) if match else None
    if code not in DISK_FULL_ERRNOS:
        return None

    text = str(error)
    path = getattr(error, "filename", None) or _matched(_FAILED_WRITING, text)
    what = f"writing {output}"
    if path:
        checkpoint = _CHECKPOINT.match(str(path))
        what = (
            f"writing checkpoint step {checkpoint.group(2)} in {checkpoint.group(1).rstrip('/')}"
            if checkpoint
            else f"writing {path}"
        )
    need = _matched(_BYTES, text)
    need = f"; a write of {int(need):,} bytes did not fit" if need else ""
    return (
        f"disk full ({os.strerror(code)}) {what}{need}; the unfinished checkpoint is "
        "removed: free space and rerun with the same --output to resume"
    )


def _matched(pattern: re.Pattern, text: str) -> str | None:
    match = pattern.search(text)
    return match.group(1) if match else None


class DiskFullFilter(logging.Filter):
    """Drops ``absl`` records of a full disk, and every error record after the first
    such one (the same failure, reported again by each save thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.dropped = 0
        self.first: str | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            text += f" {record.exc_info[1]}"
        full = disk_full_line(_Text(text), "") is not None
        if full and self.first is None:
            self.first = text
        if full or (self.first is not None and record.levelno >= logging.ERROR):
            self.dropped += 1
            return False
        return True


class _Text(Exception):
    """A log record's text, read as an error's message by :func:`disk_full_line`."""


@contextlib.contextmanager
def clean_stop(output: str) -> Iterator[None]:
    """Runs the block as a training run writing into ``output`` (see the module
    docstring).

    Raises:
      DiskFullError: a write found the disk full (one line).
    """
    absl = logging.getLogger("absl")
    quiet = DiskFullFilter()
    absl.addFilter(quiet)
    hooks = sys.excepthook, sys.unraisablehook
    sys.excepthook, sys.unraisablehook = _after_disk_full(quiet, *hooks)
    try:
        yield
    except BaseException as error:
        # the filter stays: Orbax's threads report the failure again until exit
        from posttrain.training.checks import sweep_partial_checkpoints

        signals.at_exit(sweep_partial_checkpoints, pathlib.Path(output) / "checkpoints")
        line = disk_full_line(error, output) if isinstance(error, Exception) else None
        if line is not None:
            raise DiskFullError(line) from None
        raise
    absl.removeFilter(quiet)
    sys.excepthook, sys.unraisablehook = hooks


def _after_disk_full(quiet: DiskFullFilter, excepthook, unraisablehook):
    """``sys.excepthook`` and ``sys.unraisablehook`` that say nothing for other threads
    once the disk was found full, nor of the event loop Orbax closed on a failed save
    (tensorstore's callbacks then fail with ``RuntimeError: Event loop is closed``: 71
    tracebacks in one DPO run, some before Orbax logs the failure itself)."""

    def silent(value) -> bool:
        if threading.current_thread() is threading.main_thread():
            return False
        # the closed loop's errors can come before Orbax logs the failure itself
        closed_loop = isinstance(value, RuntimeError) and str(value) == "Event loop is closed"
        if quiet.first is None and not closed_loop:
            return False
        quiet.dropped += 1
        return True

    def on_exception(kind, value, traceback):
        if not silent(value):
            excepthook(kind, value, traceback)

    def on_unraisable(unraisable):
        if not silent(unraisable.exc_value):
            unraisablehook(unraisable)

    return on_exception, on_unraisable
