"""The ``posttrain`` command.

Subcommands:
  forward   build a preset on a mesh, run a jitted forward, print shardings and figures.

``sft``, ``convert`` and ``check-logits`` arrive with the trainer and conversion
packages. Errors in the arguments print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _set_devices(count: str) -> None:
    """Fake CPU devices before JAX is imported (this is a program entry point)."""
    if count == "real":
        return
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    flags.append(f"--xla_force_host_platform_device_count={int(count)}")
    os.environ["XLA_FLAGS"] = " ".join(flags)


def _forward(args: argparse.Namespace) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from posttrain import sharding
    from posttrain.models import build_model, get_config

    cfg = get_config(args.model, scan_layers=args.scan, remat=args.remat)
    mesh = sharding.make_mesh(sharding.parse_mesh_spec(args.mesh) if args.mesh else None)
    dp = sharding.data_parallel_size(mesh)
    sp = sharding.sequence_parallel_size(mesh)
    batch = args.per_device_batch_size * dp
    if args.seq % sp:
        raise ValueError(f"--seq {args.seq} must be a multiple of the sequence-parallel size {sp}")
    started = time.perf_counter()
    model = build_model(cfg, mesh, seed=args.seed)
    built = time.perf_counter() - started
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    mesh_desc = ", ".join(f"{a}={s}" for a, s in mesh.shape.items() if s > 1) or "single device"
    print(f"model {args.model}: {n_params:,} params, {cfg.num_layers} layers, "
          f"scan_layers={cfg.scan_layers}, remat={cfg.remat}")
    print(f"mesh {mesh_desc} on {mesh.size} {jax.devices()[0].platform} devices; "
          f"global batch {batch} = {args.per_device_batch_size} x data-parallel {dp}")
    tokens = np.random.RandomState(args.seed).randint(0, cfg.vocab_size, (batch, args.seq))
    with sharding.use_mesh(mesh):
        spec = sharding.logical_to_spec(("activation_batch", "activation_length"),
                                        tokens.shape, dict(mesh.shape))
        tokens = jax.device_put(jnp.asarray(tokens, jnp.int32),
                                jax.sharding.NamedSharding(mesh, spec))
        step = nnx.jit(lambda m, t: m.forward(t))
        t0 = time.perf_counter()
        logits, aux = step(model, tokens)
        logits.block_until_ready()
        compiled = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            logits, aux = step(model, tokens)
        logits.block_until_ready()
        per_step = (time.perf_counter() - t0) / args.repeats
    host = np.asarray(logits)
    print(f"logits {list(host.shape)} float32: mean {host.mean():+.4f}, std {host.std():.4f}, "
          f"finite {bool(np.isfinite(host).all())}; moe_aux_loss {float(aux['moe_aux_loss']):.4f}")
    print(f"init {built:.2f} s, first forward (compile) {compiled:.2f} s, "
          f"forward {per_step * 1e3:.1f} ms, {batch * args.seq / per_step:,.0f} tokens/s")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="posttrain", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    fwd = sub.add_parser("forward", help="build a preset on a mesh and run a forward pass")
    fwd.add_argument("--model", default="qwen3_moe-tiny", help="preset name (default %(default)s)")
    fwd.add_argument("--mesh", default="fsdp=4,tensor=2",
                     help="axis sizes, e.g. data=2,fsdp=2,expert=2 (default %(default)s)")
    fwd.add_argument("--devices", default=os.environ.get("POSTTRAIN_DEVICES", "8"),
                     help="fake CPU devices, or 'real' (default %(default)s)")
    fwd.add_argument("--per-device-batch-size", type=int, default=1)
    fwd.add_argument("--seq", type=int, default=64)
    fwd.add_argument("--scan", action="store_true", help="scan_layers=True")
    fwd.add_argument("--remat", default="none", choices=("none", "full", "save_dots"))
    fwd.add_argument("--repeats", type=int, default=5)
    fwd.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _set_devices(args.devices)
        if args.command == "forward":
            if args.per_device_batch_size < 1 or args.seq < 1 or args.repeats < 1:
                raise ValueError("--per-device-batch-size, --seq and --repeats must be >= 1")
            return _forward(args)
    except ValueError as e:
        print(f"posttrain: error: {e}", file=sys.stderr)
        return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
