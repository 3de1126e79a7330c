"""pytest's JUnit XML, read once for the gate and the matrix, in one vocabulary.

Each testcase has one :data:`OUTCOMES` value: ``failed`` if it has a ``failure``,
else ``error`` if it has an ``error`` (setup, teardown or collection), else
``skipped`` (xfail included), else ``passed``. The gate counts them; the matrix
groups them into contract cells, each cell taking its worst case's outcome.
"""

from __future__ import annotations

import dataclasses
import xml.etree.ElementTree as ET
from pathlib import Path

OUTCOMES = ("passed", "skipped", "failed", "error")
"""Every outcome, from best to worst (a matrix cell takes its worst case's)."""
_TAGS = (("failure", "failed"), ("error", "error"), ("skipped", "skipped"))
_BARE = ("collection failure", "failed on setup")  # messages that say where, not what


@dataclasses.dataclass(frozen=True)
class Case:
    """One testcase.

    Attributes:
      classname, name: as pytest wrote them (``tests.test_a.TestB``, ``test_c[x]``).
      outcome: one of :data:`OUTCOMES`.
      message: the first line of what went wrong (see :func:`first_line`); ``""`` passed.
      properties: the testcase's ``<property>`` elements (e.g. ``contract``).
    """

    classname: str
    name: str
    outcome: str
    message: str
    properties: dict[str, str]

    def node_id(self, root: Path) -> str:
        """The pytest node id, e.g. ``tests/test_a.py::TestB::test_c[x]``.

        pytest writes ``classname="tests.test_a.TestB" name="test_c[x]"`` (a collection
        error: ``classname="" name="tests.test_a"``); the longest dotted prefix naming a
        file under ``root`` is the module. Falls back to ``classname::name``.
        """
        classname, name = self.classname, self.name
        parts, tail = (classname.split("."), [name]) if classname else (name.split("."), [])
        for cut in range(len(parts), 0, -1):
            module = Path(*parts[:cut]).with_suffix(".py")
            if (root / module).is_file():
                return "::".join([module.as_posix(), *parts[cut:], *tail])
        return "::".join(part for part in (classname, name) if part)


@dataclasses.dataclass(frozen=True)
class Report:
    """A JUnit file: its cases, summed suite time and suite properties."""

    cases: list[Case]
    time_s: float
    properties: dict[str, str]


def first_line(element: ET.Element | None, tag: str = "", width: int = 160) -> str:
    """What went wrong, in one line of at most ``width`` characters.

    JUnit's ``message``; for a bare one ("collection failure", "failed on setup") or
    none, the last ``E   ...`` line of the traceback joined to it; else the text's first
    line; else ``tag``.
    """
    if element is None:
        return ""
    message = next((s.strip() for s in (element.get("message") or "").splitlines() if s), "")
    text = element.text or ""
    raised = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
    if raised and (not message or message in _BARE):
        message = f"{message}: {raised[-1]}" if message else raised[-1]
    if not message:
        message = next((line.strip() for line in text.splitlines() if line.strip()), tag)
    return message if len(message) <= width else message[: width - 3] + "..."


def read(path: Path, width: int = 160) -> Report:
    """Every testcase of the JUnit file ``path`` (a ``testsuites`` or one ``testsuite``).

    Raises:
      xml.etree.ElementTree.ParseError: not XML.
    """
    top = ET.parse(path).getroot()
    suites = [top] if top.tag == "testsuite" else top.findall("testsuite")
    cases, time_s, properties = [], 0.0, {}
    for suite in suites:
        time_s += float(suite.get("time") or 0.0)
        for prop in suite.findall("properties/property"):
            properties[prop.get("name", "")] = prop.get("value", "")
        for case in suite.iter("testcase"):
            outcome, element, tag = "passed", None, ""
            for tag, name in _TAGS:
                element = case.find(tag)
                if element is not None:
                    outcome = name
                    break
            cases.append(
                Case(
                    classname=case.get("classname", ""),
                    name=case.get("name", "?"),
                    outcome=outcome,
                    message=first_line(element, tag, width),
                    properties={p.get("name"): p.get("value") for p in case.iter("property")},
                )
            )
    return Report(cases, round(time_s, 2), properties)


def worst(outcomes) -> str:
    """The worst of ``outcomes`` (``passed`` for none)."""
    return max(outcomes, key=OUTCOMES.index, default="passed")
