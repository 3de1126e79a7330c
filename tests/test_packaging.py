"""Packaging drift (DESIGN.md, regression 13): what a machine without our dev tools sees."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.host

ROOT = Path(__file__).resolve().parent.parent


def test_test_modules_that_use_uv_collect_and_skip_without_it(tmp_path):
    """A machine installed with pip has no `uv`: every test module that runs uv still
    collects there, and its uv tests skip saying why (a call at import time once made
    the whole file, and so the gate, fail to collect)."""
    users = sorted(
        str(path.relative_to(ROOT))
        for path in [*(ROOT / "tests").glob("test_*.py"), *(ROOT / "contracts").glob("test_*.py")]
        if re.search(r"""["']uv["']""", path.read_text(encoding="utf-8"))
    )
    assert "tests/test_matrix_sources.py" in users  # the file that once failed
    # PATH: the interpreter's own directory only (a venv's bin holds no uv); no UV variable.
    env = {k: v for k, v in os.environ.items() if k not in ("UV", "PYTEST_ADDOPTS")}
    env["PATH"] = str(Path(sys.executable).parent)
    assert shutil.which("uv", path=env["PATH"]) is None
    uv_tests = "an_environment_that_cannot_be_built or a_source_entry_builds_its_environment"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            "-m",
            "slow or not slow",
            "-k",
            uv_tests,
            *users,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    skips = re.findall(r"SKIPPED \[1\] (\S+): (.*)", done.stdout)
    assert len(skips) == 2, done.stdout[-2000:]
    assert all("uses uv here" in why for _, why in skips), skips
