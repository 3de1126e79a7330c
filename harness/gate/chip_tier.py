"""What the tier of a real accelerator leaves out, and why.

A chip's tier is for what the chip computes. On a real TPU or GPU (``--devices real``,
``tox -e tpu``) it leaves out, and counts in its summary:

- the tests marked ``host``: host code only (CLI parsing, reports, git, local processes);
- the tests marked ``wiring``: that a value reaches where it acts (a config field changes
  the logits, an option lands in the model or Tunix's config, a fixture's quirk breaks
  parity when switched off, a bad input is refused before a step runs). No chip's
  arithmetic changes that; the device code they go through is what the chip's own tests
  of numerics, kernels and memory run;
- the variants of a test marked ``chip_sample(id, ...)`` that it does not name: the CPU
  tier runs every variant, the chip the named ones, whose paths differ there (a dtype, a
  kernel, a family's layer pattern). The others differ in host-side values (a layout a
  converter reads, a config's number) or repeat a named one's programs.

``--host-tests`` decides for ``host`` and ``wiring``, ``--chip-variants`` for the samples;
``auto`` (both defaults) leaves them out on a real accelerator and runs them on the CPU,
so the CPU gate runs everything. A ``chip_sample`` marker naming an id its test does not
have fails that module's collection on every backend (a renamed variant must not leave
the chip running none).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

import pytest

ACCELERATOR_BACKENDS: tuple[str, ...] = ("tpu", "gpu")

#: marker -> why a real accelerator's tier leaves its tests out (the summary line's tail)
REASONS: dict[str, str] = {
    "host": "host code only (CLI parsing, reports, git, local processes): the CPU tier runs "
    "it; --host-tests run keeps it here",
    "wiring": "a value reaching where it acts (config fields, options, fixtures' quirks, "
    "refusals), which no chip's arithmetic changes: the CPU tier runs it; --host-tests run "
    "keeps it here",
    "chip_sample": "variants the CPU tier runs, whose device paths a named sibling runs "
    "here; --chip-variants all keeps them here",
}


def leaves_out_host_tests(config: pytest.Config, backend: str) -> bool:
    """Whether tests marked ``host`` or ``wiring`` are left out: ``--host-tests``, and for
    ``auto`` whether ``backend`` is a real accelerator."""
    choice = config.getoption("host_tests")
    return choice == "skip" or (choice == "auto" and backend in ACCELERATOR_BACKENDS)


def samples_variants(config: pytest.Config, backend: str) -> bool:
    """Whether only the named variants of a ``chip_sample`` test run: ``--chip-variants``,
    and for ``auto`` whether ``backend`` is a real accelerator."""
    choice = config.getoption("chip_variants")
    return choice == "sampled" or (choice == "auto" and backend in ACCELERATOR_BACKENDS)


def sampled_ids(marker: pytest.Mark, test: str) -> frozenset[str]:
    """The variant ids a ``chip_sample`` marker names.

    Raises:
        ValueError: no id, an id that is not a non-empty string, or keyword arguments.
    """
    ids = marker.args
    if not ids or marker.kwargs or not all(isinstance(i, str) and i for i in ids):
        raise ValueError(
            f"{test}: chip_sample takes the ids of the variants the chip runs, got "
            f"{marker.args!r} {marker.kwargs!r}"
        )
    return frozenset(ids)


def unknown_samples(collected: Iterable[object]) -> str | None:
    """Why a collector's items are wrong, or ``None``: a ``chip_sample`` marker on a test
    without variants, or naming an id none of the test's variants has.

    ``collected`` is a collector's result (its Function items and sub-collectors), before
    ``-k`` or a node id narrows it, so every variant of a function is there.
    """
    variants: dict[str, set[str]] = collections.defaultdict(set)
    named: dict[str, frozenset[str]] = {}
    for item in collected:
        if not isinstance(item, pytest.Function):
            continue
        marker = item.get_closest_marker("chip_sample")
        if marker is None:
            continue
        test = item.nodeid.partition("[")[0]  # the function's node id, without the variant
        try:
            named[test] = sampled_ids(marker, test)
        except ValueError as error:
            return f"posttrain-harness: {error}"
        callspec = getattr(item, "callspec", None)
        if callspec is None:
            return f"posttrain-harness: {test}: chip_sample on a test without variants"
        variants[test].add(callspec.id)
    for test, ids in named.items():
        missing = sorted(ids - variants[test])
        if missing:
            return (
                f"posttrain-harness: {test}: chip_sample names {', '.join(missing)}; its "
                f"variants are {', '.join(sorted(variants[test]))}"
            )
    return None


def _left_out_by(item: pytest.Item, host: bool, sample: bool) -> str | None:
    """The marker that leaves ``item`` out of this run, or ``None``."""
    if host:
        for name in ("host", "wiring"):
            if item.get_closest_marker(name) is not None:
                return name
    if sample:
        marker = item.get_closest_marker("chip_sample")
        callspec = getattr(item, "callspec", None)
        if (
            marker is not None
            and callspec is not None
            and callspec.id not in sampled_ids(marker, item.nodeid)
        ):
            return "chip_sample"
    return None


def select(config: pytest.Config, items: list[pytest.Item], backend: str) -> dict[str, int]:
    """Deselects what this run leaves out (through ``pytest_deselected``, so ``-v`` and
    the summary's ``deselected`` count it) and returns how many per marker, every marker
    this run leaves out present (0 included): empty when it leaves none out."""
    host = leaves_out_host_tests(config, backend)
    sample = samples_variants(config, backend)
    counts = {
        name: 0 for name, on in (("host", host), ("wiring", host), ("chip_sample", sample)) if on
    }
    if not counts:
        return counts
    kept, dropped = [], []
    for item in items:
        reason = _left_out_by(item, host, sample)
        if reason is None:
            kept.append(item)
        else:
            counts[reason] += 1
            dropped.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
    return counts


def summary_lines(counts: dict[str, int], backend: str) -> list[str]:
    """The summary's lines: for each marker this run left tests out by, how many and why
    (``host`` always, when host tests are left out, so a tier says it left out none)."""
    lines = []
    for name, count in counts.items():
        if count or name == "host":
            what = "variants of tests" if name == "chip_sample" else "tests"
            lines.append(
                f"posttrain-harness: left out {count} {what} marked {name} on {backend}: "
                f"{REASONS[name]}"
            )
    return lines
