"""``posttrain forward``, ``convert`` and ``check-logits``: a model's forward pass, its
checkpoint converted, its logits compared with HF's."""

from __future__ import annotations

import contextlib
import pathlib
import sys
import time

import numpy as np

from posttrain import conversion, distributed
from posttrain.conversion.directories import sweep_stale_temporaries


def forward(args) -> int:
    """``posttrain forward``: a preset built on a mesh, its jitted forward timed."""
    import jax
    from flax import nnx

    from posttrain import flags, sharding
    from posttrain.models import build_model, get_config

    cfg = get_config(args.model, scan_layers=args.scan, remat=args.remat)
    mesh = sharding.make_mesh(
        None
        if args.mesh is None
        else flags.parse_flag("--mesh", args.mesh, sharding.parse_mesh_spec)
    )
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
    stats, compiled, per_step = _timed_forwards(model, mesh, tokens.astype(np.int32), args.repeats)
    mean, std, finite, moe = (np.asarray(x) for x in stats)
    print(
        f"logits {[batch, args.seq, cfg.vocab_size]} float32: mean {float(mean):+.6f}, "
        f"std {float(std):.6f}, finite {bool(finite)}; moe_aux_loss {float(moe):.4f}"
    )
    print(
        f"init {built:.2f} s, first forward (compile) {compiled:.2f} s, "
        f"forward {per_step * 1e3:.1f} ms, {batch * args.seq / per_step:,.0f} tokens/s"
    )
    return 0


def _timed_forwards(model, mesh, tokens, repeats: int):
    """``(logits mean, std, finiteness, moe_aux_loss)`` of the jitted forward of
    ``tokens`` ``[batch, seq]`` int32 on ``mesh``, the first call's seconds (compile) and
    the mean seconds of ``repeats`` more."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from posttrain import sharding

    def forward_stats(m, t):
        # Reduced inside the jit: across processes the logits' shards are not all
        # addressable here, their mean / std / finiteness are (replicated scalars).
        logits, aux = m.forward(t)
        finite = jnp.all(jnp.isfinite(logits))
        return logits.mean(), logits.std(), finite, aux["moe_aux_loss"]

    with sharding.use_mesh(mesh):
        spec = sharding.logical_to_spec(
            ("activation_batch", "activation_length"), tokens.shape, dict(mesh.shape)
        )
        # Each process places the shards of its own devices (all of them in one process).
        placed = jax.make_array_from_callback(
            tokens.shape, jax.sharding.NamedSharding(mesh, spec), lambda index: tokens[index]
        )
        step = nnx.jit(forward_stats)
        t0 = time.perf_counter()
        stats = jax.block_until_ready(step(model, placed))
        compiled = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(repeats):
            stats = step(model, placed)
        stats = jax.block_until_ready(stats)
    return stats, compiled, (time.perf_counter() - t0) / repeats


def convert(args) -> int:
    """``posttrain convert``: host files to host files. Across processes rank 0 converts
    and the others wait for it (every process reads the same directories, one writes)."""
    distributed.initialize()  # a no-op outside the launcher and POSTTRAIN_DISTRIBUTED
    # A failure in rank 0 reaches the others as OtherProcessFailed (exit 1).
    status = distributed.on_writer(lambda: _convert(args, conversion), "convert")
    if not distributed.is_writer():
        print(f"rank {distributed.process_index()}: rank 0 wrote {args.dst}")
        return 0
    return status


def _convert(args, conversion) -> int:
    parent = pathlib.Path(args.dst).absolute().parent
    swept = sweep_stale_temporaries(parent)  # killed writers' leftovers, whatever the name
    if swept:
        print(
            f"swept {len(swept)} temporar{'y' if len(swept) == 1 else 'ies'} of killed "
            f"writers in {parent}: {', '.join(p.name for p in swept)}"
        )
    if (args.source_format, args.target_format) == ("hf", "native"):
        overrides = {"scan_layers": True} if args.scan else {}
        summary = conversion.convert_hf_to_native(
            args.src,
            args.dst,
            max_shard_bytes=args.max_shard_size,
            fsync=not args.no_fsync,
            vision=args.vision,
            **overrides,
        )
    else:  # native -> hf (ConvertOptions.check refuses the other pairs)
        summary = conversion.convert_native_to_hf(
            args.src,
            args.dst,
            layout=args.layout,
            prefix=args.prefix,
            max_shard_bytes=args.max_shard_size,
            fsync=not args.no_fsync,
        )
    print(summary.line())
    print(f"wrote {args.dst}")
    return 0


def check_logits(args) -> int:
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
