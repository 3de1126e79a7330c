"""The sources mutmut mutates: jitted functions made reachable, and mutmut's names.

Jitted functions: mutmut 3 leaves every decorated function alone, which left the decode
loop (``generate._generate``, ``@nnx.jit``) and every ``@jax.jit`` body unmutated. In
the scratch copy (never in the checkout) :func:`undecorate` moves each decorator that
matches :data:`TRANSFORMS` below its function, ``@nnx.jit(...) def f`` becoming
``def f ...; f = (nnx.jit(...))(f)``: the same function at import, and one mutmut
mutates (its trampoline, chosen when JAX traces, is what the transform wraps).
Production code keeps its decorators: applying them at the call sites instead would
scatter one ``jit`` per caller for the sake of a tool. A jitted body runs its trampoline
only when JAX traces it, not on a cache hit, so mutmut's stats phase (which records the
functions each test reaches) clears JAX's caches before each test
(:func:`harness.tools.mutants.pytest_runtest_setup`, loaded with ``-p harness.tools.mutants``);
without that, a test that reuses a compiled program would never be run against that
function's mutants.
"""

from __future__ import annotations

import ast
import pathlib
import re
from collections.abc import Sequence

TRANSFORMS = re.compile(
    r"(functools\.)?(partial\()?(jax|nnx)\.(jit|remat|checkpoint|vmap|scan|grad|value_and_grad|custom_vjp)\b"
    r"|property"
)
"""Decorators :func:`undecorate` moves below their function (JAX / NNX transforms, bare
or through ``functools.partial``; and ``property``, which mutmut 3 does not mutate under
its decorator: ``tiny = (property)(tiny)`` in the class body is the same attribute); a
function with any other decorator stays as it is."""


def _movable(node: ast.AST) -> bool:
    """A function whose decorators are all :data:`TRANSFORMS` (at least one)."""
    return (
        isinstance(node, ast.FunctionDef)
        and bool(node.decorator_list)
        and all(TRANSFORMS.fullmatch(_call_head(d)) for d in node.decorator_list)
    )


def _call_head(decorator: ast.expr) -> str:
    """``nnx.jit`` of ``nnx.jit(static_argnames=...)``; ``functools.partial(jax.jit`` of
    ``functools.partial(jax.jit, ...)``: what names the transform."""
    if isinstance(decorator, ast.Call):
        head = ast.unparse(decorator.func)
        if head.endswith("partial") and decorator.args:
            return f"{head}({ast.unparse(decorator.args[0])}"
        return head
    return ast.unparse(decorator)


def undecorate(source: str) -> str:
    """``source`` with each function decorated only by :data:`TRANSFORMS` (module level
    or a method) undecorated, its decorators applied by an assignment right after it:
    ``@a @b def f`` becomes ``def f ...`` then ``f = (a)((b)(f))``, the same object."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    found = [n for n in tree.body if _movable(n)]
    for c in tree.body:
        if isinstance(c, ast.ClassDef):
            found += [n for n in c.body if _movable(n)]
    for node in sorted(found, key=lambda n: n.lineno, reverse=True):
        expr = node.name
        for decorator in reversed(node.decorator_list):
            expr = f"({ast.get_source_segment(source, decorator)})({expr})"
        indent = " " * node.col_offset
        end = node.end_lineno  # 1-based, inclusive
        lines.insert(end, f"{indent}{node.name} = {expr}\n")
        first = min(d.lineno for d in node.decorator_list) - 1
        del lines[first : node.lineno - 1]
    return "".join(lines)


def function_names(module: str, root: pathlib.Path) -> set[str]:
    """mutmut's names of the functions of ``module`` it mutates: ``x_name`` for each
    module-level function, ``xǁClassǁmethod`` for each method, undecorated or decorated
    only by :data:`TRANSFORMS` (:func:`undecorate`)."""
    tree = ast.parse((root / module).read_text(encoding="utf-8"))

    def undecorated(nodes):
        return [
            n.name
            for n in nodes
            if isinstance(n, ast.FunctionDef) and (not n.decorator_list or _movable(n))
        ]

    names = {f"x_{name}" for name in undecorated(tree.body)}
    for c in tree.body:
        if isinstance(c, ast.ClassDef):
            names |= {f"xǁ{c.name}ǁ{name}" for name in undecorated(c.body)}
    return names


def mutant_patterns(module: str, functions: Sequence[str]) -> list[str]:
    """The ``mutmut run`` arguments that select ``functions``' mutants of ``module``."""
    dotted = module.removeprefix("src/").removesuffix(".py").replace("/", ".")
    return [f"{dotted}.{name}__mutmut_*" for name in functions]
