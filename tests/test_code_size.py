"""STYLE.md's size targets: the gate reports modules over 400 lines and functions over 60
lines of code (:mod:`harness.gate.sizes`, a printed warning, never the verdict: issue 58), and
no code is packed to look smaller (``# fmt: skip`` / ``# fmt: off`` are refused here)."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

from harness.gate import sizes

pytestmark = pytest.mark.host

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKING = re.compile(r"#\s*fmt:\s*(skip|off)\b")


def test_no_code_is_packed_past_the_formatter():
    packed = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in sizes.modules(ROOT)
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
