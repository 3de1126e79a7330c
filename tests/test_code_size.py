"""STYLE.md's size targets: the gate reports modules over 400 lines and functions over 60
lines of code (:mod:`harness.gate.sizes`, a printed warning, never the verdict: issue 58), and
no code is packed to look smaller (ruff's skip and off comments are refused here, in the
tests and contracts too)."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

from harness.gate import sizes

pytestmark = pytest.mark.host

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKING = re.compile(r"#\s*fmt:\s*(skip|off)\b")


def formatted_only(root: pathlib.Path) -> list[pathlib.Path]:
    """The trees that have no size target but are formatted all the same."""
    return [p for tree in ("tests", "contracts") for p in sorted((root / tree).rglob("*.py"))]


def test_no_code_is_packed_past_the_formatter():
    packed = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in [*sizes.modules(ROOT), *formatted_only(ROOT)]
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if PACKING.search(line)
    ]
    assert not packed, f"code packed past ruff format (let it format, split instead): {packed}"


def test_the_count_skips_the_docstring_only():
    source = 'def f(x):\n    """Doc\n\n    more."""\n    y = x\n    return y\n'
    assert sizes.code_lines(ast.parse(source).body[0]) == 3
    assert sizes.code_lines(ast.parse("def g():\n    return 1\n").body[0]) == 2


def _tree(tmp_path, files: dict[str, str]) -> pathlib.Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return tmp_path


def test_places_over_their_targets_are_named_largest_first_and_the_rest_not(tmp_path):
    body = "    x = 1\n"
    long_function = "def long():\n" + body * sizes.FUNCTION_LINES  # 61 lines of code
    edge_function = "def edge():\n" + body * (sizes.FUNCTION_LINES - 1)  # 60: within
    root = _tree(
        tmp_path,
        {
            "src/posttrain/big.py": "\n" * (sizes.MODULE_LINES + 1),
            "harness/bigger.py": "\n" * (sizes.MODULE_LINES + 7),
            "benchmarks/edge.py": "\n" * sizes.MODULE_LINES,  # 400: within
            "src/posttrain/f.py": long_function + edge_function,
            "elsewhere/huge.py": "\n" * 1000,  # not one of the trees
        },
    )
    modules, functions = sizes.oversized(root)
    assert modules == [
        sizes.Oversize("harness/bigger.py", sizes.MODULE_LINES + 7),
        sizes.Oversize("src/posttrain/big.py", sizes.MODULE_LINES + 1),
    ]
    assert functions == [sizes.Oversize("src/posttrain/f.py:long", sizes.FUNCTION_LINES + 1)]
    assert sizes.summary_lines(root, listed=1) == [
        "size: 2 modules over 400 lines (split them): harness/bigger.py (407), and 1 more",
        "size: 1 functions over 60 lines of code (split them): src/posttrain/f.py:long (61)",
    ]
    assert sizes.summary_lines(_tree(tmp_path / "clean", {"harness/a.py": "x = 1\n"})) == []


def test_a_docstring_is_the_only_first_statement_left_out():
    """The docstring's own length comes off (a 2-line one from 7 lines: 5), and a first
    statement holding a string that is no docstring (an assignment) stays counted."""
    documented = 'def f():\n    """One\n    two."""\n' + "    a = 1\n" * 3 + "    return a\n"
    assert sizes.code_lines(ast.parse(documented).body[0]) == 5
    assigned = 'def g():\n    x = "not a docstring"\n    return x\n'
    assert sizes.code_lines(ast.parse(assigned).body[0]) == 3


def test_functions_of_one_name_keep_the_longest_and_several_sort_largest_first(tmp_path):
    body = "    x = 1\n"
    over = sizes.FUNCTION_LINES
    # ast.walk reaches the nested, shorter `inner` after the long one: it must not replace it
    nested = (
        "def inner():\n"
        + body * (over + 4)
        + "def outer():\n    def inner():\n        return 1\n    return inner\n"
    )
    root = _tree(
        tmp_path,
        {
            "src/posttrain/n.py": nested,
            "harness/a.py": "def a():\n" + body * (over + 2),
            "harness/b.py": "def b():\n" + body * (over + 9),
        },
    )
    _, functions = sizes.oversized(root)
    assert functions == [
        sizes.Oversize("harness/b.py:b", over + 10),
        sizes.Oversize("src/posttrain/n.py:inner", over + 5),
        sizes.Oversize("harness/a.py:a", over + 3),
    ]


def test_the_summary_lists_five_by_default_joined_by_commas(tmp_path):
    big = "\n" * (sizes.MODULE_LINES + 1)
    root = _tree(tmp_path, {f"harness/m{i}.py": big for i in range(6)})
    shown = ", ".join(f"harness/m{i}.py (401)" for i in range(5))
    assert sizes.summary_lines(root) == [
        f"size: 6 modules over 400 lines (split them): {shown}, and 1 more"
    ]
    assert sizes.summary_lines(root, listed=2) == [
        "size: 6 modules over 400 lines (split them): harness/m0.py (401), harness/m1.py "
        "(401), and 4 more"
    ]
