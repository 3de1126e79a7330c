"""STYLE.md's size targets, reported by the gate (a warning it prints, never a failure).

A module over :data:`MODULE_LINES` lines or a function over :data:`FUNCTION_LINES` lines of
code is a place to split, named in the gate's summary; code is not to be squeezed under a
cap (issue 58). Packing past the formatter is refused by ``tests/test_code_size.py``.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

TREES = ("src/posttrain", "harness", "benchmarks")
MODULE_LINES = 400
FUNCTION_LINES = 60


@dataclass(frozen=True)
class Oversize:
    """One place over its target: ``name`` is ``path`` or ``path:function``."""

    name: str
    lines: int


def code_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """A function's lines, decorators and signature included, its docstring not."""
    lines = node.end_lineno - node.lineno + 1
    first = node.body[0]
    value = first.value if isinstance(first, ast.Expr) else None
    if isinstance(value, ast.Constant) and isinstance(value.value, str):
        lines -= first.end_lineno - first.lineno + 1
    return lines


def modules(root: Path) -> list[Path]:
    """The Python files of :data:`TREES` under ``root``, sorted."""
    return [p for tree in TREES for p in sorted((root / tree).rglob("*.py"))]


def oversized(root: Path) -> tuple[list[Oversize], list[Oversize]]:
    """``(modules, functions)`` over their targets, largest first.

    A module's lines are its newline count; a function's are :func:`code_lines` (nested
    functions of one name in one file: the longest).
    """
    over_modules, found = [], {}
    for path in modules(root):
        text = path.read_text(encoding="utf-8")
        relative = str(path.relative_to(root))
        if (count := text.count("\n")) > MODULE_LINES:
            over_modules.append(Oversize(relative, count))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                key = f"{relative}:{node.name}"
                found[key] = max(found.get(key, 0), code_lines(node))
    over_functions = [Oversize(k, n) for k, n in found.items() if n > FUNCTION_LINES]
    by_size = lambda o: (-o.lines, o.name)  # noqa: E731
    return sorted(over_modules, key=by_size), sorted(over_functions, key=by_size)


def summary_lines(root: Path, listed: int = 5) -> list[str]:
    """The gate summary's size lines: empty when every place is within its target."""
    over_modules, over_functions = oversized(root)
    lines = []
    for what, target, over in (
        ("modules", f"{MODULE_LINES} lines", over_modules),
        ("functions", f"{FUNCTION_LINES} lines of code", over_functions),
    ):
        if over:
            shown = ", ".join(f"{o.name} ({o.lines})" for o in over[:listed])
            more = f", and {len(over) - listed} more" if len(over) > listed else ""
            lines.append(f"size: {len(over)} {what} over {target} (split them): {shown}{more}")
    return lines
