"""How far a backend's float32 transcendental functions are from the true value, and the
tolerances that follows for float32 comparisons against float64 or another backend.

A TPU v2-v5e computes float32 ``log`` to within 4,030.5 ulp and ``tanh`` to within
1,365.5 ulp (a relative error up to 4.8e-4 and 1.6e-4), where a CPU is within a few ulp:
JAX documents the maxima per function and chip (``docs/accuracy.md``, "float32
accuracy", exhaustive over every float32 input), and on the lent v5e (2026-12-06) the
measured maxima were log 4,020, log1p 4,018, tanh 1,362, exp 67 (``.tpu`` diagnosis,
docs/testing.md). A float32 comparison at 1e-5 that passes through those functions fails
there for no fault of the code; :func:`rtol` raises a test's own tolerance to the
documented bound of the functions its path takes, on that backend only (the CPU's bounds
are below every tolerance the tests use, so the CPU tier's tolerances stay as written).
``tests/test_transcendental_accuracy.py`` holds each backend to the table.
"""

from __future__ import annotations

import jax

#: float32 ulps, 1 ulp <= 2**-23 of the value: the bound of a relative error
ULP = 2.0**-23

#: Maximum float32 error in ulps per function and backend (JAX ``docs/accuracy.md``,
#: "float32 accuracy", jax-ml/jax at 031068b; columns CPU, NVIDIA GPU, TPU v2-v5e, v5p,
#: v6e, 7x). Only the functions the tests' paths take.
MAX_ULPS: dict[str, dict[str, float]] = {
    "cpu": {"exp": 1.5, "log": 1.5, "log1p": 3.0, "tanh": 5.0, "logistic": 2.5},
    "gpu": {"exp": 2.0, "log": 1.0, "log1p": 1.0, "tanh": 5.5, "logistic": 4.0},
    "tpu v2-v5e": {"exp": 116.0, "log": 4030.5, "log1p": 4034.0, "tanh": 1365.5, "logistic": 243.0},
    "tpu v5p": {"exp": 109.5, "log": 62.0, "log1p": 63.0, "tanh": 92.0, "logistic": 124.0},
    "tpu v6e": {"exp": 64.5, "log": 2.5, "log1p": 3.0, "tanh": 1.5, "logistic": 65.5},
    "tpu 7x": {"exp": 65.0, "log": 2.5, "log1p": 3.0, "tanh": 1.5, "logistic": 64.0},
}


def column(device: jax.Device | None = None) -> str:
    """The :data:`MAX_ULPS` column of ``device`` (default: JAX's first device).

    A TPU is told by its ``device_kind`` ("TPU v5 lite" is a v5e, "TPU v5" or "TPU v5p" a
    v5p, "TPU v6 lite" a v6e, "TPU7x"); a kind not known takes the v2-v5e column, the
    loosest.
    """
    device = device or jax.devices()[0]
    if device.platform == "cpu":
        return "cpu"
    if device.platform in ("gpu", "cuda", "rocm"):
        return "gpu"
    kind = device.device_kind.lower().replace(" ", "")
    if "7x" in kind:
        return "tpu 7x"
    if "v6" in kind:
        return "tpu v6e"
    if kind in ("tpuv5", "tpuv5p"):
        return "tpu v5p"
    return "tpu v2-v5e"


def bound(*functions: str, device: jax.Device | None = None) -> float:
    """The largest relative error the backend documents for one float32 application of
    any of ``functions`` (``"exp"``, ``"log"``, ``"log1p"``, ``"tanh"``, ``"logistic"``).

    Raises:
      KeyError: a function not in :data:`MAX_ULPS`.
    """
    table = MAX_ULPS[column(device)]
    return max(table[f] for f in functions) * ULP


def rtol(tolerance: float, *functions: str, device: jax.Device | None = None) -> float:
    """``tolerance``, or the backend's documented bound of ``functions`` where it is larger
    (:func:`bound`): what a float32 result that takes them can be held to."""
    return max(tolerance, bound(*functions, device=device))
