"""The matrix's rows: ``compat/entries.toml`` read, checked and selected.

Each entry names a Tunix release (or ``main``), a flavour (``current``: today's
dependencies; ``era``: the release's own era, pinned; ``emulated``: a train-step
convention no installable release has, run in its ``base`` release's environment;
``source``: Tunix built from a git URL or a local checkout, ``harness.matrix.sources``),
the convention its trainer uses and optional pins.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from posttrain.training import CONVENTIONS

REPO = Path(__file__).resolve().parents[2]
ENTRIES_FILE = REPO / "compat" / "entries.toml"
FLAVOURS = ("current", "era", "emulated", "source")
TEST_TOOLS = ("pytest>=8", "pytest-xdist>=3.5", "hypothesis>=6.100")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One matrix row (see ``compat/entries.toml`` for the fields)."""

    name: str
    tunix: str
    flavour: str
    convention: str
    pins: tuple[str, ...] = ()
    default: bool = False
    emulated: bool = False
    base: str | None = None
    broken: str | None = None
    source: str | None = None  # flavour "source": a git URL (@ref) or a directory
    requirements: tuple[str, ...] | None = None  # tests: replaces the whole install spec
    # Set by the matrix, never read from the file: (id, requirement) of the resolved source.
    resolved: tuple[str, str] | None = None

    def install_spec(self) -> list[str]:
        """What ``uv pip install`` gets besides the editable checkout.

        Raises:
          ValueError: a source entry whose source has not been resolved yet.
        """
        if self.requirements is not None:
            return list(self.requirements)
        if self.source is not None:
            if self.resolved is None:
                raise ValueError(f"entry {self.name}: source {self.source!r} is not resolved")
            return [self.resolved[1], *self.pins, *TEST_TOOLS]
        return [f"google-tunix=={self.tunix}", *self.pins, *TEST_TOOLS]


_FIELD_TYPES: dict[str, Any] = typing.get_type_hints(Entry)
"""Entry field -> its annotation: what a key of the file must hold (a TOML list for a
tuple)."""


def _has_type(value: Any, expected: Any) -> bool:
    """Whether a TOML value fits a field annotation (str, bool, tuple[str, ...], X | None)."""
    if expected is str or expected is bool:
        return type(value) is expected  # a TOML integer 1 or a string "no" is no bool
    if typing.get_origin(expected) in (types.UnionType, typing.Union):
        return any(_has_type(value, arm) for arm in typing.get_args(expected))
    if expected is type(None):
        return value is None
    if typing.get_origin(expected) is tuple:
        return isinstance(value, list) and all(isinstance(x, str) for x in value)
    raise TypeError(f"no TOML check for {expected!r}")  # a new Entry field: add its check


def _describe(expected: Any) -> str:
    if expected is bool:
        return "true or false"
    if expected is str:
        return "a string"
    if typing.get_origin(expected) is tuple:
        return "a list of requirement strings"
    arms = [a for a in typing.get_args(expected) if a is not type(None)]
    return " or ".join(_describe(a) for a in arms)


def _entry(path: Path, i: int, item) -> tuple[Entry, str]:
    """Entry ``i`` of file ``path``, checked alone (``load_entries`` checks the set), and
    the ``where`` its errors start with.

    Raises:
      ValueError: as :func:`load_entries`, for this entry's own fields.
    """
    fields = {f.name for f in dataclasses.fields(Entry)} - {"resolved"}
    if not isinstance(item, dict):
        raise ValueError(f"{path}: entry {i} is a {type(item).__name__}; expected a table")
    where = f"{path}: entry {i} ({item.get('name', '?')})"
    unknown = sorted(set(item) - fields)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; expected {sorted(fields)}")
    for name in ("name", "tunix", "flavour", "convention"):
        if not isinstance(item.get(name), str):
            raise ValueError(f"{where}: {name} = {item.get(name)!r}; expected a string")
    source = item.get("source")
    if source is not None and not (isinstance(source, str) and source.strip()):
        raise ValueError(f"{where}: source = {source!r}; expected a git URL or a directory")
    if source is not None and "://" not in source and "@" not in source.split("/")[0]:
        local = Path(source).expanduser()  # a relative directory: relative to the file
        item = {**item, "source": str(local if local.is_absolute() else path.parent / local)}
    pins = item.get("pins", [])
    if not (isinstance(pins, list) and all(isinstance(p, str) for p in pins)):
        raise ValueError(f"{where}: pins = {pins!r}; expected a list of requirement strings")
    for name, value in item.items():
        expected = _FIELD_TYPES[name]
        if not _has_type(value, expected):
            raise ValueError(f"{where}: {name} = {value!r}; expected {_describe(expected)}")
    try:
        entry = Entry(**{**item, "pins": tuple(pins)})
    except TypeError as e:
        raise ValueError(f"{where}: {e}") from None
    if entry.flavour not in FLAVOURS:
        raise ValueError(f"{where}: flavour {entry.flavour!r}; expected one of {FLAVOURS}")
    if entry.convention not in CONVENTIONS:
        raise ValueError(f"{where}: convention {entry.convention!r}; expected one of {CONVENTIONS}")
    if (entry.flavour == "source") != (entry.source is not None):
        raise ValueError(
            f"{where}: flavour {entry.flavour!r} with source = {entry.source!r}; expected "
            "a source (a git URL with @ref, or a directory) exactly for flavour 'source'"
        )
    return entry, where


def load_entries(path: Path = ENTRIES_FILE) -> list[Entry]:
    """Reads and checks the entries.

    Raises:
      ValueError: naming the file, entry or field: a missing or malformed file, an entry
        that is not a table, an unknown key, flavour or convention, a field of the wrong
        type (``pins`` a string, ``default = "no"``: each key's type is its ``Entry``
        annotation), a duplicate name, an emulated entry without ``base``.
    """
    path = Path(path)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise ValueError(f"entries file {path} {what}; expected a TOML file")
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f).get("entry", [])
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"entries file {path}: not valid TOML ({e})") from None
    if not isinstance(raw, list):
        raise ValueError(f"{path}: 'entry' is a {type(raw).__name__}; expected [[entry]] tables")
    entries: list[Entry] = []
    for i, item in enumerate(raw):
        entry, where = _entry(path, i, item)
        if any(e.name == entry.name for e in entries):
            raise ValueError(f"{where}: duplicate name")
        entries.append(entry)
    names = {e.name for e in entries}
    for e in entries:
        if e.emulated and e.base not in names:
            raise ValueError(f"{path}: entry {e.name}: base {e.base!r} is not an entry")
        if e.emulated and next(b for b in entries if b.name == e.base).source is not None:
            raise ValueError(
                f"{path}: entry {e.name}: base {e.base!r} is a source entry; expected a release"
            )
    return entries


def with_source(entries: list[Entry], spec: str) -> tuple[list[Entry], Entry]:
    """``--tunix-source``: ``spec`` as the source of the file's ``source`` entry (the
    first one), or a new entry ``tunix-source`` (the newest known convention) when the
    file has none; the entries and that entry."""
    for i, entry in enumerate(entries):
        if entry.flavour == "source":
            chosen = dataclasses.replace(entry, source=spec)
            return [*entries[:i], chosen, *entries[i + 1 :]], chosen
    chosen = Entry(
        name="tunix-source",
        tunix="source",
        flavour="source",
        convention=CONVENTIONS[-1],
        source=spec,
    )
    return [*entries, chosen], chosen


def select(
    entries: list[Entry], only: Sequence[str] = (), all_entries: bool = False
) -> list[Entry]:
    """``--only`` names (or prefixes), else every entry with ``--all``, else the defaults.

    Raises:
      ValueError: an ``--only`` value matches no entry.
    """
    if only:
        chosen = []
        for name in only:
            match = [e for e in entries if e.name == name] or [
                e for e in entries if e.name.startswith(name)
            ]
            if not match:
                raise ValueError(
                    f"--only {name!r} matches no entry; entries: "
                    f"{', '.join(e.name for e in entries)}"
                )
            chosen += [e for e in match if e not in chosen]
        return chosen
    return list(entries) if all_entries else [e for e in entries if e.default]
