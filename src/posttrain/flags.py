"""Command-line flags generated from an options dataclass, and the options back from them.

One field is one flag: ``--`` + the name with ``-`` for ``_`` (or the field's ``flag``),
its help from the field's metadata, its default from the field's default, ``choices=``
from a ``Literal`` annotation, the argparse ``type`` from the annotation:

==================================  =================================================
field                               flag
==================================  =================================================
``steps: int = option(60, ...)``    ``--steps N`` (type int, default 60)
``lora_alpha: float | None``        ``--lora-alpha X`` (type float, default None)
``remat: RematPolicy``              ``--remat {none,full,save_dots}``
``x: Literal[...]``, ``checked``    ``--x {a,b}`` as metavar; ``check()`` rejects others
                                    with its one-line message (argparse's is two lines)
``sync_saves: bool = False``        ``--sync-saves`` (store_true)
``packing: bool = True``            ``--no-packing`` (store_false)
``reward: tuple[str, ...]``         ``--reward X`` repeatable; none given: the default
``mesh`` with ``parse=``            a string, turned into the value by ``parse`` after
                                    parsing (its ValueError: one line, exit 2)
``src: str = option(positional)``   the positional argument ``src``
==================================  =================================================

A subcommand is then one options dataclass and one function taking it
(:data:`posttrain.cli.COMMANDS`). Nothing here imports JAX.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, NoReturn

_MISSING = dataclasses.MISSING


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line (#56): the option and what is
    wrong with it, then where the usage is (``posttrain plan: error: argument --seq:
    invalid int value: '1e12'; see `posttrain plan --help```), exit 2. Its subparsers are
    of this class too (argparse's default ``parser_class``)."""

    def error(self, message: str) -> NoReturn:
        text = " ".join(message.split())
        self.exit(2, f"{self.prog}: error: {text}; see `{self.prog} --help`\n")


def option(
    default: Any = _MISSING,
    help: str = "",  # noqa: A002 - argparse's name
    *,
    flag: str | None = None,
    parse: Callable[[str], Any] | None = None,
    argtype: Callable[[str], Any] | None = None,
    checked: bool = False,
    positional: bool = False,
    required: bool = False,
    show_default: bool = True,
) -> Any:
    """A dataclass field that is also a command-line flag.

    Args:
      default: the field's default (none: a positional or required flag).
      help: the flag's help; `` (default %(default)s)`` is added for a value flag with a
        default other than None unless ``show_default`` is False.
      flag: the flag's name when it is not ``--`` + the field name with dashes.
      parse: turns the flag's string into the field's value after parsing (a
        ``ValueError`` from it is one line and exit 2, as from ``check()``).
      argtype: argparse's ``type=`` (its error is argparse's usage line and exit 2).
      checked: a ``Literal`` field whose values ``check()`` validates: the choices are
        shown as the metavar, not enforced by argparse.
      positional: a positional argument.
      required: a required flag.
      show_default: see ``help``.
    """
    metadata = {
        "help": help,
        "flag": flag,
        "parse": parse,
        "argtype": argtype,
        "checked": checked,
        "positional": positional,
        "required": required,
        "show_default": show_default,
    }
    return dataclasses.field(default=default, metadata=metadata)


def _base_type(annotation):
    """``annotation`` without its ``| None`` (``int | None`` -> ``int``); a union of
    several types stays whole."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


def _flag_name(field: dataclasses.Field, hint) -> str:
    if field.metadata["flag"]:
        return field.metadata["flag"]
    if hint is bool and field.default is True:
        return "--no-" + field.name.replace("_", "-")
    return "--" + field.name.replace("_", "-")


def _fields(cls) -> list[tuple[dataclasses.Field, Any]]:
    """``(field, its annotation without None)`` of each command-line field of ``cls``."""
    hints = typing.get_type_hints(cls)
    return [
        (field, _base_type(hints[field.name]))
        for field in dataclasses.fields(cls)
        if "help" in field.metadata  # an option(), not a plain field
    ]


def flag_of(cls, name: str) -> str:
    """The flag of ``cls``'s field ``name`` (``--scan`` for ``scan_layers``)."""
    ((field, hint),) = ((f, h) for f, h in _fields(cls) if f.name == name)
    return _flag_name(field, hint)


def _shown_default(field: dataclasses.Field, hint) -> str:
    """A field's default as the options tables of the docs show it."""
    if hint is bool:  # a switch: given or not
        return "-"
    if field.default is _MISSING or field.default is None or field.default == ():
        return "-"
    return str(field.default)


def markdown_rows(cls, since=None) -> list[str]:
    """The docs' table rows of ``cls``'s flags, ``| `--flag` | default | help |`` each, in
    field order; ``since``: a base class whose fields are left out (a workflow's own).

    The docs' options tables are these rows (``tests/test_options_docs.py`` compares
    them), so a field's flag, default and help are written once, in the field.
    """
    inherited = {f.name for f, _ in _fields(since)} if since is not None else set()
    rows = []
    for field, hint in _fields(cls):
        if field.name in inherited or field.metadata["positional"]:
            continue
        what = field.metadata["help"].replace("|", "\\|")  # a pipe would end the cell
        rows.append(f"| `{_flag_name(field, hint)}` | {_shown_default(field, hint)} | {what} |")
    return rows


def add_options(parser: argparse.ArgumentParser, cls) -> None:
    """Adds one argument per field of dataclass ``cls`` (see the module docstring)."""
    for field, hint in _fields(cls):
        meta = field.metadata
        kwargs: dict[str, Any] = {"help": meta["help"], "dest": field.name}
        if hint is bool:
            kwargs["action"] = "store_false" if field.default is True else "store_true"
        elif typing.get_origin(hint) is tuple:
            kwargs.update(action="append", default=None)
        else:
            if field.default is not _MISSING:
                kwargs["default"] = field.default
                if field.default is not None and meta["show_default"]:
                    kwargs["help"] += " (default %(default)s)"
            if typing.get_origin(hint) is Literal:
                values = tuple(typing.get_args(hint))
                if meta["checked"]:
                    kwargs["metavar"] = "{" + ",".join(values) + "}"
                else:
                    kwargs["choices"] = values
            elif meta["argtype"] is not None:
                kwargs["type"] = meta["argtype"]
            elif hint in (int, float):
                kwargs["type"] = hint
            kwargs["required"] = meta["required"]
        if meta["positional"]:
            del kwargs["dest"], kwargs["required"]
            parser.add_argument(field.name, **kwargs)
        else:
            parser.add_argument(_flag_name(field, hint), **kwargs)


def options_from(cls, args: argparse.Namespace):
    """The ``cls`` of parsed ``args`` (unchecked): each field's value, ``parse``d from its
    string; a repeatable flag given no times keeps the field's default.

    Raises:
      ValueError: a ``parse`` refused its string.
    """
    values = {}
    for field, hint in _fields(cls):
        value = getattr(args, field.name)
        if typing.get_origin(hint) is tuple:
            value = tuple(value) if value else field.default
        elif isinstance(value, str) and field.metadata["parse"] is not None:
            value = parse_flag(_flag_name(field, hint), value, field.metadata["parse"])
        values[field.name] = value
    return cls(**values)


def parse_flag(flag: str, value: str, parse: Callable[[str], Any]) -> Any:
    """``parse(value)``, its ``ValueError`` naming the flag and the value
    (``--mesh '': names no axis; ...``).

    Raises:
      ValueError: ``parse`` refused ``value``.
    """
    try:
        return parse(value)
    except ValueError as error:
        raise ValueError(f"{flag} {value!r}: {error}") from None
