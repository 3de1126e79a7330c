"""Chat templates rendered within bounds: time, output size, the size of any value built
on the way, and the template's own size.

A template is code from a checkpoint. Jinja's ``ImmutableSandboxedEnvironment`` keeps it
from Python's internals but not from work: ``range`` of 100,000 nested twice, ``'a' *
400000000``, ``lipsum(20000000)`` or a macro calling itself run until memory or patience
ends. :class:`BoundedEnvironment` adds, each a :class:`bounds.BoundExceeded` naming the
bound and the value (the bounds and the size estimates: :mod:`posttrain.chat.bounds`):

- time: :data:`bounds.MAX_RENDER_SECONDS` per rendering, checked at every loop item
  (each ``for`` iterates through :func:`bounded_iter`, put there when the template is
  compiled), call, filter, intercepted operator and output chunk;
- size: the output, streamed (``Template.generate``), stops at
  :data:`bounds.MAX_OUTPUT_CHARS`; the text written in all frames (macros, ``set``
  blocks, the top) at :data:`bounds.EMITTED_PER_OUTPUT` times that, counted as each
  piece is written; a value an operator, call or filter builds is refused beyond it,
  before it is built where its size can be known first (``*``, ``**``, ``%`` and
  ``format`` widths, ``replace``, ``join``, ``indent``, ``wordwrap``, ``tojson``'s
  indent, width arguments, ``lipsum``); integers beyond :data:`bounds.MAX_INT_BITS`;
- ``range`` beyond :data:`bounds.MAX_RANGE` items (Jinja's own ``MAX_RANGE``, named
  here), ``strftime_now`` formats beyond :data:`bounds.MAX_FORMAT_CHARS`, recursion
  beyond Python's limit;
- the template's source beyond :data:`bounds.MAX_TEMPLATE_CHARS` (a file beyond it is
  not read).

Reference: jinja2 3.1 ``sandbox.py`` (``intercepted_binops``, ``call_binop``, ``call``,
``safe_range``) and ``Environment.code_generator_class``.
"""

from __future__ import annotations

import builtins
import contextvars
import datetime
import functools
import os
import sys
import time

import jinja2
import jinja2.compiler
import jinja2.nodes
import jinja2.runtime
import jinja2.sandbox
import jinja2.utils
import jinja2.visitor

from posttrain.chat import bounds

_PASSED = (jinja2.runtime.Context, jinja2.nodes.EvalContext, jinja2.Environment)
# filters whose integer arguments size their result (a width, a count of lists)
_SIZING_FILTERS = frozenset({"center", "batch", "slice", "format", "indent"})
# a value whose methods' integer arguments may size their result (ljust, zfill, ...)
_SIZED_RECEIVERS = (str, bytes, list, tuple)
_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "posttrain_chat_deadline", default=None
)
_emitted: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar(
    "posttrain_chat_emitted", default=None
)


def tick() -> None:
    """Raises :class:`bounds.BoundExceeded` once the current rendering is past its time."""
    deadline = _deadline.get()
    if deadline is not None and time.monotonic() > deadline:
        raise bounds.BoundExceeded(
            f"rendering ran past the time bound of {bounds.MAX_RENDER_SECONDS:g} s "
            "(MAX_RENDER_SECONDS)"
        )


def _bounded_filter(name: str, function):
    @functools.wraps(function)  # keeps jinja_pass_arg: the same arguments are passed
    def bounded(*args, **kwargs):
        tick()
        # the value and the filter's own arguments, without what jinja_pass_arg adds
        plain = [a for a in args if not isinstance(a, _PASSED)]
        if name in _SIZING_FILTERS:
            bounds.check_arguments(plain[1:], kwargs, f"filter {name}")
        bounds.estimate_filter(name, plain, kwargs)
        return bounds.checked_size(function(*args, **kwargs))

    return bounded


def bounded_range(*args: int) -> range:
    """``range`` of at most :data:`bounds.MAX_RANGE` items."""
    numbers = range(*args)  # its own TypeError for a float
    start, stop, step = numbers.start, numbers.stop, numbers.step
    count = max(0, (stop - start + step - (1 if step > 0 else -1)) // step)
    if count > bounds.MAX_RANGE:
        raise bounds.over(f"range() of {count} items", bounds.MAX_RANGE, "MAX_RANGE")
    return numbers


def bounded_lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002
    """Jinja's ``lipsum``, refused when its words could pass :data:`bounds.MAX_OUTPUT_CHARS`.
    Its counts must be integers: Python 3.11's ``randrange`` takes ``max=100.0`` (with a
    DeprecationWarning), which would otherwise pass unestimated."""
    for name, value in (("n", n), ("min", min), ("max", max)):
        if not isinstance(value, int):
            raise TypeError(f"lipsum()'s {name}={value!r}; expected an integer")
    # <= 15 characters and a space a word; a paragraph of no words is still '.' and a break
    bounds.refuse_larger(n * builtins.max(min, max, 1) * 16, "lipsum()")
    return bounds.checked_size(jinja2.utils.generate_lorem_ipsum(n, html, min, max))


def strftime_now(format: str) -> str:  # noqa: A002 - transformers' name
    """transformers' ``strftime_now``, its format at most :data:`bounds.MAX_FORMAT_CHARS`."""
    if isinstance(format, str) and len(format) > bounds.MAX_FORMAT_CHARS:
        raise bounds.over(
            f"strftime_now's format of length {len(format)}",
            bounds.MAX_FORMAT_CHARS,
            "MAX_FORMAT_CHARS",
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
    return bounds.checked_size(value)


@jinja2.pass_context
def bounded_output(context, value) -> str:
    """``value`` as text, counted against :data:`bounds.EMITTED_PER_OUTPUT` x
    :data:`bounds.MAX_OUTPUT_CHARS`: what macros and blocks write into their buffers is refused
    as it is written, not once joined."""
    text = bounds.checked_size(str(value))
    emitted = _emitted.get()
    if emitted is not None:
        emitted[0] += len(text)
        if emitted[0] > bounds.EMITTED_PER_OUTPUT * bounds.MAX_OUTPUT_CHARS:
            raise bounds.over(
                f"the text written, in all macros and blocks ({emitted[0]} characters so far),",
                bounds.EMITTED_PER_OUTPUT * bounds.MAX_OUTPUT_CHARS,
                f"{bounds.EMITTED_PER_OUTPUT} x MAX_OUTPUT_CHARS",
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
                bounds.refuse_larger(len(sequence) * times, "'*'")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int):
            if abs(left) > 1 and right > 0:
                bits = left.bit_length() * right
                if bits > bounds.MAX_INT_BITS:
                    raise bounds.over(
                        f"'**' would build an integer of {bits} bits",
                        bounds.MAX_INT_BITS,
                        "MAX_INT_BITS",
                    )
        elif operator == "%" and isinstance(left, str):
            bounds.check_widths(left, "'%'")
            bounds.check_arguments(right if isinstance(right, tuple) else (right,), {}, "'%'")
        return bounds.checked_size(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja2's signature
        tick()
        name = getattr(__obj, "__name__", "")
        receiver = getattr(__obj, "__self__", None)
        if isinstance(receiver, _SIZED_RECEIVERS):  # range, lipsum ... check their own
            bounds.check_arguments(args, kwargs, f"{name}()")
            bounds.estimate(name, receiver, args, kwargs, f"{name}()")
        return bounds.checked_size(super().call(__context, __obj, *args, **kwargs))

    def wrap_str_format(self, value):
        """Jinja's sandboxed ``str.format`` / ``format_map``, refused at access when the
        string's widths would pass :data:`bounds.MAX_OUTPUT_CHARS`."""
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        what = f"{value.__name__}()"
        bounds.check_widths(value.__self__, what)

        def checked(*args, **kwargs):  # widths given as arguments: '{:>{w}}'
            mapped = args[0].values() if args and isinstance(args[0], dict) else ()
            bounds.check_arguments((*args, *mapped), kwargs, what)
            return bounds.checked_size(wrapped(*args, **kwargs))

        return checked


def render(template: jinja2.Template, variables: dict) -> str:
    """``template`` rendered with ``variables`` within the bounds (module docstring).

    Raises:
      bounds.BoundExceeded: a bound was hit (one line naming it and the value).
    """
    token = _deadline.set(time.monotonic() + bounds.MAX_RENDER_SECONDS)
    counter = _emitted.set([0])
    pieces, size = [], 0
    try:
        for piece in template.generate(**variables):
            size += len(piece)
            if size > bounds.MAX_OUTPUT_CHARS:
                raise bounds.over(
                    f"the output ({size} characters so far)",
                    bounds.MAX_OUTPUT_CHARS,
                    "MAX_OUTPUT_CHARS",
                )
            tick()
            pieces.append(piece)
    except RecursionError:
        raise bounds.BoundExceeded(
            f"recursion deeper than Python's limit of {sys.getrecursionlimit()} frames (a "
            "macro or recursive loop that does not end)"
        ) from None
    except MemoryError:
        raise bounds.BoundExceeded("out of memory while rendering") from None
    finally:
        _deadline.reset(token)
        _emitted.reset(counter)
    return "".join(pieces)


def check_source(source: str) -> None:
    """Raises :class:`bounds.BoundExceeded` for a source beyond
    :data:`bounds.MAX_TEMPLATE_CHARS`."""
    if len(source) > bounds.MAX_TEMPLATE_CHARS:
        raise bounds.over(
            f"a template of {len(source)} characters",
            bounds.MAX_TEMPLATE_CHARS,
            "MAX_TEMPLATE_CHARS",
        )


def read_source(path: str | os.PathLike) -> str:
    """A template file's text, not read when larger than :data:`bounds.MAX_TEMPLATE_CHARS`
    bytes (UTF-8 takes at least a byte a character).

    Raises:
      bounds.BoundExceeded: the file is too large.
      OSError, UnicodeDecodeError: it cannot be read.
    """
    size = os.stat(path).st_size
    if size > bounds.MAX_TEMPLATE_CHARS:
        raise bounds.over(
            f"a template file of {size} bytes",
            bounds.MAX_TEMPLATE_CHARS,
            "MAX_TEMPLATE_CHARS",
        )
    with open(path, encoding="utf-8") as f:
        text = f.read(bounds.MAX_TEMPLATE_CHARS + 1)  # a file that grew since: still bounded
    check_source(text)
    return text
