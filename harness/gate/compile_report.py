"""Where a test run's time goes in JAX: ``pytest --compile-report PATH``.

Per test, one JSON line, written as the test ends (a run cut off by a time limit, as on a
lent chip, keeps the line of every test that finished, and none for the test it stopped)::

    {"test": NODEID, "wall_s": s, "trace_s": s, "lower_s": s, "compile_s": s,
     "programs": n, "cache_hits": n}

- ``trace_s``: tracing Python to jaxprs; ``lower_s``: jaxprs to MLIR modules;
- ``compile_s``: XLA's compiles, or the persistent cache's reads where it had the program;
- ``programs``: the XLA programs asked for (one per compile or cache read), ``cache_hits``
  of them served by the persistent compilation cache;
- ``wall_s``: the test's setup, call and teardown.

At the end the terminal summary gives the totals and the path. ``--resume`` continues the
run a report records: the tests it holds a line for are deselected, and the new lines
are appended (a tier longer than the time a chip is lent for, in several commands). ``python -m
harness.gate.compile_report PATH [--top N]`` reads a report back: its totals, then the
``N`` files and the ``N`` tests that took the most wall time (:func:`summarise`).

The figures are JAX's own events (``jax.monitoring``; jax 0.10.2
``jax/_src/dispatch.py``: ``JAXPR_TRACE_EVENT``, ``JAXPR_TO_MLIR_MODULE_EVENT``,
``BACKEND_COMPILE_EVENT`` around ``compiler.compile_or_get_cached``;
``jax/_src/compiler.py``: the event ``/jax/compilation_cache/cache_hits``). Tunix's
``MetricsLogger.close()`` clears every JAX listener
(``jax.monitoring.clear_event_listeners``), so the listeners are registered again before
each test where they are gone.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import pytest

TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
LOWER_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"

_SECONDS = {TRACE_EVENT: "trace_s", LOWER_EVENT: "lower_s", COMPILE_EVENT: "compile_s"}
COUNTS = ("programs", "cache_hits")
FIELDS = ("wall_s", "trace_s", "lower_s", "compile_s", *COUNTS)


class CompileReport:
    """The pytest plugin object of ``--compile-report PATH`` (registered by
    :mod:`harness.gate.pytest_plugin`); the file is truncated when the run starts, or with
    ``resume`` read (its tests are deselected: :attr:`finished`) and appended to.

    Raises:
      OSError: PATH cannot be written (at the start, before any test runs).
      ValueError: ``resume`` and PATH holds a line that is no report line (:func:`read`).
    """

    def __init__(self, path: str | pathlib.Path, *, resume: bool = False) -> None:
        self.path = pathlib.Path(path)
        #: the tests of the run being resumed (an absent PATH: none)
        self.finished = (
            {row["test"] for row in read(self.path)} if resume and self.path.exists() else set()
        )
        self.resumed = resume
        self._deselected = 0
        self._out = self.path.open("a" if resume else "w", encoding="utf-8")
        self._test = _zero_sums()
        self.totals = _zero_sums()
        self.tests = 0

    def on_duration(self, event: str, duration: float, **_kwargs) -> None:
        """A ``jax.monitoring`` duration listener."""
        field = _SECONDS.get(event)
        if field is None:
            return
        self._test[field] += duration
        if event == COMPILE_EVENT:
            self._test["programs"] += 1

    def on_event(self, event: str, **_kwargs) -> None:
        """A ``jax.monitoring`` event listener."""
        if event == CACHE_HIT_EVENT:
            self._test["cache_hits"] += 1

    def listen(self) -> None:
        """Registers the two listeners with JAX where they are not registered."""
        from jax import monitoring
        from jax._src import monitoring as internal  # the getters: no public ones

        if self.on_duration not in internal.get_event_duration_listeners():
            monitoring.register_event_duration_secs_listener(self.on_duration)
        if self.on_event not in internal.get_event_listeners():
            monitoring.register_event_listener(self.on_event)

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list) -> None:
        """``resume``: the tests the report already holds leave the run."""
        if not self.finished:
            return
        done = [item for item in items if item.nodeid in self.finished]
        if done:
            items[:] = [item for item in items if item.nodeid not in self.finished]
            config.hook.pytest_deselected(items=done)
        self._deselected = len(done)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem):
        self.listen()
        self._test = _zero_sums()
        start = time.perf_counter()
        outcome = yield
        if outcome.excinfo is not None:  # stopped inside (Ctrl-C, a time limit): not finished
            return
        self._test["wall_s"] = time.perf_counter() - start
        self.write(item.nodeid, self._test)

    def write(self, test: str, figures: dict[str, float]) -> None:
        """One test's line, flushed; its figures added to :attr:`totals`."""
        line = {"test": test}
        for field in FIELDS:
            value = figures[field]
            line[field] = int(value) if field in COUNTS else round(value, 4)
            self.totals[field] += value
        self.tests += 1
        self._out.write(json.dumps(line) + "\n")
        self._out.flush()

    def summary(self) -> str:
        """The terminal's line: the totals over every test written."""
        return "posttrain-harness: compile report " + totals_line(
            self.path, self.tests, self.totals
        )

    def pytest_terminal_summary(self, terminalreporter) -> None:
        terminalreporter.write_line(self.summary())
        if self.resumed:
            terminalreporter.write_line(
                f"posttrain-harness: resumed {self.path}: {self._deselected} tests it held "
                "deselected, this run's lines appended"
            )

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        self.close()

    def close(self) -> None:
        """Stops listening and closes the file."""
        from jax import monitoring
        from jax._src import monitoring as internal

        if self.on_duration in internal.get_event_duration_listeners():
            monitoring.unregister_event_duration_listener(self.on_duration)
        if self.on_event in internal.get_event_listeners():
            monitoring.unregister_event_listener(self.on_event)
        self._out.close()


def totals_line(path, tests: int, totals: dict[str, float]) -> str:
    """``PATH: N tests, W s; XLA compiles C s (P programs, H from the cache), tracing T s,
    lowering L s``."""
    t = totals
    return (
        f"{path}: {tests} tests, {t['wall_s']:.1f} s; XLA compiles {t['compile_s']:.1f} s "
        f"({int(t['programs'])} programs, {int(t['cache_hits'])} from the cache), "
        f"tracing {t['trace_s']:.1f} s, lowering {t['lower_s']:.1f} s"
    )


def read(path: str | pathlib.Path) -> list[dict]:
    """A report's lines (other keys, such as a ``command`` a caller added, are kept).

    Raises:
      OSError: the file cannot be read.
      ValueError: a line is not a JSON object with ``test`` and every field of
        :data:`FIELDS` as numbers, naming the file and line.
    """
    rows = []
    text = pathlib.Path(path).read_text(encoding="utf-8")
    for number, line in enumerate(text.splitlines(), 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        ok = isinstance(row, dict) and isinstance(row.get("test"), str)
        if not ok or not all(_is_number(row.get(field)) for field in FIELDS):
            raise ValueError(
                f"{path}:{number}: expected a JSON object with test and "
                f"{', '.join(FIELDS)} (a --compile-report line), got {line[:80]!r}"
            )
        rows.append(row)
    return rows


def _zero_sums() -> dict[str, float]:
    return dict.fromkeys(FIELDS, 0.0)


def _add(sums: dict[str, float], row: dict) -> None:
    """``row``'s :data:`FIELDS` added into ``sums``."""
    for field in FIELDS:
        sums[field] += row[field]


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def by_file(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Each test file's sums of :data:`FIELDS` and its ``tests``, by the test id's path
    (before ``::``), the file with the most wall time first."""
    files: dict[str, dict[str, float]] = {}
    for row in rows:
        sums = files.setdefault(row["test"].split("::")[0], {**_zero_sums(), "tests": 0})
        _add(sums, row)
        sums["tests"] += 1
    return dict(sorted(files.items(), key=lambda item: -item[1]["wall_s"]))


def summarise(path, rows: list[dict], top: int) -> str:
    """The totals line, then the ``top`` files and the ``top`` tests by wall time:
    wall, XLA compile and tracing + lowering seconds, programs and cache hits."""
    totals = _zero_sums()
    for row in rows:
        _add(totals, row)
    files = by_file(rows)
    head = f"{'wall_s':>8} {'compile_s':>9} {'trace+lower_s':>13} {'programs':>8} {'hits':>5}"
    out = [totals_line(path, len(rows), totals)]
    out.append(f"files by wall time ({min(top, len(files))} of {len(files)}):")
    out.append(f"{head} {'tests':>5}  file")
    for name, sums in list(files.items())[:top]:
        out.append(f"{_figures(sums)} {int(sums['tests']):>5}  {name}")
    tests = sorted(rows, key=lambda row: -row["wall_s"])[:top]
    out.append(f"tests by wall time ({len(tests)} of {len(rows)}):")
    out.append(f"{head}  test")
    out.extend(f"{_figures(row)}  {row['test']}" for row in tests)
    return "\n".join(out)


def _figures(sums) -> str:
    traced = sums["trace_s"] + sums["lower_s"]
    return (
        f"{sums['wall_s']:>8.1f} {sums['compile_s']:>9.1f} {traced:>13.1f} "
        f"{int(sums['programs']):>8} {int(sums['cache_hits']):>5}"
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m harness.gate.compile_report PATH [--top N] [--tests FILE]``: prints
    :func:`summarise` (of the tests FILE names only, with how many of them have a line);
    a report or FILE it cannot read is a usage error (exit 2, one line)."""
    parser = argparse.ArgumentParser(
        prog="python -m harness.gate.compile_report",
        description="Where a --compile-report run's time went: totals, files and tests.",
    )
    parser.add_argument("path", help="a file written by pytest --compile-report")
    parser.add_argument("--top", type=int, default=10, help="files and tests shown (default: 10)")
    parser.add_argument(
        "--tests",
        metavar="FILE",
        help="only the lines of the tests FILE names (the node ids `pytest --collect-only "
        "-q` prints; its other lines are ignored): what that selection cost in this run",
    )
    args = parser.parse_args(argv)
    if args.top < 1:
        parser.error(f"--top {args.top}: expected >= 1")
    try:
        rows = read(args.path)
    except OSError as error:
        parser.error(f"{args.path}: cannot be read ({error.strerror})")
    except ValueError as error:
        parser.error(str(error))
    if args.tests is not None:
        try:
            chosen = node_ids(pathlib.Path(args.tests).read_text(encoding="utf-8"))
        except OSError as error:
            parser.error(f"--tests {args.tests}: cannot be read ({error.strerror})")
        except UnicodeDecodeError:
            parser.error(f"--tests {args.tests}: not UTF-8 text (expected node ids)")
        if not chosen:
            parser.error(f"--tests {args.tests}: names no test (expected node ids, one a line)")
        rows = [row for row in rows if row["test"] in chosen]
        print(
            f"--tests {args.tests}: {len(rows)} of its {len(chosen)} tests have a line here "
            f"({len(chosen) - len(rows)} none)"
        )
    print(summarise(args.path, rows, args.top))
    return 0


def node_ids(text: str) -> set[str]:
    """The node ids in ``text``: its lines holding ``::``, stripped (``pytest
    --collect-only -q``'s other lines, blank or a count, hold none)."""
    return {line.strip() for line in text.splitlines() if "::" in line}


if __name__ == "__main__":
    sys.exit(main())
