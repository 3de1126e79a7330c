"""What the matrix is doing, for a person watching it and for a CI log.

On a terminal: a live status line under the log (rich's ``Console.status``) naming the
row, its phase and both elapsed times, ``[1/2] tunix-0.1.7 · contracts · 0:42 (row
1:31, all 2:05)``, redrawn a few times a second and gone at the end. Elsewhere (CI, a
pipe, a file): only the log lines, one per event, no control characters.

The matrix calls :meth:`Progress.row` when a row starts, :meth:`Progress.phase` when
it enters a phase, :meth:`Progress.log` for a line to keep (a row's start and its
verdict), and :meth:`Progress.close` at the end.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import IO

from rich.console import Console
from rich.status import Status

from harness.matrix import sources


def clock(seconds: float) -> str:
    """``m:ss`` (``h:mm:ss`` from an hour on) of a non-negative duration, rounded down."""
    whole = int(max(seconds, 0.0))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class Progress:
    """The matrix's progress: log lines always, a live status line on a terminal.

    Args:
      total: the number of rows this run will run.
      stream: where it all goes (default: stderr, read at construction).
      live: show the status line (default: ``stream`` is a terminal).
      now: the clock (tests: a fake one).
    """

    def __init__(
        self,
        total: int,
        stream: IO[str] | None = None,
        *,
        live: bool | None = None,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = total
        self.now = now
        self.started = now()
        self.row_started = self.started
        self.where = f"[0/{total}]"  # no row yet
        self.current = "starting"
        self.console = Console(
            file=stream if stream is not None else sys.stderr,
            force_terminal=live,
            highlight=False,
            soft_wrap=True,
        )
        self.live = self.console.is_terminal
        self._status: Status | None = None

    def status_text(self) -> str:
        """The live line: row, phase, the phase's row time and the whole run's."""
        t = self.now()
        return (
            f"{self.where} · {self.current} · row {clock(t - self.row_started)}, "
            f"all {clock(t - self.started)}"
        )

    def __rich__(self) -> str:
        return self.status_text()

    def row(self, index: int, name: str) -> None:
        """Row ``index`` (from 1) of :attr:`total`, named ``name``, starts."""
        self.where = f"[{index}/{self.total}] {name}"
        self.row_started = self.now()
        self.current = "starting"
        if self.live and self._status is None:
            self._status = self.console.status(self)
            self._status.start()

    def phase(self, name: str) -> None:
        """The current row enters phase ``name`` (shown live only, drawn at once: the
        redraw timer alone could skip a short phase)."""
        self.current = name
        if self._status is not None:
            self._status.update(self)

    def log(self, line: str) -> None:
        """A line kept in the log (printed above the live line on a terminal), with the
        credentials of any URL in it redacted (:func:`harness.matrix.sources.redact`)."""
        self.console.print(sources.redact(line), markup=False, emoji=False)

    def close(self) -> None:
        """Removes the live line (idempotent)."""
        if self._status is not None:
            self._status.stop()
            self._status = None
