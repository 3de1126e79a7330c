"""A ``--tunix-source`` URL's credentials reach git through the environment only: never
the install command's arguments (which uv and pip keep in their caches, direct_url.json
and process listings) nor any file the matrix writes (#56, the known gap)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from harness.matrix import entries, envs, matrix, sources

pytestmark = pytest.mark.host

COMMIT = "0123456789abcdef0123456789abcdef01234567"
TOKEN = "tok3n-s3cret"
URL = f"https://user:{TOKEN}@git.example.invalid/org/tunix.git"


def source_entry(spec: str) -> entries.Entry:
    return entries.Entry(
        name="tunix-source",
        tunix="source",
        flavour="source",
        convention=entries.CONVENTIONS[-1],
        source=spec,
    )


class Recorder:
    """An environment builder's runner that records each command and environment."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], dict[str, str] | None]] = []

    def __call__(self, command, env=None) -> subprocess.CompletedProcess:
        self.calls.append((list(command), env))
        if "venv" in command:  # the environment's directory, as `uv venv PATH` makes it
            Path(command[-1]).mkdir(parents=True)
        return subprocess.CompletedProcess(list(command), 0, "", "")


def git_rules(env: dict[str, str]) -> dict[str, str]:
    """The ``url.<base>.insteadOf`` rules an environment gives git: {written: base}."""
    count = int(env.get("GIT_CONFIG_COUNT", "0"))
    rules = {}
    for n in range(count):
        key = env[f"GIT_CONFIG_KEY_{n}"]
        if key.startswith("url.") and key.endswith(".insteadOf"):
            rules[env[f"GIT_CONFIG_VALUE_{n}"]] = key[len("url.") : -len(".insteadOf")]
    return rules


@pytest.mark.parametrize("prefix", ["", "git+"])
def test_a_credentialed_source_installs_without_its_token_in_any_argument(tmp_path, prefix):
    """The install is given the URL without its user-info, and git (through the
    environment) the rule that turns it back into the credentialed one."""
    entry = matrix.resolve(source_entry(f"{prefix}{URL}@{COMMIT}"))
    assert TOKEN not in json.dumps(entry.resolved)
    runner = Recorder()
    cache = envs.EnvCache(tmp_path / "envs", run=runner)
    assert cache.ensure(entry).error is None
    assert runner.calls and not any(TOKEN in arg for command, _ in runner.calls for arg in command)
    install = next(env for command, env in runner.calls if "install" in command)
    assert install is not None
    assert git_rules(install) == {"https://git.example.invalid/org/tunix.git": URL}
    written = [p.read_text() for p in (tmp_path / "envs").rglob("*") if p.is_file()]
    assert written and not any(TOKEN in text for text in written)


def test_a_source_without_credentials_installs_in_the_inherited_environment(tmp_path):
    """Nothing to hide: the environment is the harness's own (no rules added)."""
    entry = matrix.resolve(source_entry(f"https://git.example.invalid/t.git@{COMMIT}"))
    runner = Recorder()
    envs.EnvCache(tmp_path / "envs", run=runner).ensure(entry)
    assert all(env is None for _, env in runner.calls)
    wanted = f"git+https://git.example.invalid/t.git@{COMMIT}"
    assert any(wanted in arg for command, _ in runner.calls for arg in command)


def test_an_scp_like_source_keeps_its_user_for_ssh():
    """``git@host:path`` holds no secret: the requirement keeps ``git@`` for ssh."""
    entry = matrix.resolve(source_entry(f"git@git.example.invalid:org/t.git@{COMMIT}"))
    assert entry.resolved[1].endswith(f"git+ssh://git@git.example.invalid/org/t.git@{COMMIT}")
    assert sources.install_environ(entry.source) is None
