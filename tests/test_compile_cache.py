"""JAX's persistent compilation cache of the suites' runs (``harness/devices/compile_cache.py``):
what a run is told, and the pruning that keeps the cache under a size in place of JAX's
own limit, which listed the whole cache before every write."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.devices import compile_cache
from harness.devices.devices import suite_env
from tests.cli_help import help_text

pytestmark = pytest.mark.host

T0 = 1_700_000_000 * 10**9  # ns


def _entry(cache: Path, key: str, size: int, used_ns: int, atime_file: int | None = None) -> Path:
    """A ``<key>-cache`` file of ``size`` bytes last read and written at ``used_ns``; with
    ``atime_file``, the ``<key>-atime`` file JAX's own limit keeps beside it."""
    path = cache / f"{key}-cache"
    path.write_bytes(b"x" * size)
    os.utime(path, ns=(used_ns, used_ns))
    if atime_file is not None:
        (cache / f"{key}-atime").write_bytes(atime_file.to_bytes(8, "little"))
    return path


def test_env_points_jax_at_the_directory_with_its_own_limit_off(tmp_path: Path) -> None:
    assert compile_cache.env("off") == {}
    env = compile_cache.env(str(tmp_path / "user" / "cache"))  # parents made too
    assert env["JAX_COMPILATION_CACHE_DIR"] == str((tmp_path / "user" / "cache").resolve())
    assert (tmp_path / "user" / "cache").is_dir()
    assert float(env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]) > 0
    assert env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] == "0"
    assert env["JAX_COMPILATION_CACHE_MAX_SIZE"] == "-1"


def test_prune_removes_the_least_recently_used_until_the_rest_fit(tmp_path: Path) -> None:
    cache = tmp_path
    oldest = _entry(cache, "jit_a-01", 100, T0 + 1)
    read_late = _entry(cache, "jit_b-02", 100, T0 + 2, atime_file=T0 + 10)  # JAX's limit read it
    newer = _entry(cache, "jit_c-03", 100, T0 + 3)
    (cache / "README").write_text("not an entry")
    (cache / "jit_gone-04-atime").write_bytes(T0.to_bytes(8, "little"))  # its entry is gone

    assert compile_cache.prune(cache, max_bytes=300) == []
    assert compile_cache.prune(cache, max_bytes=150) == [oldest, newer]
    assert sorted(p.name for p in cache.iterdir()) == ["README", "jit_b-02-atime", "jit_b-02-cache"]
    assert read_late.exists()
    assert compile_cache.prune(cache, max_bytes=0) == [read_late]
    assert [p.name for p in cache.iterdir()] == ["README"]


def test_the_kernels_access_time_counts_as_a_use(tmp_path: Path) -> None:
    """Without JAX's limit no ``-atime`` file is written: a read shows in the file's atime."""
    written_early_read_late = _entry(tmp_path, "jit_a-01", 100, T0 + 1)
    os.utime(written_early_read_late, ns=(T0 + 50, T0 + 1))
    written_later = _entry(tmp_path, "jit_b-02", 100, T0 + 2)
    assert compile_cache.last_use_ns(written_early_read_late) == T0 + 50
    assert compile_cache.prune(tmp_path, max_bytes=100) == [written_later]


def test_an_entry_gone_meanwhile_is_skipped(tmp_path: Path) -> None:
    (tmp_path / "jit_0-00-cache").symlink_to(tmp_path / "absent")  # first by name; stat fails
    oldest = _entry(tmp_path, "jit_a-01", 100, T0 + 1)
    _entry(tmp_path, "jit_b-02", 100, T0 + 2)
    assert compile_cache.prune(tmp_path, max_bytes=100) == [oldest]


def test_prune_refuses_a_negative_size(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^max_bytes=-1: expected >= 0$"):
        compile_cache.prune(tmp_path, max_bytes=-1)


def test_the_command_prunes_a_directory_and_refuses_a_negative_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _entry(tmp_path, "jit_a-01", 100, T0 + 1)
    kept = _entry(tmp_path, "jit_b-02", 100, T0 + 2)
    assert compile_cache.main([str(tmp_path), "--max-bytes", "100"]) == 0
    assert (
        capsys.readouterr().out
        == f"compile cache {tmp_path}: removed 1 least recently used entries\n"
    )
    assert [p for p in tmp_path.iterdir()] == [kept]
    assert compile_cache.main([str(tmp_path / "absent")]) == 0
    assert "nothing to prune" in capsys.readouterr().out
    assert compile_cache.main([str(tmp_path), "--max-bytes", "0"]) == 0  # empties it
    assert capsys.readouterr().out.endswith(": removed 1 least recently used entries\n")
    kept = _entry(tmp_path, "jit_b-02", 100, T0 + 2)
    help_ = help_text(compile_cache.main, capsys)
    assert help_.startswith("usage: python -m harness.devices.compile_cache [-h]")
    assert "Prune JAX's persistent compilation cache to a size, least recently used first." in help_
    assert "default: 2147483648" in help_
    with pytest.raises(SystemExit) as exit_:
        compile_cache.main([str(tmp_path), "--max-b", "0"])  # no abbreviations
    assert exit_.value.code == 2
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        compile_cache.main([str(tmp_path), "--max-bytes", "-5"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith("--max-bytes -5: expected >= 0")
    assert kept.exists()


def test_tox_runs_the_command_with_warnings_as_errors(tmp_path: Path) -> None:
    """``tox -e tpu`` runs ``python -m harness.devices.compile_cache`` (its commands_pre).
    The v5e's run of it warned that runpy found the module already imported by its
    package's import (``harness`` imported its device source, which imports this): with
    warnings as errors that is a failed run."""
    _entry(tmp_path, "jit_a-01", 100, T0 + 1)
    done = subprocess.run(
        [sys.executable, "-W", "error", "-m", "harness.devices.compile_cache", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == f"compile cache {tmp_path}: removed 0 least recently used entries\n"


def test_a_run_writes_its_compiles_without_jaxs_limit(tmp_path: Path, monkeypatch) -> None:
    """JAX's limit is off where the run lands (its config, and no ``-atime`` file beside a
    new entry), also when the caller's shell set one; an entry written under the limit
    earlier (no ``-atime`` file: one that failed every later write under the limit with
    ``-W error``) is read and written beside."""
    cache = tmp_path / "cache"
    cache.mkdir()
    old = _entry(cache, "jit_old-0123", 3, T0)
    monkeypatch.setenv("JAX_COMPILATION_CACHE_MAX_SIZE", str(2 * 1024**3))
    env = {
        k: v
        for k, v in suite_env(str(cache)).items()
        if not k.startswith(("PYTEST_", "HYPOTHESIS_"))
    }
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    code = "\n".join(
        [
            "import jax, jax.numpy as jnp",
            "jax.jit(lambda x: x * 3 + 1)(jnp.ones(4)).block_until_ready()",
            "print(jax.config.jax_compilation_cache_max_size)",
        ]
    )
    run = subprocess.run(
        [sys.executable, "-W", "error", "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["-1"]
    names = {p.name for p in cache.iterdir()}
    assert any(n.startswith("jit__lambda") and n.endswith("-cache") for n in names), sorted(names)
    assert not [n for n in names if n.endswith("-atime")], sorted(names)
    assert old.exists()
