"""An option's docs come from its field (issue 58): the options tables of docs/runs.md,
distill.md, vision.md and scale.md are ``posttrain.flags.markdown_rows`` of the option
classes, and every flag of every subcommand is named on one of its pages."""

from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest

from posttrain import flags
from posttrain.distill.options import DistillRunConfig
from posttrain.flags import option
from posttrain.plan.options import PlanOptions
from posttrain.sft.options import SFTConfig
from posttrain.training.options import PeftRunOptions, RunOptions, SupervisedRunOptions
from tests.test_cli_options import _subparsers

pytestmark = pytest.mark.host

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"

#: (page, heading) -> (the options class, the base whose fields its table leaves out)
TABLES = {
    ("runs.md", "### Every run: `RunOptions` (`sft`, `dpo`, `grpo`, `distill`)"): (
        RunOptions,
        None,
    ),
    ("runs.md", "### Runs over a dataset file: `PeftRunOptions` (`sft`, `dpo`, `distill`)"): (
        PeftRunOptions,
        RunOptions,
    ),
    ("runs.md", "### Supervised runs: `SupervisedRunOptions` (`sft`, `distill`)"): (
        SupervisedRunOptions,
        PeftRunOptions,
    ),
    ("distill.md", "### `posttrain distill`'s own options"): (
        DistillRunConfig,
        SupervisedRunOptions,
    ),
    ("vision.md", "## `posttrain sft --vision`"): (SFTConfig, SupervisedRunOptions),
    ("scale.md", "## Options"): (PlanOptions, None),
}

#: subcommand -> the pages that document its own flags (docs/runs.md: every run's)
PAGES = {
    "sft": ("sft.md", "vision.md"),
    "dpo": ("preference.md",),
    "grpo": ("rl.md",),
    "distill": ("distill.md",),
    "generate": ("generation.md", "vision.md"),
    "forward": ("sharding.md",),
    "plan": ("scale.md",),
    "convert": ("conversion.md",),
    "check-logits": ("conversion.md",),
}
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _read(page: str) -> str:
    return (DOCS / page).read_text(encoding="utf-8")


def prose(page: str) -> str:
    """``page`` without its fenced blocks: a flag only in a command is not documented."""
    return FENCE.sub("", _read(page))


def table_after(text: str, heading: str) -> list[str]:
    """The rows of the first table after ``heading`` (its header and rule left out)."""
    assert heading in text, f"no heading {heading!r}"
    lines = text[text.index(heading) :].splitlines()[1:]
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows[2:]


@pytest.mark.parametrize(("page", "heading"), list(TABLES))
def test_the_generated_tables_are_the_fields(page, heading):
    cls, since = TABLES[page, heading]
    expected = flags.markdown_rows(cls, since=since)
    got = table_after(_read(page), heading)
    assert got == expected, (
        f"docs/{page}'s table under {heading!r} is not its fields'; it should be:\n"
        + "\n".join(expected)
    )


def test_every_subcommand_has_a_page(monkeypatch):
    assert set(PAGES) == set(_subparsers(monkeypatch))


@pytest.mark.parametrize("command", list(PAGES))
def test_every_flag_is_on_its_pages(command, monkeypatch):
    """Each flag of ``posttrain COMMAND`` is named outside a command block on one of its
    pages or on docs/runs.md."""
    text = "\n".join(prose(page) for page in (*PAGES[command], "runs.md"))
    flags_ = [
        name
        for action in _subparsers(monkeypatch)[command]._actions
        for name in action.option_strings
        if name.startswith("--") and name != "--help"
    ]
    missing = [f for f in flags_ if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", text)]
    pages = ", ".join(f"docs/{p}" for p in (*PAGES[command], "runs.md"))
    assert not missing, f"posttrain {command}: flags on none of {pages}: {missing}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Options:
    steps: int = option(60, "optimizer steps")
    packing: bool = option(True, "one conversation per row")
    scan: bool = option(False, "scan the layers")
    mesh: str | None = option(None, "axis | sizes")
    src: str = option(positional=True, help="the source")


@dataclasses.dataclass(frozen=True, kw_only=True)
class _More(_Options):
    seed: int = option(3, "the seed")


def test_a_row_is_the_flag_its_default_and_its_help():
    assert flags.markdown_rows(_Options) == [
        "| `--steps` | 60 | optimizer steps |",
        "| `--no-packing` | - | one conversation per row |",
        "| `--scan` | - | scan the layers |",
        "| `--mesh` | - | axis \\| sizes |",  # a pipe would end the cell
    ]
    assert flags.markdown_rows(_More, since=_Options) == ["| `--seed` | 3 | the seed |"]
