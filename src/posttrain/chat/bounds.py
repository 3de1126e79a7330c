"""The bounds of a chat template's rendering, and the size estimates that refuse a value
before it is built.

:mod:`posttrain.chat.sandbox` checks every operator, call, filter and piece of output
against these (its docstring lists where). A value whose size can be known first (``*``,
``%`` and ``format`` widths, ``replace``, ``join``, ``indent``, ``wordwrap``, ``tojson``'s
indent, width arguments) is estimated here and refused by :func:`refuse_larger` before it
is built; any other by :func:`checked_size` once it is. The bounds are read at each call,
so a test may lower them.
"""

from __future__ import annotations

import builtins
import re

MAX_TEMPLATE_CHARS = 1 << 20  # 1 MiB: published templates are tens of kB
MAX_OUTPUT_CHARS = 1 << 24  # 16 Mi characters: a conversation of ~4M tokens
MAX_RENDER_SECONDS = 10.0  # one rendering; a published template takes milliseconds
MAX_RANGE = 100_000  # jinja2.sandbox.MAX_RANGE's value
MAX_INT_BITS = 1 << 16  # ~20,000 decimal digits
MAX_FORMAT_CHARS = 1024  # strftime_now("%d %b %Y") is what templates pass
_DIGITS = re.compile(r"\d+")
# the text written in all frames, per rendering: a macro's output is written again by its
# caller, so this bound is a multiple of the output's
EMITTED_PER_OUTPUT = 4


class BoundExceeded(Exception):
    """A rendering, or a template, went past a bound; one line naming it and the value."""


def over(what: str, bound: int, name: str) -> BoundExceeded:
    """``<what, with its value> is over the bound of <bound> (<name>)``."""
    return BoundExceeded(f"{what} is over the bound of {bound} ({name})")


def checked_size(value):
    """``value`` when within :data:`MAX_OUTPUT_CHARS` items (an int within
    :data:`MAX_INT_BITS`)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value.bit_length() > MAX_INT_BITS:
            raise over(f"an integer of {value.bit_length()} bits", MAX_INT_BITS, "MAX_INT_BITS")
    elif isinstance(value, (str, bytes, list, tuple, dict)) and len(value) > MAX_OUTPUT_CHARS:
        raise over(f"a value of length {len(value)}", MAX_OUTPUT_CHARS, "MAX_OUTPUT_CHARS")
    return value


def refuse_larger(size: int, what: str) -> None:
    """Raises :class:`BoundExceeded` when ``what`` would build a value of ``size`` items,
    over :data:`MAX_OUTPUT_CHARS`."""
    if size > MAX_OUTPUT_CHARS:
        shown = size if size < 1 << 64 else f"over 2**{size.bit_length() - 1}"
        raise BoundExceeded(
            f"{what} would build a value of length {shown}, over the bound "
            f"of {MAX_OUTPUT_CHARS} (MAX_OUTPUT_CHARS)"
        )


def check_widths(text: str, what: str) -> None:
    """A format string's widths and precisions (``%999999999d``, ``{:>999999999}``)."""
    for digits in _DIGITS.findall(text):
        if len(digits) > 9 or int(digits) > MAX_OUTPUT_CHARS:
            refuse_larger(int(digits[:12]), f"{what} width")


def check_arguments(args, kwargs, what: str) -> None:
    """Integer arguments (a width, a count) within :data:`MAX_OUTPUT_CHARS`."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool):
            refuse_larger(abs(value), f"{what} argument")


def _length(value) -> int:
    """``len(value)``, 0 for what has none (a generator)."""
    try:
        return len(value)
    except TypeError:
        return 0


def _items(value) -> int:
    """The lists' and dicts' items in ``value``, nested ones included."""
    count, stack = 0, [value]
    while stack:
        top = stack.pop()
        if isinstance(top, (list, tuple, dict)):
            count += len(top)
            stack.extend(top.values() if isinstance(top, dict) else top)
    return count


def _joined(items, separator: str) -> int:
    """The length of ``separator.join(items)``, the strings among ``items`` counted."""
    if not isinstance(items, (list, tuple)):
        return max(0, _length(items) - 1) * len(separator)
    text = sum(len(i) for i in items if isinstance(i, str))
    return text + max(0, len(items) - 1) * len(separator)


def estimate(name: str, receiver, args, kwargs, what: str) -> None:
    """Refuses, before it runs, a string operation whose result would be too large."""
    if name == "replace" and isinstance(receiver, str) and len(args) >= 2:
        old, new = args[0], args[1]
        if isinstance(old, str) and isinstance(new, str) and len(new) > len(old):
            count = receiver.count(old) if old else len(receiver) + 1
            refuse_larger(len(receiver) + count * (len(new) - len(old)), what)
    elif name == "join" and isinstance(receiver, str) and args:  # sep.join(items)
        refuse_larger(_joined(args[0], receiver), what)
    elif name == "expandtabs" and isinstance(receiver, str):  # tabsize: positional or keyword
        tabsize = args[0] if args else kwargs.get("tabsize")
        if isinstance(tabsize, int):
            refuse_larger(receiver.count("\t") * tabsize + len(receiver), what)


def estimate_filter(name: str, args, kwargs) -> None:
    """:func:`estimate` for Jinja's filter ``name``: ``args`` are the value and the
    filter's own arguments."""
    what = f"filter {name}"
    value = args[0] if args else None
    if name == "replace" and len(args) >= 3:
        estimate("replace", value, args[1:], {}, what)
    elif name == "join":
        sep = args[1] if len(args) > 1 else kwargs.get("d", "")
        if isinstance(sep, str):
            refuse_larger(_joined(value, sep), what)
    elif name == "indent" and isinstance(value, str):
        width = args[1] if len(args) > 1 else kwargs.get("width", 4)
        size = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
        refuse_larger(len(value) + (value.count("\n") + 1) * size, what)
    elif name == "format" and isinstance(value, str):
        check_widths(value, what)
    elif name == "tojson":  # each item on its own line, indented at least once
        indent = args[2] if len(args) > 2 else kwargs.get("indent")
        if isinstance(indent, int):
            refuse_larger(_items(value) * indent, what)
    elif name == "wordwrap" and isinstance(value, str):  # a wrapstring after each line
        width = args[1] if len(args) > 1 else kwargs.get("width", 79)
        wrap = args[3] if len(args) > 3 else kwargs.get("wrapstring")
        if isinstance(width, int) and isinstance(wrap, str):
            refuse_larger(len(value) + (len(value) // builtins.max(width, 1) + 1) * len(wrap), what)
