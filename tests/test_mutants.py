"""The mutation-testing driver (harness/mutants.py): its config section and its report."""

from __future__ import annotations

import pathlib
import tomllib

import pytest

from harness import mutants


def test_each_target_is_a_source_file_with_a_test_selection():
    root = pathlib.Path(mutants.__file__).resolve().parent.parent
    for module, selection in mutants.TARGETS.items():
        assert (root / module).is_file(), module
        files = [s.split("::")[0] for s in selection if s.startswith(("tests/", "contracts/"))]
        assert files and all((root / f).is_file() for f in files), module


def test_the_section_is_toml_that_mutates_one_module_with_its_tests():
    section = mutants._section("src/posttrain/sft/loss.py", ["tests/test_sft_loss.py"], 2)
    config = tomllib.loads(section)["tool"]["mutmut"]
    assert config["only_mutate"] == ["src/posttrain/sft/loss.py"]
    assert config["pytest_add_cli_args_test_selection"] == ["tests/test_sft_loss.py"]
    assert config["max_children"] == 2 and config["process_isolation"] == "forkserver"
    assert config["pytest_add_cli_args"][-2:] == ["-m", "not slow"]


def test_the_report_gives_the_score_and_the_survivors():
    rows = [
        {
            "module": "a.py",
            "killed": 9,
            "survived": 1,
            "timeout": 0,
            "no_tests": 2,
            "score": 0.9,
            "survivors": ["a.x_f__mutmut_3"],
        },
        {"module": "b.py", "error": "exit 1"},
    ]
    text = mutants.markdown(rows)
    assert "| `a.py` | 9 | 1 | 0 | 2 | 90.0% |" in text
    assert "| `b.py` | error: exit 1 |" in text
    assert "Surviving in `a.py`: a.x_f__mutmut_3" in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["src/nope.py"], "unknown module 'src/nope.py'"),
        (["--max-children", "0"], "--max-children 0: expected >= 1"),
    ],
)
def test_bad_arguments_exit_2(capsys, argv, message):
    with pytest.raises(SystemExit) as exit:
        mutants.main(argv)
    assert exit.value.code == 2 and message in capsys.readouterr().err


def test_each_function_pattern_names_a_function_of_its_module():
    """A pattern matching nothing would make mutmut stop with "nothing matches"; one for a
    renamed function would silently shrink the run, so each must name a real function,
    and an undecorated one (mutmut 3 does not mutate decorated functions)."""
    import ast

    root = pathlib.Path(mutants.__file__).resolve().parent.parent
    for module, patterns in mutants.FUNCTIONS.items():
        assert module in mutants.TARGETS, module
        tree = ast.parse((root / module).read_text())
        names = {
            f"x_{n.name}"
            for n in tree.body
            if isinstance(n, ast.FunctionDef) and not n.decorator_list
        }
        names |= {
            f"xǁ{c.name}ǁ{m.name}"
            for c in tree.body
            if isinstance(c, ast.ClassDef)
            for m in c.body
            if isinstance(m, ast.FunctionDef) and not m.decorator_list
        }
        dotted = module.removeprefix("src/").removesuffix(".py").replace("/", ".")
        for pattern in patterns:
            prefix, _, rest = pattern.partition(f"{dotted}.")
            assert prefix == "" and rest.endswith("__mutmut_*"), pattern
            assert rest.removesuffix("__mutmut_*") in names, pattern
