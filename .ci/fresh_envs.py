"""Installs this checkout into fresh environments, one per extra, and runs what each owns.

The README's first command runs `uv run posttrain-harness matrix`: an environment holding
only the base dependencies. A development environment (every extra and group) hides an
import that only an extra or a transitive dependency provides; this does not.

For each set (base alone, and base + each extra; the sets side by side): a new `uv venv`,
`uv pip install .[extra]`, then in it
  1. the set's entry points (the commands below) must exit 0;
  2. every module of `posttrain` and `harness` is imported: it must import, or fail with
     ModuleNotFoundError for a module that a *declared* extra provides (the module then
     belongs to that extra). A missing module no extra declares fails the check.

Exit status 1 with one line per problem; 0 when every set passes.
Usage: python .ci/fresh_envs.py [--keep DIR] [EXTRA ...]   (default: base and train)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# What each set must run. `--help` builds every parser; `matrix --list` reads the entries
# and the drift check's imports; `devices` starts JAX.
ENTRY_POINTS: dict[str, list[list[str]]] = {
    "base": [
        ["posttrain-harness", "--help"],
        # a wheel holds no compat/ (the matrix runs from a checkout): the checkout's entries
        ["posttrain-harness", "matrix", "--list", "--entries", str(ROOT / "compat/entries.toml")],
        ["posttrain-harness", "devices", "--devices", "2"],
        ["posttrain", "--help"],
    ],
    "train": [
        ["posttrain", "sft", "--help"],
        ["posttrain", "generate", "--help"],
    ],
}

# Runs inside the fresh environment: imports every module, prints a JSON list of
# [module, error type, missing module name or message].
PROBE = r"""
import importlib, json, pkgutil, sys
import harness, posttrain
out = []
names = []
for package in (harness, posttrain):
    names.append(package.__name__)
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        names.append(info.name)
for name in names:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as error:
        out.append([name, "ModuleNotFoundError", (error.name or "").split(".")[0]])
    except Exception as error:  # noqa: BLE001 - reported, not raised
        out.append([name, type(error).__name__, str(error).splitlines()[0][:200]])
print(json.dumps(out))
"""


def provided_by_extras() -> dict[str, str]:
    """Top-level import name -> the extra (or 'test' group) that declares it."""
    sys.path.insert(0, str(ROOT))  # stdlib only: this runs before any environment exists
    from harness.tools.local_imports import distribution_modules

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    renames = project["tool"]["deptry"]["package_module_name_map"]
    found: dict[str, str] = {}
    groups = {**project["project"]["optional-dependencies"]}
    groups["test"] = project["dependency-groups"]["test"]
    for extra, requirements in groups.items():
        for requirement in requirements:
            for module in distribution_modules(requirement, renames):  # pytest: and _pytest
                found.setdefault(module, extra)
    found.setdefault("torch", "reference")  # installed beside the reference extra by hand
    return found


def check(extra: str, where: Path, uv: list[str]) -> list[str]:
    venv = where / extra
    spec = f"{ROOT}" if extra == "base" else f"{ROOT}[{extra}]"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["UV_NO_CONFIG"] = "1"  # the checkout's [tool.uv] pins serve the dev env only
    subprocess.run(
        [*uv, "venv", "--quiet", "--python", sys.executable, str(venv)], check=True, env=env
    )
    python = venv / "bin" / "python"
    subprocess.run(
        [*uv, "pip", "install", "--quiet", "--python", str(python), spec], check=True, env=env
    )
    problems = []
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["JAX_PLATFORMS"] = "cpu"
    for command in ENTRY_POINTS["base"] + (ENTRY_POINTS.get(extra, []) if extra != "base" else []):
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            env=env,
            cwd=tempfile.gettempdir(),
        )
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            problems.append(f"[{extra}] `{' '.join(command)}` exit {done.returncode}: {last}")
    done = subprocess.run(
        [str(python), "-c", PROBE],
        capture_output=True,
        text=True,
        env=env,
        cwd=tempfile.gettempdir(),
    )
    if done.returncode != 0:
        return [*problems, f"[{extra}] the import probe failed: {done.stderr.strip()[-300:]}"]
    extras = provided_by_extras()
    installed = {"base", extra}
    for module, kind, what in json.loads(done.stdout):
        if kind != "ModuleNotFoundError":
            problems.append(f"[{extra}] import {module}: {kind}: {what}")
        elif what not in extras:
            problems.append(f"[{extra}] import {module}: needs {what!r}, which no extra declares")
        elif extras[what] in installed:
            problems.append(
                f"[{extra}] import {module}: needs {what!r}, declared by "
                f"{extras[what]!r} but not installed with it"
            )
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("extras", nargs="*", default=["base", "train"])
    parser.add_argument("--keep", type=Path, help="build the environments here (kept)")
    args = parser.parse_args()
    found = os.environ.get("UV") or shutil.which("uv")  # `uv run` exports UV
    uv = [found] if found else [sys.executable, "-m", "uv"]
    with tempfile.TemporaryDirectory(prefix="fresh-envs-") as tmp:
        where = args.keep or Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        # One thread per set: each waits on its own uv and interpreters, so the sets'
        # installs and import probes share the cores instead of taking turns.
        with ThreadPoolExecutor(max_workers=max(1, len(args.extras))) as pool:
            found_by_set = pool.map(lambda extra: check(extra, where, uv), args.extras)
            problems = [p for found in found_by_set for p in found]
    for line in problems:
        print(f"fresh-envs: {line}", file=sys.stderr)
    print(
        f"fresh-envs: {', '.join(args.extras)}: "
        f"{'ok' if not problems else f'{len(problems)} problem(s)'}"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
