"""Imports inside functions: each one is listed, by kind, with its reason (issue #58).

An import belongs at the top of its module, where the reader, import-linter's layers and
the start-up costs see it. One inside a function must be of a kind of :data:`KINDS`,
listed as data in ``harness/tools/local_imports.toml``:

* ``optional``: a package that is not a base dependency (an optional extra, a dependency
  group, or installed by hand: deptry's ``DEP001`` / ``DEP004`` ignores), anywhere: the
  module still imports without it. Listed per package.
* ``device_setup``: JAX, or a module that imports it, in a module that ``entry`` (an entry
  point) imports before it sets the devices (``XLA_FLAGS``, ``JAX_PLATFORMS``): JAX reads
  them once, at its first import. Listed per site, as the kinds below.
* ``startup``: work that ``entry`` (an entry point, or a module one imports whole) must not
  pay for at import: a subcommand's stack, Flax or an extra's package for one function.
* ``cycle``: debt, an import cycle not broken yet; ``cycle`` names it (``a -> b -> a``).
* ``pending``: debt, an import that could move up but stands in a module another change
  holds; the reason says which.

``python -m harness.tools.local_imports`` (``tox -e lint``, ``.ci/run``) prints each import
inside a function that the list does not allow, each entry that matches none, and the
count by kind; exit status 1 on a problem. ``tests/test_local_imports.py`` runs it and
checks each ``entry``: importing it loads the site's module but not what the site defers.
"""

from __future__ import annotations

import argparse
import ast
import collections
import re
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TREES = ("src/posttrain", "harness")
ALLOW_LIST = Path(__file__).with_name("local_imports.toml")
KINDS = ("optional", "device_setup", "startup", "cycle", "pending")
#: The site kinds that name the entry point whose import they keep light.
ENTRY_KINDS = ("device_setup", "startup")


@dataclass(frozen=True)
class Site:
    """One import statement inside a function.

    Attributes:
      path: the file, relative to the checkout (``src/posttrain/cli.py``).
      function: the enclosing function's qualified name (``Class.method``, ``outer.inner``).
      line: the statement's line.
      modules: what it imports: ``import a.b`` -> ``a.b``; ``from a import b`` -> ``a.b``
        when ``a/b`` is a module of :data:`TREES`, else ``a``; relative imports resolved.
    """

    path: str
    function: str
    line: int
    modules: tuple[str, ...]


def _module_name(relative: str) -> str:
    """``src/posttrain/a/b.py`` -> ``posttrain.a.b``; ``harness/a/__init__.py`` -> ``harness.a``."""
    parts = Path(relative.removeprefix("src/")).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(node: ast.Import | ast.ImportFrom, relative: str, own: set[str]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    module = node.module or ""
    if node.level:
        package = _module_name(relative).split(".")
        if not relative.endswith("__init__.py"):
            package = package[:-1]
        package = package[: len(package) - node.level + 1]
        module = ".".join([*package, *([module] if module else [])])
    found = [f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in own]
    return found if len(found) == len(node.names) else [*found, module]


def _own_modules(root: Path) -> set[str]:
    return {
        _module_name(str(p.relative_to(root)))
        for tree in TREES
        for p in (root / tree).rglob("*.py")
    }


def sites(root: Path = ROOT) -> list[Site]:
    """Every import inside a function under :data:`TREES` (class bodies run at import: not
    counted; their methods are)."""
    own, found = _own_modules(root), []

    def visit(node: ast.AST, relative: str, scope: list[str], in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom) and in_function:
                modules = tuple(sorted(set(_targets(child, relative, own))))
                found.append(Site(relative, ".".join(scope), child.lineno, modules))
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                is_function = not isinstance(child, ast.ClassDef)
                visit(child, relative, [*scope, child.name], in_function or is_function)
            else:
                visit(child, relative, scope, in_function)

    for tree in TREES:
        for path in sorted((root / tree).rglob("*.py")):
            relative = str(path.relative_to(root))
            visit(ast.parse(path.read_text(encoding="utf-8")), relative, [], False)
    return found


def distribution_modules(requirement: str, renames: dict) -> list[str]:
    """The import names of ``requirement``'s distribution (``jax[tpu]>=0.4`` -> ``jax``):
    deptry's ``package_module_name_map`` (``renames``) gives one or a list (pytest:
    ``pytest`` and ``_pytest``); else the distribution's name, lower-cased, ``-`` as ``_``."""
    dist = re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0]
    names = renames.get(dist, dist.lower().replace("-", "_"))
    return [names] if isinstance(names, str) else list(names)


def optional_packages(pyproject: dict) -> dict[str, str]:
    """Import name -> where pyproject declares it outside the base dependencies: an
    optional extra or a dependency group (deptry's name map applied); a package deptry's
    ``DEP001`` or ``DEP004`` ignores (torch: by hand; pytest's own modules) -> that rule."""
    deptry = pyproject["tool"]["deptry"]
    renames = deptry.get("package_module_name_map", {})

    def modules(requirements: list[str]) -> list[str]:
        return [m for r in requirements for m in distribution_modules(r, renames)]

    base = set(modules(pyproject["project"]["dependencies"]))  # jax[tpu] stays base
    found = {}
    groups = {**pyproject["project"]["optional-dependencies"], **pyproject["dependency-groups"]}
    for group, requirements in groups.items():
        for name in modules(requirements):
            if name not in base:
                found.setdefault(name, group)
    for rule in ("DEP001", "DEP004"):
        for name in deptry.get("per_rule_ignores", {}).get(rule, []):
            found.setdefault(name, rule)
    return found


def _entry_problems(allow: dict, optional: dict[str, str]) -> list[str]:
    problems = []
    for name, reason in allow.get("optional", {}).items():
        if name not in optional:
            problems.append(f"optional {name!r}: pyproject.toml declares it in no extra or group")
        if not str(reason).strip():
            problems.append(f"optional {name!r}: no reason")
    for entry in allow.get("site", []):
        where = f"{entry.get('path')}:{entry.get('function')}"
        if entry.get("kind") not in KINDS[1:]:
            problems.append(f"{where}: kind {entry.get('kind')!r} is none of {KINDS[1:]}")
        if not str(entry.get("reason", "")).strip():
            problems.append(f"{where}: no reason")
        cycle = entry.get("cycle", "").split(" -> ")
        if entry.get("kind") == "cycle" and (len(cycle) < 3 or cycle[0] != cycle[-1]):
            problems.append(f"{where}: a cycle entry names its cycle ('a -> b -> a')")
        if entry.get("kind") in ENTRY_KINDS and not entry.get("entry"):
            problems.append(f"{where}: a {entry['kind']} entry names its entry point (entry)")
    return problems


def check(found: list[Site], allow: dict, optional: dict[str, str]) -> list[str]:
    """The problems, one line each: an import of :func:`sites` that ``allow`` (the parsed
    allow-list) does not list, an entry that lists nothing found, a malformed entry."""
    problems = _entry_problems(allow, optional)
    listed = {(e["path"], e["function"], m): e for e in allow.get("site", []) for m in e["imports"]}
    used = set()
    for site in found:
        for module in site.modules:
            if module.split(".")[0] in allow.get("optional", {}):
                continue
            key = (site.path, site.function, module)
            if key in listed:
                used.add(key)
                continue
            problems.append(
                f"{site.path}:{site.line}: `{module}` imported inside {site.function}(): move "
                f"it to the module's top, or list it in {ALLOW_LIST.name} with its kind and reason"
            )
    for key in listed.keys() - used:
        problems.append(f"{ALLOW_LIST.name}: {key[0]} {key[1]}() imports no `{key[2]}`: remove it")
    return problems


def counts(found: list[Site], allow: dict) -> collections.Counter:
    """Imports inside functions (site x module) by kind; ``unlisted`` for the rest."""
    kinds = {
        (e["path"], e["function"], m): e["kind"]
        for e in allow.get("site", [])
        for m in e["imports"]
    }
    tally = collections.Counter()
    for site in found:
        for module in site.modules:
            if module.split(".")[0] in allow.get("optional", {}):
                tally["optional"] += 1
            else:
                tally[kinds.get((site.path, site.function, module), "unlisted")] += 1
    return tally


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout to read")
    parser.add_argument("--allow-list", type=Path, default=ALLOW_LIST)
    args = parser.parse_args(argv)
    allow = tomllib.loads(args.allow_list.read_text(encoding="utf-8"))
    pyproject = tomllib.loads((args.root / "pyproject.toml").read_text(encoding="utf-8"))
    found = sites(args.root)
    problems = check(found, allow, optional_packages(pyproject))
    for line in problems:
        print(f"local-imports: {line}", file=sys.stderr)
    tally = counts(found, allow)
    by_kind = ", ".join(f"{k} {tally[k]}" for k in (*KINDS, "unlisted") if tally[k])
    print(f"local-imports: {sum(tally.values())} imports inside functions ({by_kind})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
