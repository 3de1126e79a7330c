"""The SFT loss's gradient through the chunked NLL against the full logits', same model and
batch, in the same run (``posttrain.training.chunked_loss``, issue 55).

Usage::

    python benchmarks/chunked_loss.py [--vocab-size 65536] [--batch 2] [--seq 1024] \
        [--chunk 256] [--repeats 10] [--lora] [--devices 1]

The model is qwen3-tiny's decoder (2 layers, d_model 72) with a ``--vocab-size`` head of its
own (untied), in float32, so that the head's matmuls are most of the work: the figure is
about the loss, not the layers. Each variant is one jitted ``jax.value_and_grad`` of
``loss.sft_terms(...)["nll_sum"]`` over the trained parameters (all of them, or with
``--lora`` rank-8 adapters on the attention and the head frozen). Variants take turns, one of
each per repeat; the first call of each compiles and is excluded.

Printed: each variant's median, the ratio chunked / full logits, and how many matmuls with a
vocabulary-sized operand the differentiated loss holds (the full logits: 3 trained, 2
frozen; the chunked loss before its gradients moved into the forward: one more).
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab-size", type=int, default=65536)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=256, help="positions per chunk")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--lora", action="store_true", help="adapters on q_proj, head frozen")
    parser.add_argument("--devices", default="1", help="N fake CPU devices, or real (a TPU)")
    args = parser.parse_args(argv)
    from _timing import fake_devices

    fake_devices(args.devices)

    import jax
    from _timing import first_and_medians
    from flax import nnx

    from posttrain.training import chunked_loss, loss

    cfg, model, trained, batch = _model_and_batch(args)
    graphdef, params, rest = nnx.split(model, trained, ...)

    def step_of(**options):
        def nll(params, rest, batch):
            merged = nnx.merge(graphdef, params, rest)
            return loss.sft_terms(merged, **batch, **options)["nll_sum"]

        grad = jax.value_and_grad(nll)
        step = jax.jit(grad)
        jaxpr = jax.make_jaxpr(grad)(params, rest, batch).jaxpr
        matmuls = chunked_loss.vocab_matmuls(jaxpr, cfg.vocab_size)
        return (lambda: jax.block_until_ready(step(params, rest, batch))), matmuls

    chunked, chunked_matmuls = step_of(logit_chunk=args.chunk)
    full, full_matmuls = step_of(chunked=False)
    compile_s, median = first_and_medians({"chunked": chunked, "full": full}, args.repeats)
    print(
        f"SFT loss gradient, qwen3-tiny layers, vocab {cfg.vocab_size:,} (untied), batch "
        f"{args.batch} x {args.seq}, chunks of {args.chunk}, "
        f"{'LoRA (head frozen)' if args.lora else 'full fine-tuning'}, float32, "
        f"{jax.devices()[0].platform}; medians of {args.repeats}"
    )
    for name, matmuls in (("chunked", chunked_matmuls), ("full", full_matmuls)):
        print(
            f"  {name:8s} {median[name] * 1e3:9.1f} ms  (compile {compile_s[name]:.1f} s; "
            f"{matmuls} vocabulary matmuls)"
        )
    print(f"  ratio chunked / full logits: {median['chunked'] / median['full']:.3f}")
    return 0


def _model_and_batch(args):
    """``(config, model, the trained variables' filter, a batch)``: qwen3-tiny's layers under
    an untied ``--vocab-size`` head (LoRA on ``q_proj`` with ``--lora``), and random token
    rows with every position a target."""
    import jax
    import numpy as np
    from flax import nnx

    from posttrain import sharding
    from posttrain.lora import LoraConfig, apply_lora
    from posttrain.models import build_model, get_config

    cfg = get_config("qwen3-tiny", vocab_size=args.vocab_size, tie_word_embeddings=False)
    mesh = sharding.make_mesh({"fsdp": 1}, devices=jax.devices()[:1])
    model = build_model(cfg, mesh, seed=0)
    trained = nnx.Param
    if args.lora:
        model = apply_lora(model, mesh, LoraConfig(rank=8, alpha=16.0, target=r".*/q_proj"))
        trained = nnx.LoRAParam
    rng = np.random.default_rng(0)
    shape = (args.batch, args.seq)
    batch = {
        "input_tokens": rng.integers(1, cfg.vocab_size, shape).astype(np.int32),
        "input_mask": np.ones(shape, bool),
        "positions": np.broadcast_to(np.arange(args.seq, dtype=np.int32), shape).copy(),
        "segment_ids": np.ones(shape, np.int32),
    }
    return cfg, model, trained, batch


if __name__ == "__main__":
    sys.exit(main())
