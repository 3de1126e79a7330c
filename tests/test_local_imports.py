"""Imports inside functions (issue #58): every one in src/posttrain and harness/ is listed in
``harness/tools/local_imports.toml`` with its kind and reason
(:mod:`harness.tools.local_imports`), and each entry that names an entry point keeps it
light: importing the entry loads the entry's module but not what the entry defers."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from harness.tools import local_imports

pytestmark = pytest.mark.host

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
ALLOW = tomllib.loads(local_imports.ALLOW_LIST.read_text(encoding="utf-8"))


def test_every_import_inside_a_function_is_listed_with_its_kind_and_reason():
    problems = local_imports.check(
        local_imports.sites(ROOT), ALLOW, local_imports.optional_packages(PYPROJECT)
    )
    assert not problems, "\n".join(problems)


def _tree(tmp_path: Path, body: str) -> Path:
    """A checkout of one module, ``src/posttrain/m.py`` holding ``body``."""
    (tmp_path / "src/posttrain").mkdir(parents=True)
    (tmp_path / "harness").mkdir()
    (tmp_path / "src/posttrain/__init__.py").write_text("")
    (tmp_path / "src/posttrain/other.py").write_text("")
    (tmp_path / "harness/__init__.py").write_text("")
    (tmp_path / "src/posttrain/m.py").write_text(textwrap.dedent(body))
    return tmp_path


SITE = {"kind": "pending", "path": "src/posttrain/m.py", "function": "C.f", "reason": "why"}


def test_an_unlisted_import_inside_a_function_fails_naming_it(tmp_path):
    root = _tree(
        tmp_path,
        """
        import os


        class C:
            import re  # a class body runs at import: not counted

            def f(self):
                import json
                from . import other

                return json, other
        """,
    )
    found = local_imports.sites(root)
    assert [(s.function, s.modules) for s in found] == [
        ("C.f", ("json",)),
        ("C.f", ("posttrain.other",)),
    ]
    problems = local_imports.check(found, {}, {})
    assert len(problems) == 2
    assert problems[0].startswith("src/posttrain/m.py:9: `json` imported inside C.f()")
    listed = {"site": [{**SITE, "imports": ["json", "posttrain.other"]}]}
    assert local_imports.check(found, listed, {}) == []
    assert local_imports.counts(found, listed) == {"pending": 2}


def test_a_stale_or_malformed_entry_fails(tmp_path):
    found = local_imports.sites(_tree(tmp_path, "def f():\n    import json\n"))
    stale = {"site": [{**SITE, "function": "f", "imports": ["json", "re"]}]}
    assert local_imports.check(found, stale, {}) == [
        "local_imports.toml: src/posttrain/m.py f() imports no `re`: remove it"
    ]
    for bad, says in (
        ({"kind": "lazy"}, "kind 'lazy' is none of"),
        ({"reason": " "}, "no reason"),
        ({"kind": "cycle"}, "names its cycle"),
        ({"kind": "startup"}, "names its entry point"),
    ):
        entry = {**SITE, "function": "f", "imports": ["json"], **bad}
        (problem,) = local_imports.check(found, {"site": [entry]}, {})
        assert says in problem
    # a package listed as optional must be declared outside the base dependencies
    assert local_imports.check(found, {"optional": {"json": "stdlib"}}, {}) == [
        "optional 'json': pyproject.toml declares it in no extra or group"
    ]
    assert local_imports.check(found, {"optional": {"json": "x"}}, {"json": "train"}) == []


def test_optional_packages_are_the_extras_groups_and_deptry_ignores_never_a_base_one():
    optional = local_imports.optional_packages(PYPROJECT)
    assert optional["tunix"] == optional["PIL"] == "train"
    assert optional["transformers"] == "reference" and optional["torch"] == "DEP001"
    assert "jax" not in optional and "numpy" not in optional  # jax[tpu] is an extra of a base one
    assert set(ALLOW["optional"]) <= set(optional)
    assert optional["pytest"] == optional["_pytest"] == "test"  # deptry's map: a list


def test_a_distribution_deptry_maps_to_several_modules_declares_each():
    """deptry's ``package_module_name_map`` takes a module or a list of them."""
    pyproject = {
        "project": {"dependencies": ["numpy", "Pillow>=10"], "optional-dependencies": {}},
        "dependency-groups": {"test": ["pytest>=8", "pytest-xdist[psutil]>=3.5", "Flax"]},
        "tool": {"deptry": {"package_module_name_map": {"pytest": ["pytest", "_pytest"]}}},
    }
    assert local_imports.optional_packages(pyproject) == {
        "pytest": "test",
        "_pytest": "test",
        "pytest_xdist": "test",
        "flax": "test",
    }
    # no map at all: each distribution its own module; deptry's ignores name the rule
    pyproject["dependency-groups"]["x"] = ["numpy", "orbax-checkpoint"]  # numpy: a base one
    pyproject["tool"]["deptry"] = {"per_rule_ignores": {"DEP001": ["torch"], "DEP004": ["a"]}}
    assert local_imports.optional_packages(pyproject) == {
        "pytest": "test",
        "pytest_xdist": "test",
        "flax": "test",
        "orbax_checkpoint": "x",
        "torch": "DEP001",
        "a": "DEP004",
    }


def _loaded_by(entry: str) -> set[str]:
    """The modules a fresh interpreter holds after ``import entry`` (no device set up)."""
    code = f"import json, sys; import {entry}; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    return set(json.loads(done.stdout))


ENTRIES = sorted({e["entry"] for e in ALLOW["site"] if e["kind"] in local_imports.ENTRY_KINDS})


@pytest.mark.parametrize("entry", ENTRIES)
def test_each_entry_point_loads_the_module_but_not_what_it_defers(entry):
    """A ``device_setup`` or ``startup`` entry is true: importing its entry point loads the
    site's module (the import is on that path) and leaves out something the site imports
    (it really is deferred); a ``device_setup`` entry point loads no JAX at all."""
    loaded = _loaded_by(entry)
    wrong = []
    for site in (e for e in ALLOW["site"] if e.get("entry") == entry):
        module = local_imports._module_name(site["path"])
        if module not in loaded:
            wrong.append(f"{site['path']} {site['function']}: {entry} does not import {module}")
        elif set(site["imports"]) <= loaded:
            wrong.append(f"{site['path']} {site['function']}: {entry} loads it all already")
        if site["kind"] == "device_setup" and "jax" in loaded:
            wrong.append(f"{site['path']} {site['function']}: {entry} imports JAX")
    assert not wrong, "\n".join(wrong)
