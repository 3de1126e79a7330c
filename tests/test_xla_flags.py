"""posttrain.xla_flags: the collective timeout fake CPU devices get where the installed
jaxlib knows the flag, from ``posttrain --devices N`` and the harness alike."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from posttrain.xla_flags import (
    COLLECTIVE_TIMEOUT_FLAG,
    jaxlib_version,
    with_collective_timeout,
)

pytestmark = pytest.mark.host


@pytest.mark.parametrize(
    ("flags", "version", "want"),
    [
        ("--a", "0.10.2", f"--a {COLLECTIVE_TIMEOUT_FLAG}=600"),
        ("", "0.8.0", f"{COLLECTIVE_TIMEOUT_FLAG}=600"),
        ("", "0.8.0.dev20250801", f"{COLLECTIVE_TIMEOUT_FLAG}=600"),
        ("", "1.0", f"{COLLECTIVE_TIMEOUT_FLAG}=600"),
        (f"{COLLECTIVE_TIMEOUT_FLAG}=5 --a", "0.9.1", f"{COLLECTIVE_TIMEOUT_FLAG}=5 --a"),
        ("--a", "0.7.2", "--a"),
        (f"--a {COLLECTIVE_TIMEOUT_FLAG}=600 --b", "0.7.1", "--a --b"),  # inherited by an old env
        (f"{COLLECTIVE_TIMEOUT_FLAG} --a", None, "--a"),  # no jaxlib: nothing to keep
        (
            f"{COLLECTIVE_TIMEOUT_FLAG}_x=1",
            "0.10.2",
            f"{COLLECTIVE_TIMEOUT_FLAG}_x=1 {COLLECTIVE_TIMEOUT_FLAG}=600",
        ),
    ],
)
def test_the_collective_timeout_follows_the_jaxlib_that_knows_it(flags, version, want) -> None:
    """From jaxlib 0.8.0 the rendezvous timeout is added (a chosen one kept); before, it is
    removed, as XLA aborts on a flag it does not know."""
    assert with_collective_timeout(flags, version) == want


def test_the_installed_jaxlib_is_read_without_importing_jax() -> None:
    """The version comes from the distribution's metadata (this environment's 0.10.x)."""
    version = jaxlib_version()
    assert version is not None and version.startswith("0.10.")


@pytest.mark.parametrize("given", ["", f"{COLLECTIVE_TIMEOUT_FLAG}=7"])
def test_posttrain_devices_sets_the_timeout_before_jax_starts(given) -> None:
    """``posttrain --devices 4``'s flags, set in a process without JAX: the device count
    and the timeout (a chosen one kept)."""
    code = (
        "import os, sys; from posttrain import cli; cli._set_devices('4'); "
        "assert 'jax' not in sys.modules; print(os.environ['XLA_FLAGS'])"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["XLA_FLAGS"] = given
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
    tokens = done.stdout.split()
    assert "--xla_force_host_platform_device_count=4" in tokens
    want = given or f"{COLLECTIVE_TIMEOUT_FLAG}=600"
    assert [t for t in tokens if t.startswith(COLLECTIVE_TIMEOUT_FLAG)] == [want]
