"""Mutation testing of the numerics-critical modules with mutmut, one module at a time.

``python -m harness.tools.mutants [MODULE ...] [--max-children N] [--report-dir DIR]
[--functions NAME,...]`` (what ``tox -e mutants`` runs): for each module (default: all of
:data:`TARGETS`) it copies the project into a scratch directory, writes a
``[tool.mutmut]`` section that mutates only that module (only the functions
``--functions`` or :data:`FUNCTIONS` names, where either names some) and runs only
its targeted test selection, runs ``mutmut run`` there, and collects
mutmut's own counts (``mutmut export-cicd-stats``). The report, ``mutants.json`` and
``mutants.md`` in the report directory, gives per module: killed, survived, timed out,
no tests, the score (killed / (killed + survived + timeout)), and the surviving mutants'
names (``mutmut show NAME`` in that module's scratch directory prints each diff).

Each selection is sized so one module's run fits in about 20 minutes on 2 cores; the
attention's 413 mutants run as two shards (``--functions``) in the weekly workflow.
Workers are forked from a fork server that has imported nothing (``forkserver_warmup =
none``): JAX is not fork-safe once its backend has started. So each worker imports JAX
and compiles before its first test, and mutmut's CPU-time limit on it gets
:data:`TIMEOUT_CONSTANT_S` beyond the tests' estimate (``timeout_constant``).

Jitted functions: :mod:`harness.tools.mutant_sources` (how their mutants are reached).

Without mutmut (or what the copies' tests import) it stops before copying anything: one
line naming the first missing module and how to get it, exit 2
(:func:`missing_prerequisite`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence

from harness.tools.mutant_functions import FUNCTIONS
from harness.tools.mutant_sources import (  # noqa: F401 (TRANSFORMS: tools read it here)
    TRANSFORMS,
    function_names,
    mutant_patterns,
    undecorate,
)
from harness.tools.mutant_targets import TARGETS
from posttrain import atomic

# the gate's tier, and this module as a plugin (the stats phase's cache clearing)
_PYTEST_ARGS = [
    "-p",
    "no:cacheprovider",
    "-p",
    "harness.tools.mutants",
    "-x",
    "-q",
    "-m",
    "not slow",
]
# compat/: the harness reads compat/entries.toml (a report merge's tests, #56's report/shape.py)
_COPIED = (
    "src",
    "harness",
    "tests",
    "contracts",
    "compat",
    "pyproject.toml",
    "README.md",
    ".gitignore",
)


# what a run needs in this interpreter (mutmut's copies run their tests with it), first
# missing first, and where each comes from
PREREQUISITES = (
    ("mutmut", "the mutants dependency group"),
    ("pytest", "the test dependency group"),
    ("hypothesis", "the test dependency group"),
    ("tunix", "the train extra"),
)
_GET_THEM = (
    "uvx --with tox-uv tox -e mutants (from a fresh clone), or "
    "uv run --extra train --group test --group mutants python -m harness.tools.mutants"
)


def missing_prerequisite() -> str | None:
    """One line naming the first of :data:`PREREQUISITES` this interpreter lacks and how
    to get it; None when every one imports."""
    for module, source in PREREQUISITES:
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed ({source}); run: {_GET_THEM}"
    return None


# CPU seconds a mutant's worker gets beyond its tests' estimate (before mutmut's x 30)
TIMEOUT_CONSTANT_S = 5.0


def _section(module: str, selection: list[str], max_children: int) -> str:
    def toml_list(items):
        return "[" + ", ".join(json.dumps(i) for i in items) + "]"

    top = module.split("/")[0]  # src (the posttrain package) or harness: mutmut's import root
    # README.md: pyproject's readme, without which the matrix's and bisect's environment
    # builds of this checkout (tests/test_bisect.py) fail inside mutmut's copy
    kept = ("src", "harness", "contracts", "compat", ".gitignore", "README.md")
    copied = [d for d in kept if d != top]
    return (
        "\n[tool.mutmut]\n"
        f"source_paths = {toml_list([top])}\n"
        f"only_mutate = {toml_list([module])}\n"
        f"pytest_add_cli_args_test_selection = {toml_list(selection)}\n"
        f"pytest_add_cli_args = {toml_list(_PYTEST_ARGS)}\n"
        'process_isolation = "forkserver"\n'
        'forkserver_warmup = "none"\n'
        f"max_children = {max_children}\n"
        # mutmut's CPU-time limit is (estimate + constant) x 15 x 2: a worker forked from a
        # fork server that has imported nothing imports JAX and compiles first, which the
        # default constant (1 s) did not cover for quick selections (timeouts under load)
        f"timeout_constant = {TIMEOUT_CONSTANT_S}\n"
        f"also_copy = {toml_list(copied)}\n"
    )


def run_module(
    module: str,
    root: pathlib.Path,
    work: pathlib.Path,
    max_children: int,
    functions: Sequence[str] = (),
) -> dict:
    """Runs mutmut on ``module`` in ``work`` (a fresh copy of ``root``), on the mutants of
    ``functions`` only where given (mutmut's names); returns its row."""
    for name in _COPIED:
        source = root / name
        if source.is_dir():
            shutil.copytree(source, work / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif source.exists():
            shutil.copy2(source, work / name)
    target = work / module
    target.write_text(undecorate(target.read_text(encoding="utf-8")), encoding="utf-8")
    pyproject = work / "pyproject.toml"
    pyproject.write_text(
        pyproject.read_text(encoding="utf-8") + _section(module, TARGETS[module], max_children),
        encoding="utf-8",
    )
    env = {**os.environ, "HYPOTHESIS_PROFILE": "ci"}
    run = subprocess.run(
        [sys.executable, "-m", "mutmut", "run", f"--max-children={max_children}"]
        + mutant_patterns(module, functions),
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
    )
    subprocess.run([sys.executable, "-m", "mutmut", "export-cicd-stats"], cwd=work, env=env)
    stats_file = work / "mutants" / "mutmut-cicd-stats.json"
    if run.returncode != 0 or not stats_file.exists():
        tail = (run.stdout + run.stderr).strip().splitlines()[-3:]
        return {"module": module, "error": " | ".join(tail) or f"exit {run.returncode}"}
    stats = json.loads(stats_file.read_text())
    results = subprocess.run(
        [sys.executable, "-m", "mutmut", "results"], cwd=work, capture_output=True, text=True
    ).stdout
    survivors = [line.split(":")[0].strip() for line in results.splitlines() if "survived" in line]
    judged = stats["killed"] + stats["survived"] + stats["timeout"]
    return {
        "module": module,
        **{k: stats[k] for k in ("killed", "survived", "timeout", "no_tests", "total")},
        "score": None if not judged else stats["killed"] / judged,
        "survivors": survivors,
        "workdir": str(work),
    }


def pytest_runtest_setup(item) -> None:
    """In mutmut's stats phase (``MUTANT_UNDER_TEST=stats``), JAX's caches cleared before
    each test: a jitted function's trampoline runs when JAX traces it, so each test must
    trace again for mutmut to record that it reaches the function."""
    if os.environ.get("MUTANT_UNDER_TEST") == "stats" and "jax" in sys.modules:
        sys.modules["jax"].clear_caches()


def markdown(rows: list[dict]) -> str:
    lines = [
        "# Mutation scores (mutmut)",
        "",
        "| module | killed | survived | timeout | no tests | score |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| `{r['module']}` | error: {r['error']} | | | | |")
            continue
        score = "-" if r["score"] is None else f"{r['score']:.1%}"
        lines.append(
            f"| `{r['module']}` | {r['killed']} | {r['survived']} | {r['timeout']} | "
            f"{r['no_tests']} | {score} |"
        )
    for r in rows:
        if r.get("survivors"):
            lines += ["", f"Surviving in `{r['module']}`: " + ", ".join(r["survivors"])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.tools.mutants", description=__doc__)
    parser.add_argument("modules", nargs="*", help=f"default: all of {len(TARGETS)}")
    parser.add_argument("--max-children", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--report-dir", default="reports")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directories")
    parser.add_argument(
        "--functions",
        help="comma-separated functions of the one MODULE to mutate, by mutmut's names "
        "(x_name, xǁClassǁmethod; default: FUNCTIONS' or all): one shard of a long run",
    )
    args = parser.parse_args(argv)
    unknown = [m for m in args.modules if m not in TARGETS]
    if unknown:
        parser.error(f"unknown module {unknown[0]!r}; expected one of {sorted(TARGETS)}")
    root = pathlib.Path(__file__).resolve().parents[2]
    functions = {m: FUNCTIONS.get(m, ()) for m in args.modules or list(TARGETS)}
    if args.functions is not None:
        if len(args.modules) != 1:
            parser.error(f"--functions needs exactly one MODULE, got {len(args.modules)}")
        (module,) = args.modules
        names = tuple(n.strip() for n in args.functions.split(","))
        known = function_names(module, root)
        bad = [n for n in names if n not in known]
        if bad:
            parser.error(
                f"--functions {bad[0]!r} is not a function mutmut mutates in {module}; "
                f"expected one of {sorted(known)}"
            )
        functions[module] = names
    if args.max_children < 1:
        parser.error(f"--max-children {args.max_children}: expected >= 1")
    report_dir = pathlib.Path(args.report_dir)
    if report_dir.exists() and not report_dir.is_dir():
        parser.error(f"--report-dir {report_dir} is a file, expected a directory")
    if missing := missing_prerequisite():
        print(f"python -m harness.tools.mutants: {missing}", file=sys.stderr)
        return 2
    rows = []
    for module, names in functions.items():
        work = pathlib.Path(tempfile.mkdtemp(prefix="mutants-"))
        print(f"mutants: {module} in {work}", flush=True)
        row = run_module(module, root, work, args.max_children, names)
        rows.append(row)
        print(markdown([row]).splitlines()[-1], flush=True)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
            row.pop("workdir", None)
    report_dir.mkdir(parents=True, exist_ok=True)
    atomic.write_text(report_dir / "mutants.json", json.dumps(rows, indent=2) + "\n")
    atomic.write_text(report_dir / "mutants.md", markdown(rows))
    print(markdown(rows))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
