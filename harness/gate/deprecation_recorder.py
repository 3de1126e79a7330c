"""The pytest side of :mod:`harness.gate.deprecations`: the plugin object that
``--upstream-deprecations=record`` registers (:mod:`harness.gate.pytest_plugin`). It records
each upstream deprecation raised while a test (or the collector above it) runs, and
writes them as the test's JUnit property :data:`harness.gate.deprecations.PROPERTY`.

Its mutation target (harness/tools/mutants.py) scores nothing: it runs only inside the child
pytest sessions of tests/test_verdicts.py and the matrix, where mutmut records no test
for it; those tests fail when it records nothing or the wrong thing."""

from __future__ import annotations

import json

import pytest

from harness.gate import deprecations

_SEEN = pytest.StashKey[list[str]]()


class Recorder:
    """The pytest plugin object ``--upstream-deprecations=record`` registers."""

    def __init__(self) -> None:
        self.collected: dict[str, list[str]] = {}  # collector node id -> descriptions

    @pytest.hookimpl(wrapper=True)
    def pytest_make_collect_report(self, collector: pytest.Collector):
        sink = self.collected.setdefault(collector.nodeid, [])
        with deprecations.recording(sink):
            return (yield)

    def _phase(self, item: pytest.Item):
        sink = item.stash.setdefault(_SEEN, [])
        return deprecations.recording(sink)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item):
        with self._phase(item):
            return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item):
        with self._phase(item):
            return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item, nextitem: pytest.Item | None):
        try:
            with self._phase(item):
                return (yield)
        finally:
            # After teardown, before its report: the JUnit writer reads the properties
            # of the teardown report.
            seen = [
                text for node in item.listchain() for text in self.collected.get(node.nodeid, [])
            ]
            seen += [t for t in item.stash.get(_SEEN, []) if t not in seen]
            if seen:
                item.user_properties.append((deprecations.PROPERTY, json.dumps(seen)))
