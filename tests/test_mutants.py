"""The mutation-testing driver (harness/tools/mutants.py): its config section and its report."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import tomllib

import pytest

from harness.tools import mutants

pytestmark = pytest.mark.host


def test_each_target_is_a_source_file_with_a_test_selection():
    root = pathlib.Path(mutants.__file__).resolve().parents[2]
    for module, selection in mutants.TARGETS.items():
        assert (root / module).is_file(), module
        files = [s.split("::")[0] for s in selection if s.startswith(("tests/", "contracts/"))]
        assert files and all((root / f).is_file() for f in files), module


def test_the_section_is_toml_that_mutates_one_module_with_its_tests():
    section = mutants._section("src/posttrain/training/loss.py", ["tests/test_sft_loss.py"], 2)
    config = tomllib.loads(section)["tool"]["mutmut"]
    assert config["only_mutate"] == ["src/posttrain/training/loss.py"]
    assert config["pytest_add_cli_args_test_selection"] == ["tests/test_sft_loss.py"]
    assert config["max_children"] == 2 and config["process_isolation"] == "forkserver"
    assert config["pytest_add_cli_args"][-2:] == ["-m", "not slow"]


def test_a_mutant_of_a_quick_selection_has_a_cold_workers_cpu_time():
    """mutmut kills a mutant's worker after ``(estimate + timeout_constant) x
    timeout_multiplier x 2`` CPU seconds. A worker comes from a fork server that has
    imported nothing, so it imports JAX and compiles before its first test: with mutmut's
    default constant (1 s) a selection estimated at 0.1 s had 33 CPU seconds and its
    mutants timed out under load. The section's constant gives it at least 150."""
    config = tomllib.loads(mutants._section("a/b.py", ["tests/x.py"], 1))["tool"]["mutmut"]
    multiplier = config.get("timeout_multiplier", 15.0)  # mutmut 3.8's default
    assert (0.1 + config["timeout_constant"]) * multiplier * 2 >= 150


def test_mutmuts_copy_holds_what_building_this_checkout_reads():
    """The bisect and matrix tests build an environment of this checkout inside mutmut's
    copy: pyproject's readme must be copied too (without it every harness/bisect/bisect.py run
    failed in its stats phase, 'Readme file does not exist')."""
    root = pathlib.Path(mutants.__file__).resolve().parents[2]
    readme = tomllib.loads((root / "pyproject.toml").read_text())["project"]["readme"]
    for module in ("harness/bisect/git_history.py", "src/posttrain/training/loss.py"):
        config = tomllib.loads(mutants._section(module, ["tests/x.py"], 1))["tool"]["mutmut"]
        assert readme in config["also_copy"], module
        assert module.split("/")[0] not in config["also_copy"]  # mutmut's own source path


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


def test_a_missing_mutmut_stops_before_copying_anything(monkeypatch, capsys, tmp_path):
    """Without mutmut the driver prints one line saying how to get it and exits 2, before
    copying the project (it had copied it 86 times, printing 258 lines of errors)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "mutmut" else real(name, *a)
    )
    monkeypatch.setattr(mutants, "run_module", lambda *a, **k: pytest.fail("copied the project"))
    assert mutants.main(["--report-dir", str(tmp_path / "r")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1, err
    assert "mutmut is not installed (the mutants dependency group)" in err
    assert "uvx --with tox-uv tox -e mutants" in err and "--group mutants" in err
    assert not (tmp_path / "r").exists()
    assert mutants.PREREQUISITES[0][0] == "mutmut"


def test_each_function_names_a_function_mutmut_mutates():
    """A pattern matching nothing would make mutmut stop with "nothing matches"; one for a
    renamed function would silently shrink the run, so each must name a real function,
    and an undecorated one (mutmut 3 does not mutate decorated functions)."""
    root = pathlib.Path(mutants.__file__).resolve().parents[2]
    for module, names in mutants.FUNCTIONS.items():
        assert module in mutants.TARGETS, module
        assert set(names) <= mutants.function_names(module, root), module
    trainer = mutants.function_names("src/posttrain/training/trainer.py", root)
    step = mutants.function_names("src/posttrain/training/step.py", root)
    assert "xǁSFTStepǁ_step_body" in step and "x_default_moe_aux_loss_weight" in trainer
    assert "xǁSFTStepǁcreate_train_step_fn" not in step  # @override: not mutated
    assert mutants.mutant_patterns("src/posttrain/training/loss.py", ["x_token_nll"]) == [
        "posttrain.training.loss.x_token_nll__mutmut_*"
    ]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--functions", "x_token_nll"], "--functions needs exactly one MODULE, got 0"),
        (
            ["src/posttrain/training/loss.py", "src/posttrain/lora/merge.py", "--functions", "x_a"],
            "--functions needs exactly one MODULE, got 2",
        ),
        (
            ["src/posttrain/training/loss.py", "--functions", "x_token_nll,x_tokn_nll"],
            "--functions 'x_tokn_nll' is not a function mutmut mutates in "
            "src/posttrain/training/loss",
        ),
        (
            ["src/posttrain/training/loss.py", "--functions", ""],
            "--functions '' is not a function mutmut mutates",
        ),
    ],
)
def test_bad_functions_exit_2(capsys, argv, message):
    with pytest.raises(SystemExit) as exit:
        mutants.main(argv)
    assert exit.value.code == 2 and message in capsys.readouterr().err


def test_the_weekly_workflow_runs_every_module_and_every_attention_function():
    """Each TARGETS module is a job of the weekly mutants matrix; a module split into
    shards (``--functions``: attention.py, and generate.py's jitted decode loop apart)
    names each function it has in them, once."""
    root = pathlib.Path(mutants.__file__).resolve().parents[2]
    text = (root / ".github/workflows/matrix.yml").read_text()
    for module in mutants.TARGETS:
        assert f"- module: {module}\n" in text, module
    split = {}
    for module in mutants.TARGETS:
        pattern = rf"- module: {re.escape(module)}\n\s+functions: \"([^\"]+)\""
        if shards := re.findall(pattern, text):
            split[module] = [n for shard in shards for n in shard.split(",")]
    assert {"src/posttrain/layers/attention.py", "src/posttrain/generate.py"} <= set(split)
    for module, names in split.items():
        assert sorted(names) == sorted(mutants.function_names(module, root)), module


def test_functions_reach_the_run_and_the_defaults_stay(monkeypatch, tmp_path):
    """``--functions`` narrows its module's run; without it a module runs FUNCTIONS' names
    (the trainer's step) or all of its functions (no names)."""
    calls = {}

    def run(module, root, work, max_children, functions=()):
        calls[module] = tuple(functions)
        return {
            "module": module,
            "killed": 1,
            "survived": 0,
            "timeout": 0,
            "no_tests": 0,
            "total": 1,
            "score": 1.0,
            "survivors": [],
        }

    monkeypatch.setattr(mutants, "run_module", run)
    monkeypatch.setattr(mutants, "missing_prerequisite", lambda: None)
    loss, trainer = "src/posttrain/training/loss.py", "src/posttrain/training/trainer.py"
    argv = ["--report-dir", str(tmp_path), "--max-children", "1"]
    assert mutants.main([loss, trainer, *argv]) == 0
    assert calls == {loss: (), trainer: mutants.FUNCTIONS[trainer]}
    assert mutants.main([loss, "--functions", "x_token_nll,x_target_mask", *argv]) == 0
    assert calls[loss] == ("x_token_nll", "x_target_mask")


JITTED = """import functools
import jax
from flax import nnx


@nnx.jit(static_argnames=("n",))
def loop(x, n):
    return x * n


@functools.partial(
    jax.jit, static_argnames=("k",)
)
def shifted(x, *, k):
    return x + k


@functools.cache
@jax.jit
def mixed(x):
    return x


class C:
    @jax.jit
    def method(self, x):
        return x - 1

    @property
    def p(self):
        return 1
"""


def test_undecorate_frees_jitted_functions_and_keeps_what_they_compute(tmp_path):
    """mutmut skips decorated functions; in the scratch copy a function decorated only by
    JAX / NNX transforms (or ``property``) is undecorated and rewrapped right after its
    body (the same object at import), so mutmut mutates it; any other decorator stays."""
    out = mutants.undecorate(JITTED)
    assert "@nnx.jit" not in out and "@functools.partial" not in out
    assert "@functools.cache\n@jax.jit\ndef mixed" in out and "@property" not in out
    assert "        return 1\n    p = (property)(p)\n" in out
    assert (
        "    @jax.jit\n" not in out
        and "        return x - 1\n    method = (jax.jit)(method)\n" in out
    )
    names, original = {}, {}
    exec(compile(out, "undecorated", "exec"), names)
    exec(compile(JITTED, "decorated", "exec"), original)
    assert float(names["loop"](2.0, 3)) == float(original["loop"](2.0, 3)) == 6.0
    assert float(names["shifted"](2.0, k=4)) == 6.0
    assert float(names["C"].method(0.0, 3.0)) == 2.0  # self: any array here
    assert names["C"]().p == original["C"]().p == 1  # still a property
    assert type(names["loop"]) is type(original["loop"])  # still an nnx.jit wrapper
    module = tmp_path / "m.py"
    module.write_text(JITTED)
    assert mutants.function_names("m.py", tmp_path) == {
        "x_loop",
        "x_shifted",
        "xǁCǁmethod",
        "xǁCǁp",
    }


def _weekly_functions(module: str, root: pathlib.Path) -> set[str]:
    """The functions of ``module`` the weekly mutants jobs mutate."""
    text = (root / ".github/workflows/matrix.yml").read_text()
    shards = re.findall(rf"- module: {re.escape(module)}\n\s+functions: \"([^\"]+)\"", text)
    if shards:
        return {n for shard in shards for n in shard.split(",")}
    return set(mutants.FUNCTIONS.get(module, ())) or mutants.function_names(module, root)


def test_the_weekly_jobs_mutate_every_jitted_function_of_their_modules():
    """Each TARGETS module's functions decorated by a JAX / NNX transform (the decode loop,
    the merge's shift, the step's finiteness check) are among those its weekly job mutates."""
    import ast

    root = pathlib.Path(mutants.__file__).resolve().parents[2]
    jitted = {}
    for module in mutants.TARGETS:
        tree = ast.parse((root / module).read_text(encoding="utf-8"))
        nodes = [(None, n) for n in tree.body] + [
            (c.name, n) for c in tree.body if isinstance(c, ast.ClassDef) for n in c.body
        ]
        for owner, node in nodes:
            if isinstance(node, ast.FunctionDef) and any(
                re.search(r"\b(jax|nnx)\.jit\b", ast.unparse(d)) for d in node.decorator_list
            ):
                name = f"xǁ{owner}ǁ{node.name}" if owner else f"x_{node.name}"
                jitted.setdefault(module, set()).add(name)
    assert jitted["src/posttrain/generate.py"] == {"x__generate"}
    for module, names in jitted.items():
        assert names <= _weekly_functions(module, root), module


def test_the_stats_phase_traces_again_for_each_test(monkeypatch):
    """mutmut records the functions a test reaches from their trampolines, which a jitted
    body runs only when traced: in the stats phase each test starts with JAX's caches
    cleared (``jax.clear_caches``: a program compiled by an earlier test is traced again,
    and recorded); a mutant's own run keeps them. (Recorded, not called: clearing the
    gate worker's caches would make every later test in it trace again.)"""
    import jax

    cleared = []
    monkeypatch.setattr(jax, "clear_caches", lambda: cleared.append(1))
    monkeypatch.setenv("MUTANT_UNDER_TEST", "stats")
    mutants.pytest_runtest_setup(None)
    assert cleared == [1]
    monkeypatch.setenv("MUTANT_UNDER_TEST", "posttrain.generate.x__generate__mutmut_3")
    mutants.pytest_runtest_setup(None)
    monkeypatch.delenv("MUTANT_UNDER_TEST")
    mutants.pytest_runtest_setup(None)
    assert cleared == [1]
    assert "harness.tools.mutants" in mutants._PYTEST_ARGS


def test_the_scratch_copy_is_the_one_undecorated(monkeypatch, tmp_path):
    """run_module undecorates its module in the scratch copy before mutmut reads it, and
    leaves the checkout's file as it was."""
    import subprocess

    root = pathlib.Path(mutants.__file__).resolve().parents[2]
    module = "src/posttrain/generate.py"
    before = (root / module).read_text(encoding="utf-8")
    seen = []

    def run(command, cwd=None, **kwargs):
        seen.append((pathlib.Path(cwd) / module).read_text(encoding="utf-8"))
        return subprocess.CompletedProcess(command, 1, "", "mutmut stopped")

    monkeypatch.setattr(mutants.subprocess, "run", run)
    work = tmp_path / "work"
    work.mkdir()
    row = mutants.run_module(module, root, work, 1, ["x__generate"])
    assert row["error"] == "mutmut stopped"
    assert "@nnx.jit" not in seen[0] and "\n_generate = (nnx.jit(" in seen[0]
    assert (root / module).read_text(encoding="utf-8") == before
