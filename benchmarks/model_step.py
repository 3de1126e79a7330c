"""Our model's training step against Tunix's own model of the same family, same config.

Usage::

    python benchmarks/model_step.py [--family qwen3|qwen3_moe] [--repeats 15]
        [--d-model 256 --num-layers 4 --num-heads 8 --num-kv-heads 4 --head-dim 32
         --d-ff 768 --batch 8 --seq 256] [--hlo DIR] [--attention-kernel xla|splash]
        [--dtype float32|bfloat16]

One CPU device, float32 (``--dtype bfloat16``: both models' parameters and activations, as
qwen3-0.6b trains), no optimizer: forward + cross-entropy + backward (``jax.grad``
of the mean token loss), and forward only, for our ``CausalLM`` and Tunix's
``tunix.models.qwen3`` model built with equal dimensions (the parameter counts are
asserted equal). Both are called with Tunix's convention (tokens, positions, no cache, a
``[batch, seq, seq]`` causal mask), the batch passed as jit arguments as a trainer passes
it. The steps take turns, each ending in ``block_until_ready``, so that other load slows
both alike; the figures are ratios of medians. The baseline is a square matmul of the
step's model FLOPs (:func:`model_flops`) timed in the same run: "share" is the step's model
GFLOP/s as a fraction of the matmul's. Model FLOPs, not what XLA counts: the same figure
for both models whatever each skips (our causal query blocks) or repeats (Tunix's MoE runs
every expert on every token), and XLA's ``cost_analysis`` counts a scan's body once.

"ceiling" is the share the step would reach if all but its matmuls took no time: model
FLOPs over the wall time its dots occupy in a profiler trace (``harness.tools.op_profile``), the
most those matmuls, at the shapes XLA gave them, can do on this machine.

``--hlo DIR`` writes both compiled steps' HLO text and prints the op counts that differ
(transposes, converts, copies, fusions ...), the first place to look when the ratio moves;
``--ops`` lists each step's costliest ops by kind from the same profile.
"""

from __future__ import annotations

import argparse
import os
import sys

from posttrain.config import AttentionKernel, choices


def _args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", default="qwen3", choices=("qwen3", "qwen3_moe"))
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--num-heads", type=int, default=8)
    parser.add_argument("--num-kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--d-ff", type=int, default=768)
    parser.add_argument("--num-experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--devices", default="1", help="N fake CPU devices, or real (a TPU)")
    parser.add_argument("--hlo", default=None, help="directory for both steps' HLO text")
    parser.add_argument(
        "--attention-kernel",
        default="xla",
        choices=choices(AttentionKernel),
        help="our model's ModelConfig.attention_kernel (splash: a TPU; model_ab.py --form splash)",
    )
    parser.add_argument(
        "--ops", action="store_true", help="list each step's costliest ops from its profile"
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="both models' parameter and activation dtype",
    )
    return parser.parse_args(argv)


def configs(args):
    """``(ours, Tunix's)`` model configs of equal dimensions."""
    from _tunix_models import tunix_qwen3_config

    from posttrain.config import AttentionConfig, ModelConfig, MoEConfig, RopeConfig

    attn = AttentionConfig(
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        rope=RopeConfig(theta=1_000_000.0),
        qk_norm=True,
    )
    moe = args.family == "qwen3_moe"
    ours = ModelConfig(
        family=args.family,
        vocab_size=args.vocab_size,
        d_model=args.d_model,
        num_layers=args.num_layers,
        d_ff=args.d_ff,
        attention={"full": attn},
        norm_eps=1e-6,
        tie_word_embeddings=not moe,
        attention_kernel=args.attention_kernel,
        dtype=args.dtype,
        param_dtype=args.dtype,
        **(
            {
                "moe": MoEConfig(
                    num_experts=args.num_experts,
                    top_k=args.top_k,
                    moe_d_ff=args.d_ff,
                    aux_loss_weight=0.0,
                )
            }
            if moe
            else {}
        ),
    )
    return ours, tunix_qwen3_config(ours)


def model_flops(cfg, batch: int, seq: int) -> float:
    """FLOPs of one forward + backward over ``batch x seq`` tokens: ``6 N D + 12 L H Q T D``
    (PaLM, Chowdhery et al. 2022, appendix B), N the matmul parameters a token passes
    (attention projections, the dense MLP or its ``top_k`` experts and the router, the
    output head), D = batch x seq tokens, L layers, H heads, Q head_dim, T = seq (the full
    score square, as the formula counts it)."""
    (attn,) = cfg.attention.values()
    d, heads, kv, q = cfg.d_model, attn.num_heads, attn.num_kv_heads, attn.head_dim
    per_layer = 2 * d * heads * q + 2 * d * kv * q  # q and o, k and v
    if cfg.moe is None:
        per_layer += 3 * d * cfg.d_ff
    else:
        per_layer += cfg.moe.top_k * 3 * d * cfg.moe.moe_d_ff + d * cfg.moe.num_experts
    n = cfg.num_layers * per_layer + cfg.vocab_size * d
    tokens = batch * seq
    return 6 * n * tokens + 12 * cfg.num_layers * heads * q * seq * tokens


def _count(model) -> int:
    import jax
    from flax import nnx

    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def steps(model, tokens, positions, mask):
    """``(train step, forward, compiled step)`` jitted over ``model``'s parameters and the
    batch (arguments, as a trainer passes them, not constants XLA could fold): the mean
    next-token cross-entropy's gradient, and the logits."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    graph, params, rest = nnx.split(model, nnx.Param, ...)
    batch = (tokens, positions, mask)

    def logits(p, tokens, positions, mask):
        return nnx.merge(graph, p, rest)(tokens, positions, None, mask)[0]

    def loss(p, tokens, positions, mask):
        logp = jax.nn.log_softmax(logits(p, tokens, positions, mask)[:, :-1].astype(jnp.float32))
        return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()

    grad, forward = jax.jit(jax.grad(loss)), jax.jit(logits)
    compiled = grad.lower(params, *batch).compile()
    return (lambda: grad(params, *batch)), (lambda: forward(params, *batch)), compiled


def _interleaved(fns: dict, repeats: int) -> dict:
    """Median seconds of each of ``fns`` (each blocked on its result), taking turns."""
    from _timing import interleaved_medians

    return interleaved_medians(
        {name: (lambda fn=fn: jax_block(fn())) for name, fn in fns.items()}, repeats
    )


def jax_block(x):
    import jax

    return jax.block_until_ready(x)


def _report(args, times: dict, n: int, flops: float, params: int) -> None:
    """Prints the medians, the ratios ours/Tunix, the shares of the matmul's GFLOP/s and
    their ceilings (``times["ours_dots"]``, ``times["tunix_dots"]``: seconds in matmuls)."""
    import jax

    mm_rate = 2 * n**3 / times["matmul"]
    device = jax.devices()[0].device_kind
    print(
        f"{args.family}: {params:,} parameters, batch {args.batch} x {args.seq}, 1 {device}, "
        f"{args.dtype}"
    )
    for label, a, b in (("step (fwd+bwd)", "ours", "tunix"), ("forward", "ours_fwd", "tunix_fwd")):
        ms_a, ms_b = times[a] * 1e3, times[b] * 1e3
        print(
            f"  {label:15s} ours {ms_a:.1f} ms, Tunix {ms_b:.1f} ms, ours/Tunix {ms_a / ms_b:.3f}"
        )
    print(
        f"  share of the equal-FLOP matmul's GFLOP/s ({flops / 1e9:.1f} model GFLOP; "
        f"{n}^3: {mm_rate / 1e9:.1f} GFLOP/s): "
        f"ours {flops / times['ours'] / mm_rate:.0%}, Tunix {flops / times['tunix'] / mm_rate:.0%}"
    )
    if "ours_dots" not in times or "tunix_dots" not in times:
        return
    dots = {name: times[f"{name}_dots"] for name in ("ours", "tunix")}
    print(
        f"  in matmuls (profile): ours {dots['ours'] * 1e3:.1f} ms "
        f"({dots['ours'] / times['ours']:.0%} of its step), Tunix {dots['tunix'] * 1e3:.1f} ms "
        f"({dots['tunix'] / times['tunix']:.0%}); the share's ceiling, matmuls alone: "
        f"ours {flops / dots['ours'] / mm_rate:.0%}, Tunix {flops / dots['tunix'] / mm_rate:.0%}"
    )


def write_hlo(directory: str, family: str, executables: dict) -> None:
    """Writes each compiled step's HLO text to ``directory`` and prints the op counts that
    differ between them (``executables``: ``{"ours": ..., "tunix": ...}``)."""
    from harness.tools.op_profile import opcodes

    os.makedirs(directory, exist_ok=True)
    counts = {}
    for name, exe in executables.items():
        text = exe.as_text()
        with open(os.path.join(directory, f"{family}-{name}.hlo.txt"), "w") as f:
            f.write(text)
        counts[name] = opcodes(text)
    print("  HLO ops that differ (ours, Tunix):")
    for op in sorted(set(counts["ours"]) | set(counts["tunix"])):
        if counts["ours"][op] != counts["tunix"][op]:
            print(f"    {op:24s} {counts['ours'][op]:6d} {counts['tunix'][op]:6d}")


def main(argv=None) -> int:
    args = _args(argv)
    from _timing import fake_devices

    fake_devices(args.devices)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from tunix.models.qwen3 import model as tunix_qwen3

    from posttrain.models import build_model

    ours_cfg, theirs_cfg = configs(args)
    ours = build_model(ours_cfg, seed=0)
    theirs = tunix_qwen3.Qwen3(theirs_cfg, rngs=nnx.Rngs(0))
    n_ours, n_theirs = _count(ours), _count(theirs)
    if n_ours != n_theirs:
        print(f"parameter counts differ: ours {n_ours}, Tunix {n_theirs}", file=sys.stderr)
        return 1
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, args.vocab_size, (args.batch, args.seq)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(args.seq, dtype=jnp.int32), tokens.shape)
    mask = jnp.broadcast_to(
        jnp.tril(jnp.ones((args.seq, args.seq), bool)), (args.batch, args.seq, args.seq)
    )
    ours_step, ours_fwd, ours_exe = steps(ours, tokens, positions, mask)
    theirs_step, theirs_fwd, theirs_exe = steps(theirs, tokens, positions, mask)
    flops = model_flops(ours_cfg, args.batch, args.seq)
    n = max(64, int(round((flops / 2) ** (1 / 3) / 64)) * 64)  # an n^3 matmul of ~ the step's FLOPs
    a = jnp.asarray(rng.standard_normal((n, n)), args.dtype)  # the models' dtype
    matmul = jax.jit(lambda x: x @ x)
    times = _interleaved(
        {
            "ours": ours_step,
            "tunix": theirs_step,
            "ours_fwd": ours_fwd,
            "tunix_fwd": theirs_fwd,
            "matmul": lambda: matmul(a),
        },
        args.repeats,
    )
    from harness.tools.op_profile import dot_seconds, profile, top_ops

    profiles = {}
    for name, step, exe in (("ours", ours_step, ours_exe), ("tunix", theirs_step, theirs_exe)):
        profiles[name] = profile(lambda step=step: jax_block(step()), calls=3)
        try:
            times[f"{name}_dots"] = dot_seconds(exe.as_text(), profiles[name])
        except RuntimeError as e:  # a backend whose trace names its ops otherwise (a TPU's)
            print(f"  {name}: no matmul time from the profile on {jax.default_backend()}: {e}")
    _report(args, times, n, flops, n_ours)
    if args.ops:
        for name, measured in profiles.items():
            listed = ", ".join(f"{kind} {s * 1e3:.0f}" for kind, s in top_ops(measured, 8))
            print(f"  costliest ops, {name} (ms per step): {listed}")
    if args.hlo:
        write_hlo(args.hlo, args.family, {"ours": ours_exe, "tunix": theirs_exe})
    return 0


if __name__ == "__main__":
    sys.exit(main())
