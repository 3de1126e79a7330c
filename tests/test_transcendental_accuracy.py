"""The backend's float32 transcendental functions are within the bounds that
``tests/transcendentals.py`` documents for it: the tolerances it gives on a chip are the
chip's real accuracy, not a number picked until a test passed.

On the CPU these are JAX's CPU bounds; on the lent v5e (2026-12-06) the same samples
measured log 4,020 ulp, log1p 4,018, tanh 1,362, exp 67, logistic 82 (bounds 4,030.5,
4,034, 1,365.5, 116, 243).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import transcendentals

pytestmark = pytest.mark.matmul_precision("highest")

# each function on the range the models and losses feed it, against float64 NumPy
CASES = {
    "exp": (jnp.exp, np.exp, (-20.0, 20.0)),
    "log": (jnp.log, np.log, (1e-3, 50.0)),
    "log1p": (jnp.log1p, np.log1p, (-0.9, 5.0)),
    "tanh": (jnp.tanh, np.tanh, (-6.0, 6.0)),
    "logistic": (jax.nn.sigmoid, lambda x: 1.0 / (1.0 + np.exp(-x)), (-15.0, 15.0)),
}


def ulps(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """``|got - want|`` in float32 ulps of ``want`` (``want`` float64)."""
    spacing = np.abs(np.spacing(want.astype(np.float32))).astype(np.float64)
    return np.abs(got.astype(np.float64) - want) / spacing


@pytest.mark.parametrize("name", sorted(CASES))
def test_float32_transcendentals_are_within_the_documented_ulps(name):
    fn, reference, (low, high) = CASES[name]
    x = np.random.default_rng(0).uniform(low, high, 100_000).astype(np.float32)
    got = np.asarray(jax.jit(fn)(x))
    worst = float(ulps(got, reference(x.astype(np.float64))).max())
    where = transcendentals.column()
    allowed = transcendentals.MAX_ULPS[where][name]
    assert transcendentals.bound(name) == allowed * 2.0**-23
    if where == "cpu":
        # A CPU's figures depend on its vendor (JAX notes it for atan and rsqrt; this
        # project's AMD EPYC measured tanh 5.8 ulp against JAX's 5.0): held to twice the
        # table, 1.2e-6 relative at most: under the 1e-5 the float32 comparisons use.
        assert worst <= 2 * allowed and 2 * allowed * 2.0**-23 < 1.5e-6, f"{name}: {worst:.1f}"
    else:
        assert worst <= allowed, f"{name}: {worst:.1f} ulp on {where}"


def test_ulps_counts_the_float32_spacing():
    """One float32 step above 1 is one ulp; half a step, half."""
    one = np.float64(1.0)
    step = float(np.spacing(np.float32(1.0)))
    assert ulps(np.float32([1.0 + step]), np.array([one]))[0] == 1.0
    assert ulps(np.float32([1.0]), np.array([one + step / 2]))[0] == pytest.approx(0.5)


def test_each_tpu_kind_has_its_column():
    class Kind:
        platform = "tpu"

        def __init__(self, kind):
            self.device_kind = kind

    seen = {
        k: transcendentals.column(Kind(k))
        for k in ("TPU v5 lite", "TPU v4", "TPU v5", "TPU v5p", "TPU v6 lite", "TPU7x", "TPU v9")
    }
    assert seen == {
        "TPU v5 lite": "tpu v2-v5e",
        "TPU v4": "tpu v2-v5e",
        "TPU v5": "tpu v5p",
        "TPU v5p": "tpu v5p",
        "TPU v6 lite": "tpu v6e",
        "TPU7x": "tpu 7x",
        "TPU v9": "tpu v2-v5e",  # unknown: the loosest
    }
    v5e = Kind("TPU v5 lite")
    assert transcendentals.rtol(1e-5, "log", "tanh", device=v5e) == 4030.5 * 2.0**-23
    assert transcendentals.rtol(1e-3, "log", device=v5e) == 1e-3
    assert transcendentals.rtol(1e-5, "tanh", device=jax.devices("cpu")[0]) == 1e-5
    assert math.isclose(transcendentals.bound("exp", device=Kind("TPU v6 lite")), 64.5 * 2**-23)
