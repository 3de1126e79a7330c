"""XLA compile seconds of the same programs with XLA's defaults and with
``jax_disable_most_optimizations`` (XLA's backend optimisation level 0), on whatever
platform JAX finds (this CPU, or a chip's with ``POSTTRAIN_DEVICES``-free ``python3``).

Usage::

    python benchmarks/compile_effort.py [--families 3] [--rounds 2]

The programs: the loss and gradient of ``--families`` tiny presets, scanned and unscanned
(``2 x --families`` programs, batch 2 x 16). Each round compiles all of them under each
setting in turn (``jax.clear_caches()`` between), timing ``Lowered.compile()`` alone, and
checks that both settings give the same losses to 1e-4.

Printed: each setting's seconds per round, their medians, and the ratio
level 0 / defaults.
"""

from __future__ import annotations

import argparse
import statistics
import time

SETTINGS = {"defaults": False, "backend level 0": True}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    for name in ("families", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} {getattr(args, name)}: expected >= 1")

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from posttrain.models import build_model, get_config
    from posttrain.models.presets import TINY_PRESETS

    if args.families > len(TINY_PRESETS):
        parser.error(f"--families {args.families}: expected <= {len(TINY_PRESETS)}")
    tokens = jnp.zeros((2, 16), jnp.int32)
    models = [
        nnx.split(build_model(get_config(name, scan_layers=scan)))
        for name in TINY_PRESETS[: args.families]
        for scan in (False, True)
    ]

    def loss(graphdef, state, t):
        out = nnx.merge(graphdef, state)(t)
        logits = out[0] if isinstance(out, tuple) else out
        return jnp.mean(jax.nn.log_softmax(logits.astype(jnp.float32))[..., 0])

    seconds: dict[str, list[float]] = {name: [] for name in SETTINGS}
    losses: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for name, disabled in SETTINGS.items():
            jax.config.update("jax_disable_most_optimizations", disabled)
            jax.clear_caches()
            total, values = 0.0, []
            for graphdef, state in models:
                step = jax.jit(jax.value_and_grad(lambda s, t, g=graphdef: loss(g, s, t)))
                lowered = step.lower(state, tokens)
                start = time.perf_counter()
                compiled = lowered.compile()
                total += time.perf_counter() - start
                values.append(float(compiled(state, tokens)[0]))
            seconds[name].append(total)
            losses[name] = values
            print(f"{name}: {total:.2f} s for {len(models)} programs", flush=True)
    jax.config.update("jax_disable_most_optimizations", False)
    first, second = (losses[name] for name in SETTINGS)
    if max(abs(a - b) for a, b in zip(first, second, strict=True)) > 1e-4:
        raise SystemExit(f"the settings' losses differ: {first} against {second}")
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    print(
        f"{jax.default_backend()}, {len(models)} programs: defaults "
        f"{medians['defaults']:.2f} s, backend level 0 {medians['backend level 0']:.2f} s, "
        f"ratio {medians['backend level 0'] / medians['defaults']:.3f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
