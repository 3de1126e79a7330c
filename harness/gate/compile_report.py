"""Where a test run's time goes in JAX: ``pytest --compile-report PATH``.

Per test, one JSON line, written as the test ends (a run cut off by a time limit, as on a
lent chip, keeps the line of every test that finished)::

    {"test": NODEID, "wall_s": s, "trace_s": s, "lower_s": s, "compile_s": s,
     "programs": n, "cache_hits": n}

- ``trace_s``: tracing Python to jaxprs; ``lower_s``: jaxprs to MLIR modules;
- ``compile_s``: XLA's compiles, or the persistent cache's reads where it had the program;
- ``programs``: the XLA programs asked for (one per compile or cache read), ``cache_hits``
  of them served by the persistent compilation cache;
- ``wall_s``: the test's setup, call and teardown.

At the end the terminal summary gives the totals and the path. The figures are JAX's own
events (``jax.monitoring``; jax 0.10.2 ``jax/_src/dispatch.py``: ``JAXPR_TRACE_EVENT``,
``JAXPR_TO_MLIR_MODULE_EVENT``, ``BACKEND_COMPILE_EVENT`` around
``compiler.compile_or_get_cached``; ``jax/_src/compiler.py``: the event
``/jax/compilation_cache/cache_hits``). Tunix's ``MetricsLogger.close()`` clears every JAX
listener (``jax.monitoring.clear_event_listeners``), so the listeners are registered again
before each test where they are gone.
"""

from __future__ import annotations

import json
import pathlib
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
    :mod:`harness.gate.pytest_plugin`); the file is truncated when the run starts.

    Raises:
      OSError: PATH cannot be written (at the start, before any test runs).
    """

    def __init__(self, path: str | pathlib.Path) -> None:
        self.path = pathlib.Path(path)
        self._out = self.path.open("w", encoding="utf-8")
        self._test = self._zero()
        self.totals = self._zero()
        self.tests = 0

    @staticmethod
    def _zero() -> dict[str, float]:
        return dict.fromkeys(FIELDS, 0.0)

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

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem):
        self.listen()
        self._test = self._zero()
        start = time.perf_counter()
        yield
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
        t = self.totals
        return (
            f"posttrain-harness: compile report {self.path}: {self.tests} tests, "
            f"{t['wall_s']:.1f} s; XLA compiles {t['compile_s']:.1f} s "
            f"({int(t['programs'])} programs, {int(t['cache_hits'])} from the cache), "
            f"tracing {t['trace_s']:.1f} s, lowering {t['lower_s']:.1f} s"
        )

    def pytest_terminal_summary(self, terminalreporter) -> None:
        terminalreporter.write_line(self.summary())

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
