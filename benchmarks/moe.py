"""Times the MoE algorithms against each other and a plain matmul with the same useful FLOPs.

Usage::

    PYTHONPATH=src python benchmarks/moe.py --tokens 4096 --d-model 256 --d-ff 512 \
        --experts 64 --top-k 2 --repeats 5

Each row is a jitted forward on the default backend (CPU here): one warm-up
call, then the median of ``--repeats`` timed calls, each ending in
``block_until_ready``. ``sorted`` and ``matmul`` take turns within each repeat,
so that other load on a shared machine slows them alike; ``dense`` and
``ragged`` are timed on their own, as their gigabytes of temporaries would slow
whichever call follows them:

* ``dense``, ``sorted``, ``ragged``: ``MoEBlock`` forwards (router included) with
  the same parameters, one per ``MoEConfig.algorithm``;
* ``matmul``: the baseline, one expert MLP (gate, up, down matmuls and the
  activation) on ``tokens * top_k`` rows: the useful FLOPs of the routed block.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain.config import ActivationConfig, ModelConfig, MoEConfig
from posttrain.layers.mlp import gated_activation
from posttrain.layers.moe import MoEBlock, default_block_size

SILU = ActivationConfig("silu", ModelConfig.swiglu_alpha, ModelConfig.swiglu_limit)


def _time_interleaved(calls: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each ``fn(*args)`` in ``calls`` after one warm-up call each.

    The calls take turns within each repeat, so load from other processes on a
    shared machine slows all of them alike and the ratios stay meaningful.
    """
    for fn, args in calls.values():
        jax.block_until_ready(fn(*args))
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, (fn, args) in calls.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _block_forward(args, algorithm: str, x: jax.Array):
    cfg = MoEConfig(
        num_experts=args.experts,
        top_k=args.top_k,
        moe_d_ff=args.d_ff,
        algorithm=algorithm,
        block_size=args.block_size,
    )
    block = MoEBlock(args.d_model, cfg, SILU, norm_eps=1e-6, rngs=nnx.Rngs(0))
    graph, state = nnx.split(block)

    @jax.jit
    def forward(state, x):
        return nnx.merge(graph, state)(x)[0]

    return forward, state


def _matmul_forward(args):
    rows = args.tokens * args.top_k
    keys = jax.random.split(jax.random.key(1), 4)
    x = jax.random.normal(keys[0], (rows, args.d_model), jnp.float32)  # [T*R, D]
    gate = jax.random.normal(keys[1], (args.d_model, args.d_ff), jnp.float32)  # [D, F]
    up = jax.random.normal(keys[2], (args.d_model, args.d_ff), jnp.float32)  # [D, F]
    down = jax.random.normal(keys[3], (args.d_ff, args.d_model), jnp.float32)  # [F, D]

    @jax.jit
    def forward(x, gate, up, down):
        hidden = gated_activation(x @ gate, x @ up, SILU)  # [T*R, F]
        return hidden @ down  # [T*R, D]

    return forward, (x, gate, up, down)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--d-ff", type=int, default=512)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="sorted block size; default: posttrain's default_block_size",
    )
    parser.add_argument(
        "--algorithms",
        default="dense,sorted,ragged",
        help="comma-separated subset of dense,sorted,ragged",
    )
    args = parser.parse_args(argv)

    x = jax.random.normal(jax.random.key(0), (1, args.tokens, args.d_model), jnp.float32)
    useful_gflop = 6 * args.tokens * args.top_k * args.d_model * args.d_ff / 1e9
    block = args.block_size or default_block_size(args.tokens * args.top_k, args.experts)
    print(
        f"backend={jax.default_backend()} devices={jax.device_count()} T={args.tokens} "
        f"D={args.d_model} F={args.d_ff} E={args.experts} R={args.top_k} "
        f"block_size={block} repeats={args.repeats} useful={useful_gflop:.2f} GFLOP"
    )

    blocks = {a: _block_forward(args, a, x) for a in args.algorithms.split(",") if a}
    # sorted and the baseline take turns; dense and ragged (seconds each, GBs of
    # temporaries that evict caches and page-fault the next call) are timed apart
    close = {a: (fn, (state, x)) for a, (fn, state) in blocks.items() if a == "sorted"}
    close["matmul"] = _matmul_forward(args)
    seconds = _time_interleaved(close, args.repeats)
    for algorithm, (fn, state) in blocks.items():
        if algorithm != "sorted":
            seconds.update(_time_interleaved({algorithm: (fn, (state, x))}, args.repeats))
    outputs = {a: np.asarray(fn(state, x)) for a, (fn, state) in blocks.items()}

    print(f"{'algorithm':<10} {'median ms':>10} {'useful GFLOP/s':>15}")
    for name in [*blocks, "matmul"]:
        s = seconds[name]
        print(f"{name:<10} {s * 1e3:>10.1f} {useful_gflop / s:>15.1f}")
    names = list(outputs)
    for name in names[1:]:
        diff = np.max(np.abs(outputs[name] - outputs[names[0]]))
        print(f"max |{name} - {names[0]}| = {diff:.2e}")
    if "sorted" in seconds and "dense" in seconds:
        print(f"sorted vs dense: {seconds['dense'] / seconds['sorted']:.1f}x")
    if "sorted" in seconds:
        print(f"sorted vs useful-FLOP matmul: {seconds['sorted'] / seconds['matmul']:.2f}x")


if __name__ == "__main__":
    main()
