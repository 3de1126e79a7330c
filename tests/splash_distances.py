"""Splash attention's float32 distance from the host's float32 XLA result, on whatever
backend runs it: ``python -m tests.splash_distances`` (docs/scale.md's table of the v5e).

For the two float32 cases of ``tests/test_splash_attention.py`` (qwen3-tiny padding,
gpt_oss-tiny packed) and each of the XLA path, splash in interpret mode and the compiled
splash kernel (a TPU only), prints the worst distance of the logits and of each parameter
gradient from the host CPU's float32 XLA result, in units of the test's FP32_TOL (1e-5 of
the largest logit, or of the largest gradient), at ``highest`` matmul precision.
"""

from __future__ import annotations

import jax
import numpy as np

from posttrain.models import get_config
from tests import test_splash_attention as splash_tests

CASES = (("qwen3-tiny", "padding"), ("gpt_oss-tiny", "packed"))


def distances(result, host) -> list[tuple[str, float]]:
    """``(leaf name, worst |result - host| / FP32_TOL / scale)`` for the logits and each
    gradient: the scale is the host's largest logit, or its largest gradient."""
    leaves, truth = splash_tests._leaves(result), splash_tests._leaves(host)
    grad_scale = max(float(np.max(np.abs(g))) for name, g in truth if name != "logits")
    out = []
    for (name, got), (_, want) in zip(leaves, truth, strict=True):
        scale = float(np.max(np.abs(want))) if name == "logits" else grad_scale
        out.append((name, float(np.max(np.abs(got - want))) / splash_tests.FP32_TOL / scale))
    return out


def main() -> None:
    kernels = ["xla", "splash_interpret"] + (["splash"] if jax.default_backend() == "tpu" else [])
    cpu = jax.devices("cpu")[0]
    with jax.default_matmul_precision("highest"):
        for preset, case in CASES:
            cfg = get_config(preset)
            mask, valid = splash_tests.MASKS[case](4)
            with jax.default_device(cpu):
                host = splash_tests._logits_grads(cfg, mask, valid, 4, device=cpu)
            for kernel in kernels:
                result = splash_tests._logits_grads(
                    cfg.replace(attention_kernel=kernel), mask, valid, 4
                )
                rows = distances(result, host)
                worst = max(d for name, d in rows if name != "logits")
                print(
                    f"{preset} {case} {kernel} on {jax.default_backend()}: logits "
                    f"{rows[0][1]:.2f}, worst gradient {worst:.2f} (x FP32_TOL)",
                    flush=True,
                )


if __name__ == "__main__":
    main()
