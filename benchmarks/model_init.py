"""Tracing cost of building a model: ``nnx.eval_shape`` of ``CausalLM(cfg)`` per preset.

Usage::

    python benchmarks/model_init.py                      # llama3-8b, qwen3_moe-30b-a3b, qwen3-tiny
    python benchmarks/model_init.py --preset llama3-8b --repeats 5

No array is allocated: ``nnx.eval_shape`` only traces the constructor, the part of
``build_model`` (and of conversion planning, ``conversion.native.abstract_params``)
that grows with the parameter count. Each preset is timed twice in the same
process, best of ``--repeats``:

* ``posttrain``: parameters keyed by ``posttrain._compat.next_rng_key``;
* ``stream()``: the same with every key drawn by ``rngs.params()``, the flax
  0.12.1+ path that asks each traced counter for its ``sharding`` (an AttributeError
  whose message walks the whole trace so far: quadratic in the parameter count).

It prints both times and the ratio. Target: building is linear in the parameter
count, so a real-size preset gains most (measured on 2 cores, flax 0.12.8:
llama3-8b 3.5 s -> 0.52 s (6.6x), qwen3_moe-30b-a3b 14.0 s -> 1.18 s (11.9x)).
"""

from __future__ import annotations

import argparse

from _timing import best_time

from harness.devices.devices import configure_devices

DEFAULT_PRESETS = ("llama3-8b", "qwen3_moe-30b-a3b", "qwen3-tiny")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", action="append", help="preset name (repeatable)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    configure_devices(1)

    import jax
    from flax import nnx

    from posttrain import _compat
    from posttrain.models import CausalLM, get_config

    ours = _compat.next_rng_key
    print(f"{'preset':<22} {'params':>8} {'posttrain':>10} {'stream()':>10} {'ratio':>6}")
    for name in args.preset or DEFAULT_PRESETS:
        cfg = get_config(name)

        def build(cfg=cfg):
            return nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)))

        count = len(jax.tree.leaves(nnx.state(build(), nnx.Param)))
        try:
            fast = best_time(build, args.repeats)
            _compat.next_rng_key = lambda stream: stream()
            slow = best_time(build, args.repeats)
        finally:
            _compat.next_rng_key = ours
        print(f"{name:<22} {count:>8} {fast:>9.3f}s {slow:>9.3f}s {slow / fast:>5.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
