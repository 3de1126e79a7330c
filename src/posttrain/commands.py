"""What each ``posttrain`` subcommand does, given its parsed arguments (:mod:`posttrain.cli`
parses them, sets the devices and turns errors into one line and an exit status).

Each returns the exit status. JAX and the stack are imported inside the functions: the
CLI sets the devices first.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time


def forward(args: argparse.Namespace) -> int:
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
    print(
        f"model {args.model}: {n_params:,} params, {cfg.num_layers} layers, "
        f"scan_layers={cfg.scan_layers}, remat={cfg.remat}"
    )
    print(
        f"mesh {mesh_desc} on {mesh.size} {jax.devices()[0].platform} devices; "
        f"global batch {batch} = {args.per_device_batch_size} x data-parallel {dp}"
    )
    tokens = np.random.RandomState(args.seed).randint(0, cfg.vocab_size, (batch, args.seq))
    with sharding.use_mesh(mesh):
        spec = sharding.logical_to_spec(
            ("activation_batch", "activation_length"), tokens.shape, dict(mesh.shape)
        )
        tokens = jax.device_put(
            jnp.asarray(tokens, jnp.int32), jax.sharding.NamedSharding(mesh, spec)
        )
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
    print(
        f"logits {list(host.shape)} float32: mean {host.mean():+.4f}, std {host.std():.4f}, "
        f"finite {bool(np.isfinite(host).all())}; moe_aux_loss {float(aux['moe_aux_loss']):.4f}"
    )
    print(
        f"init {built:.2f} s, first forward (compile) {compiled:.2f} s, "
        f"forward {per_step * 1e3:.1f} ms, {batch * args.seq / per_step:,.0f} tokens/s"
    )
    return 0


def convert(args: argparse.Namespace) -> int:
    from posttrain import conversion

    if (args.source_format, args.target_format) == ("hf", "native"):
        overrides = {"scan_layers": True} if args.scan else {}
        summary = conversion.convert_hf_to_native(
            args.src,
            args.dst,
            max_shard_bytes=args.max_shard_size,
            fsync=not args.no_fsync,
            **overrides,
        )
    elif (args.source_format, args.target_format) == ("native", "hf"):
        summary = conversion.convert_native_to_hf(
            args.src,
            args.dst,
            layout=args.layout,
            prefix=args.prefix,
            max_shard_bytes=args.max_shard_size,
            fsync=not args.no_fsync,
        )
    else:
        raise ValueError(
            f"--from {args.source_format} --to {args.target_format}: "
            "convert goes hf -> native or native -> hf"
        )
    print(summary.line())
    print(f"wrote {args.dst}")
    return 0


def check_logits(args: argparse.Namespace) -> int:
    from posttrain.conversion.parity import check_logits

    with contextlib.suppress(ImportError):  # entry point: keep stderr for errors only
        import transformers

        transformers.utils.logging.disable_progress_bar()
    parity = check_logits(args.hf_dir, args.native_dir, seq=args.seq, seed=args.seed)
    print(parity.line())
    if parity.ok(args.max_kl, args.atol):
        return 0
    limits = f"--max-kl {args.max_kl:g}" + (f", --atol {args.atol:g}" if args.atol else "")
    print(f"posttrain: check-logits: FAILED ({limits})", file=sys.stderr)
    return 1


def sft_config(args: argparse.Namespace):
    """The ``SFTConfig`` of parsed ``posttrain sft`` arguments (unchecked)."""
    from posttrain import sharding
    from posttrain.sft.run import SFTConfig

    return SFTConfig(
        model=args.model,
        data=args.data,
        tokenizer=args.tokenizer,
        mesh=sharding.parse_mesh_spec(args.mesh) if args.mesh else None,
        per_device_batch_size=args.per_device_batch_size,
        grad_accum=args.grad_accum,
        steps=args.steps,
        max_target_length=args.max_target_length,
        packing=not args.no_packing,
        overflow=args.overflow,
        learning_rate=args.learning_rate,
        warmup_steps=args.warmup_steps,
        lora_rank=args.lora_rank,
        lora_alpha=args.lora_alpha,
        remat=args.remat,
        scan_layers=args.scan,
        seed=args.seed,
        save_every=args.save_every,
        sync_saves=args.sync_saves,
        replica_parallel_saves=args.replica_parallel_saves,
        stop_after=args.stop_after,
        output=args.output,
    )


def sft(args: argparse.Namespace) -> int:
    from posttrain.sft.run import run_sft

    cfg = sft_config(args)
    cfg.check()
    # Tunix's tqdm bar shows on a terminal only; elsewhere print ~10 progress lines.
    log_every = None if sys.stderr.isatty() else max(1, cfg.steps // 10)
    result = run_sft(cfg, log_every=log_every)
    if log_every is None:
        print(
            f"model {cfg.model}: {result.params:,} params, {result.trainable:,} trained; "
            f"global batch {result.global_batch}; Tunix convention {result.convention}"
        )
    print(result.summary())
    print(
        f"checkpoint step {result.checkpoint_step} in {result.output / 'checkpoints'}; "
        f"metrics in {result.output / 'metrics.jsonl'}"
    )
    for path in result.exported:
        print(f"wrote {path}")
    return 0
