"""Upstream deprecations as a verdict of their own: the matrix's ``warn`` cells.

Under ``pytest --upstream-deprecations=record`` (what the matrix runs) a
``DeprecationWarning``, ``PendingDeprecationWarning`` or ``FutureWarning`` whose
attributed module (the ``module`` a warnings filter matches: the ``__name__`` of the
frame ``stacklevel`` points at) is not one of :data:`OWN_PACKAGES` is shown instead of
raised, whatever ``filterwarnings`` says (the project's ``error`` and its named
ignores alike). Each one seen while a test is set up, run or torn down, or while its
module is collected, is recorded on the test as the JUnit property
``upstream_deprecations``: a JSON list of ``"Category: message (file:line)"`` lines.
A passing contract with such a property is a ``warn`` cell (``harness.matrix.matrix``).
The pytest side (the plugin object that records) is ``harness.gate.deprecation_recorder.Recorder``;
this module needs no pytest, as the matrix's own process reads the properties.

A deprecation attributed to our own code stays whatever ``filterwarnings`` makes it
(``error`` in this project): calling a deprecated API is our bug to fix, not an
early signal from upstream. Under the default ``--upstream-deprecations=error``
nothing changes, which is what the gate runs.

Why not ``-W ignore::DeprecationWarning:tunix``: ``-W`` escapes its module field and
anchors it (``tunix\\Z``), so it never matches ``tunix.sft.peft_trainer``; and a filter
cannot tell "record" from "ignore". A nested ``warnings.catch_warnings(record=True)``
around each phase, with one filter in front, can.
"""

from __future__ import annotations

import contextlib
import json
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

OWN_PACKAGES: tuple[str, ...] = ("posttrain", "harness", "contracts", "tests")
"""Top-level packages whose warnings are ours (and stay errors)."""
CATEGORIES: tuple[type[Warning], ...] = (
    DeprecationWarning,
    PendingDeprecationWarning,
    FutureWarning,
)
PROPERTY = "upstream_deprecations"
UPSTREAM_MODULE = rf"(?!(?:{'|'.join(OWN_PACKAGES)})(?:\.|$))"
"""A ``warnings`` module filter (``re.match``) for every module outside :data:`OWN_PACKAGES`."""
REPO = Path(__file__).resolve().parents[2]


WIDTH = 240
_STDLIB = re.compile(r"^.*/lib/(python3\.\d+/)")


def describe(message: warnings.WarningMessage) -> str:
    """``"Category: message (path:line)"``, the message on one line (cut at
    :data:`WIDTH`); a path inside an environment is shown from its ``site-packages/`` on,
    one in the standard library from ``python3.X/`` on."""
    path = str(message.filename).split("site-packages/", 1)[-1]
    path = _STDLIB.sub(r"\1", path)
    text = " ".join(str(message.message).split())
    text = text if len(text) <= WIDTH else text[: WIDTH - 1] + "…"
    return f"{message.category.__name__}: {text} ({path}:{message.lineno})"


def _ours(message: warnings.WarningMessage) -> bool:
    """A file of this checkout outside any installed environment (the filter already
    kept our modules out; this is a second line of defence)."""
    path = Path(str(message.filename))
    if not path.is_absolute() or {"site-packages", "dist-packages"} & set(path.parts):
        return False
    return path.resolve().is_relative_to(REPO)


@contextlib.contextmanager
def recording(sink: list[str]) -> Iterator[None]:
    """Upstream deprecations raised inside are described into ``sink`` instead of
    raised; every other warning shown inside is re-issued outside, to pytest's own
    record, as it would have been."""
    with warnings.catch_warnings(record=True) as log:
        for category in CATEGORIES:
            warnings.filterwarnings("always", category=category, module=UPSTREAM_MODULE)
        try:
            yield
        finally:
            others = []
            for message in log:
                if issubclass(message.category, CATEGORIES) and not _ours(message):
                    text = describe(message)
                    if text not in sink:
                        sink.append(text)
                else:
                    others.append(message)
    for message in others:
        warnings.warn_explicit(
            message.message, message.category, str(message.filename), message.lineno
        )


def from_properties(properties: dict[str, str]) -> list[str]:
    """The descriptions a JUnit testcase's properties hold (``[]`` for none)."""
    raw = properties.get(PROPERTY)
    return list(json.loads(raw)) if raw else []
