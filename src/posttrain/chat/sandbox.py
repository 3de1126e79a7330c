"""Chat templates rendered within bounds: time, output size, the size of any value built
on the way, and the template's own size.

A template is code from a checkpoint. Jinja's ``ImmutableSandboxedEnvironment`` keeps it
from Python's internals but not from work: ``range`` of 100,000 nested twice, ``'a' *
400000000``, ``lipsum(20000000)`` or a macro calling itself run until memory or patience
ends. :class:`BoundedEnvironment` adds, each a :class:`BoundExceeded` naming the bound and
the value:

- time: :data:`MAX_RENDER_SECONDS` per rendering, checked at every loop item (each
  ``for`` iterates through :func:`bounded_iter`, put there when the
  template is compiled), call, filter, intercepted operator and output chunk;
- size: the output, streamed (``Template.generate``), stops at :data:`MAX_OUTPUT_CHARS`;
  the text written in all frames (macros, ``set`` blocks, the top) at
  :data:`EMITTED_PER_OUTPUT` times that, counted as each piece is written;
  a value an operator, call or filter builds is refused beyond it, before it is built
  where its size can be known first (``*``, ``**``, ``%`` and ``format`` widths,
  ``replace``, ``join``, ``indent``, ``wordwrap``, ``tojson``'s indent, width arguments,
  ``lipsum``); integers beyond
  :data:`MAX_INT_BITS`;
- ``range`` beyond :data:`MAX_RANGE` items (Jinja's own ``MAX_RANGE``, named here),
  ``strftime_now`` formats beyond :data:`MAX_FORMAT_CHARS`, recursion beyond Python's
  limit;
- the template's source beyond :data:`MAX_TEMPLATE_CHARS` (a file beyond it is not read).

Reference: jinja2 3.1 ``sandbox.py`` (``intercepted_binops``, ``call_binop``, ``call``,
``safe_range``) and ``Environment.code_generator_class``.
"""

from __future__ import annotations

import builtins
import contextvars
import datetime
import functools
import os
import re
import sys
import time

import jinja2
import jinja2.compiler
import jinja2.nodes
import jinja2.runtime
import jinja2.sandbox
import jinja2.utils
import jinja2.visitor

MAX_TEMPLATE_CHARS = 1 << 20  # 1 MiB: published templates are tens of kB
MAX_OUTPUT_CHARS = 1 << 24  # 16 Mi characters: a conversation of ~4M tokens
MAX_RENDER_SECONDS = 10.0  # one rendering; a published template takes milliseconds
MAX_RANGE = 100_000  # jinja2.sandbox.MAX_RANGE's value
MAX_INT_BITS = 1 << 16  # ~20,000 decimal digits
MAX_FORMAT_CHARS = 1024  # strftime_now("%d %b %Y") is what templates pass
_DIGITS = re.compile(r"\d+")
_PASSED = (jinja2.runtime.Context, jinja2.nodes.EvalContext, jinja2.Environment)
# filters whose integer arguments size their result (a width, a count of lists)
_SIZING_FILTERS = frozenset({"center", "batch", "slice", "format", "indent"})
# a value whose methods' integer arguments may size their result (ljust, zfill, ...)
_SIZED_RECEIVERS = (str, bytes, list, tuple)
# the text written in all frames, per rendering: a macro's output is written again by its
# caller, so this bound is a multiple of the output's
EMITTED_PER_OUTPUT = 4
_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "posttrain_chat_deadline", default=None
)
_emitted: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar(
    "posttrain_chat_emitted", default=None
)


class BoundExceeded(Exception):
    """A rendering, or a template, went past a bound; one line naming it and the value."""


def _over(what: str, bound: int, name: str) -> BoundExceeded:
    """``<what, with its value> is over the bound of <bound> (<name>)``."""
    return BoundExceeded(f"{what} is over the bound of {bound} ({name})")


def tick() -> None:
    """Raises :class:`BoundExceeded` once the current rendering is past its time."""
    deadline = _deadline.get()
    if deadline is not None and time.monotonic() > deadline:
        raise BoundExceeded(
            f"rendering ran past the time bound of {MAX_RENDER_SECONDS:g} s (MAX_RENDER_SECONDS)"
        )


def checked_size(value):
    """``value`` when within :data:`MAX_OUTPUT_CHARS` items (an int within
    :data:`MAX_INT_BITS`)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value.bit_length() > MAX_INT_BITS:
            raise _over(f"an integer of {value.bit_length()} bits", MAX_INT_BITS, "MAX_INT_BITS")
    elif isinstance(value, (str, bytes, list, tuple, dict)) and len(value) > MAX_OUTPUT_CHARS:
        raise _over(f"a value of length {len(value)}", MAX_OUTPUT_CHARS, "MAX_OUTPUT_CHARS")
    return value


def _refuse_larger(size: int, what: str) -> None:
    if size > MAX_OUTPUT_CHARS:
        shown = size if size < 1 << 64 else f"over 2**{size.bit_length() - 1}"
        raise BoundExceeded(
            f"{what} would build a value of length {shown}, over the bound "
            f"of {MAX_OUTPUT_CHARS} (MAX_OUTPUT_CHARS)"
        )


def _check_widths(text: str, what: str) -> None:
    """A format string's widths and precisions (``%999999999d``, ``{:>999999999}``)."""
    for digits in _DIGITS.findall(text):
        if len(digits) > 9 or int(digits) > MAX_OUTPUT_CHARS:
            _refuse_larger(int(digits[:12]), f"{what} width")


def _check_arguments(args, kwargs, what: str) -> None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool):
            _refuse_larger(abs(value), f"{what} argument")


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


def _estimate(name: str, receiver, args, kwargs, what: str) -> None:
    """Refuses, before it runs, a string operation whose result would be too large."""
    if name == "replace" and isinstance(receiver, str) and len(args) >= 2:
        old, new = args[0], args[1]
        if isinstance(old, str) and isinstance(new, str) and len(new) > len(old):
            count = receiver.count(old) if old else len(receiver) + 1
            _refuse_larger(len(receiver) + count * (len(new) - len(old)), what)
    elif name == "join" and isinstance(receiver, str) and args:  # sep.join(items)
        _refuse_larger(_joined(args[0], receiver), what)
    elif name == "expandtabs" and isinstance(receiver, str) and args and isinstance(args[0], int):
        _refuse_larger(receiver.count("\t") * args[0] + len(receiver), what)


def _estimate_filter(name: str, args, kwargs) -> None:
    what = f"filter {name}"
    value = args[0] if args else None
    if name == "replace" and len(args) >= 3:
        _estimate("replace", value, args[1:], {}, what)
    elif name == "join":
        sep = args[1] if len(args) > 1 else kwargs.get("d", "")
        if isinstance(sep, str):
            _refuse_larger(_joined(value, sep), what)
    elif name == "indent" and isinstance(value, str):
        width = args[1] if len(args) > 1 else kwargs.get("width", 4)
        size = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
        _refuse_larger(len(value) + (value.count("\n") + 1) * size, what)
    elif name == "format" and isinstance(value, str):
        _check_widths(value, what)
    elif name == "tojson":  # each item on its own line, indented at least once
        indent = args[2] if len(args) > 2 else kwargs.get("indent")
        if isinstance(indent, int):
            _refuse_larger(_items(value) * indent, what)
    elif name == "wordwrap" and isinstance(value, str):  # a wrapstring after each line
        width = args[1] if len(args) > 1 else kwargs.get("width", 79)
        wrap = args[3] if len(args) > 3 else kwargs.get("wrapstring")
        if isinstance(width, int) and isinstance(wrap, str):
            _refuse_larger(
                len(value) + (len(value) // builtins.max(width, 1) + 1) * len(wrap), what
            )


def _bounded_filter(name: str, function):
    @functools.wraps(function)  # keeps jinja_pass_arg: the same arguments are passed
    def bounded(*args, **kwargs):
        tick()
        # the value and the filter's own arguments, without what jinja_pass_arg adds
        plain = [a for a in args if not isinstance(a, _PASSED)]
        if name in _SIZING_FILTERS:
            _check_arguments(plain[1:], kwargs, f"filter {name}")
        _estimate_filter(name, plain, kwargs)
        return checked_size(function(*args, **kwargs))

    return bounded


def bounded_range(*args: int) -> range:
    """``range`` of at most :data:`MAX_RANGE` items."""
    numbers = range(*args)  # its own TypeError for a float
    start, stop, step = numbers.start, numbers.stop, numbers.step
    count = max(0, (stop - start + step - (1 if step > 0 else -1)) // step)
    if count > MAX_RANGE:
        raise _over(f"range() of {count} items", MAX_RANGE, "MAX_RANGE")
    return numbers


def bounded_lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002
    """Jinja's ``lipsum``, refused when its words could pass :data:`MAX_OUTPUT_CHARS`."""
    if isinstance(n, int) and isinstance(max, int):
        _refuse_larger(n * builtins.max(min, max, 1) * 16, "lipsum()")  # <= 15 chars a word
    return checked_size(jinja2.utils.generate_lorem_ipsum(n, html, min, max))


def strftime_now(format: str) -> str:  # noqa: A002 - transformers' name
    """transformers' ``strftime_now``, its format at most :data:`MAX_FORMAT_CHARS`."""
    if isinstance(format, str) and len(format) > MAX_FORMAT_CHARS:
        raise _over(
            f"strftime_now's format of length {len(format)}", MAX_FORMAT_CHARS, "MAX_FORMAT_CHARS"
        )
    return datetime.datetime.now().strftime(format)


@jinja2.pass_context  # never folded at compile time: counted at every rendering
def bounded_iter(context, iterable):
    """``iterable``'s items, the time checked before each."""
    for item in iterable:
        tick()
        yield item


@jinja2.pass_context
def bounded_value(context, value):
    return checked_size(value)


@jinja2.pass_context
def bounded_output(context, value) -> str:
    """``value`` as text, counted against :data:`EMITTED_PER_OUTPUT` x
    :data:`MAX_OUTPUT_CHARS`: what macros and blocks write into their buffers is refused
    as it is written, not once joined."""
    text = checked_size(str(value))
    emitted = _emitted.get()
    if emitted is not None:
        emitted[0] += len(text)
        if emitted[0] > EMITTED_PER_OUTPUT * MAX_OUTPUT_CHARS:
            raise _over(
                f"the text written, in all macros and blocks ({emitted[0]} characters so far),",
                EMITTED_PER_OUTPUT * MAX_OUTPUT_CHARS,
                f"{EMITTED_PER_OUTPUT} x MAX_OUTPUT_CHARS",
            )
    return text


# the guards, as filters: a filter is called directly (a call node would pass through
# the sandbox's call, several times slower on every piece of output)
_GUARDS = {
    "_posttrain_iter": bounded_iter,
    "_posttrain_value": bounded_value,
    "_posttrain_output": bounded_output,
}


class _Guard(jinja2.visitor.NodeTransformer):
    """Each ``for`` iterates through :func:`bounded_iter`; each ``~`` chain's result
    passes :func:`bounded_value`; each piece of output, in any frame (a macro's, a
    ``set`` block's), :func:`bounded_output`."""

    def visit_For(self, node: jinja2.nodes.For) -> jinja2.nodes.Node:
        self.generic_visit(node)
        node.iter = _guarded("_posttrain_iter", node.iter)
        return node

    def visit_Concat(self, node: jinja2.nodes.Concat) -> jinja2.nodes.Node:
        self.generic_visit(node)
        return _guarded("_posttrain_value", node)

    def visit_Output(self, node: jinja2.nodes.Output) -> jinja2.nodes.Node:
        self.generic_visit(node)
        node.nodes = [_guarded("_posttrain_output", child) for child in node.nodes]
        return node


def _guarded(guard: str, node: jinja2.nodes.Expr) -> jinja2.nodes.Filter:
    return jinja2.nodes.Filter(node, guard, [], [], None, None, lineno=node.lineno)


class _GuardedCode(jinja2.compiler.CodeGenerator):
    def visit_Template(self, node, frame=None) -> None:
        _Guard().visit(node)
        super().visit_Template(node, frame)


class BoundedEnvironment(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The sandbox with the bounds of the module docstring; render with :func:`render`."""

    code_generator_class = _GuardedCode
    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.globals["range"] = bounded_range
        self.globals["lipsum"] = bounded_lipsum
        self.globals["strftime_now"] = strftime_now

    def bound_filters(self) -> None:
        """Wraps every filter registered so far (call once they all are)."""
        for name, function in list(self.filters.items()):
            self.filters[name] = _bounded_filter(name, function)
        self.filters.update(_GUARDS)

    def call_binop(self, context, operator: str, left, right):
        tick()
        if operator == "*":
            sequence, times = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(sequence, (str, list, tuple)) and isinstance(times, int):
                _refuse_larger(len(sequence) * times, "'*'")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int):
            if abs(left) > 1 and right > 0:
                bits = left.bit_length() * right
                if bits > MAX_INT_BITS:
                    raise _over(
                        f"'**' would build an integer of {bits} bits", MAX_INT_BITS, "MAX_INT_BITS"
                    )
        elif operator == "%" and isinstance(left, str):
            _check_widths(left, "'%'")
            _check_arguments(right if isinstance(right, tuple) else (right,), {}, "'%'")
        return checked_size(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja2's signature
        tick()
        name = getattr(__obj, "__name__", "")
        receiver = getattr(__obj, "__self__", None)
        if isinstance(receiver, _SIZED_RECEIVERS):  # range, lipsum ... check their own
            _check_arguments(args, kwargs, f"{name}()")
            _estimate(name, receiver, args, kwargs, f"{name}()")
        return checked_size(super().call(__context, __obj, *args, **kwargs))

    def wrap_str_format(self, value):
        """Jinja's sandboxed ``str.format`` / ``format_map``, refused at access when the
        string's widths would pass :data:`MAX_OUTPUT_CHARS`."""
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        what = f"{value.__name__}()"
        _check_widths(value.__self__, what)

        def checked(*args, **kwargs):  # widths given as arguments: '{:>{w}}'
            mapped = args[0].values() if args and isinstance(args[0], dict) else ()
            _check_arguments((*args, *mapped), kwargs, what)
            return checked_size(wrapped(*args, **kwargs))

        return checked


def render(template: jinja2.Template, variables: dict) -> str:
    """``template`` rendered with ``variables`` within the bounds (module docstring).

    Raises:
      BoundExceeded: a bound was hit (one line naming it and the value).
    """
    token = _deadline.set(time.monotonic() + MAX_RENDER_SECONDS)
    counter = _emitted.set([0])
    pieces, size = [], 0
    try:
        for piece in template.generate(**variables):
            size += len(piece)
            if size > MAX_OUTPUT_CHARS:
                raise _over(
                    f"the output ({size} characters so far)", MAX_OUTPUT_CHARS, "MAX_OUTPUT_CHARS"
                )
            tick()
            pieces.append(piece)
    except RecursionError:
        raise BoundExceeded(
            f"recursion deeper than Python's limit of {sys.getrecursionlimit()} frames (a "
            "macro or recursive loop that does not end)"
        ) from None
    except MemoryError:
        raise BoundExceeded("out of memory while rendering") from None
    finally:
        _deadline.reset(token)
        _emitted.reset(counter)
    return "".join(pieces)


def check_source(source: str) -> None:
    """Raises :class:`BoundExceeded` for a source beyond :data:`MAX_TEMPLATE_CHARS`."""
    if len(source) > MAX_TEMPLATE_CHARS:
        raise _over(
            f"a template of {len(source)} characters", MAX_TEMPLATE_CHARS, "MAX_TEMPLATE_CHARS"
        )


def read_source(path: str | os.PathLike) -> str:
    """A template file's text, not read when larger than :data:`MAX_TEMPLATE_CHARS`
    bytes (UTF-8 takes at least a byte a character).

    Raises:
      BoundExceeded: the file is too large.
      OSError, UnicodeDecodeError: it cannot be read.
    """
    size = os.stat(path).st_size
    if size > MAX_TEMPLATE_CHARS:
        raise _over(f"a template file of {size} bytes", MAX_TEMPLATE_CHARS, "MAX_TEMPLATE_CHARS")
    with open(path, encoding="utf-8") as f:
        text = f.read(MAX_TEMPLATE_CHARS + 1)  # a file that grew since: still bounded
    check_source(text)
    return text
