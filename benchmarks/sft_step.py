"""SFTTrainer's train step against Tunix's own PeftTrainer step, same model, mesh and batch.

Usage::

    python benchmarks/sft_step.py --model qwen3-tiny --per-device-batch-size 1 \
        --seq 256 --repeats 30 [--devices 8] [--lora-rank 0] [--grad-accum 1]

Both trainers are built on the installed google-tunix (same optimizer, same
Tunix ``jit_train_and_eval_step``: jit with donation, bound with
``cached_partial`` like ``train()``); both steps run forward, loss, backward,
grad norm and the optimizer update. Differences that stay: Tunix's default loss
(one-hot x log-softmax, causal+padding mask passed as a ``[batch, seq, seq]``
input) against ours (gathered log-probs, the mask built from segment ids). Steps
take turns (one of each per repeat, each ending in ``block_until_ready``) so that
other load slows both alike; the figure is the ratio of medians. Then tokens/s of
SFTTrainer on the same batch.
"""

from __future__ import annotations

import argparse
import sys


def _args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3-tiny")
    parser.add_argument("--devices", default="8")
    parser.add_argument("--mesh", default=None, help="e.g. fsdp=4,tensor=2 (default all fsdp)")
    parser.add_argument("--per-device-batch-size", type=int, default=1)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--lora-rank", type=int, default=0)
    parser.add_argument("--grad-accum", type=int, default=1)
    return parser.parse_args(argv)


def _batches(args, batch_size: int):
    """Our packed micro-batch of the embedded data, and Tunix's view of it (tokens,
    mask, positions, and the packed causal ``[B, T, T]`` attention mask)."""
    import numpy as np

    from posttrain import tokenizer
    from posttrain.training import data, default_data, loss

    examples = data.encode_dataset(
        default_data.pydoc_conversations(), tokenizer.byte_tokenizer(), args.seq
    )
    rows = data.to_rows(examples, args.seq, packing=True)
    ours = next(data.batches(rows, batch_size, args.grad_accum))
    theirs = {k: ours[k] for k in ("input_tokens", "input_mask", "positions")}
    causal = np.tril(np.ones((args.seq, args.seq), bool))
    theirs["attention_mask"] = np.asarray(loss.packed_attention_mask(ours["segment_ids"])) & causal
    return ours, theirs


def _trainer(cls, args, mesh, **kwargs):
    """``cls`` (our SFTTrainer or Tunix's PeftTrainer) over a fresh model (LoRA if asked)."""
    import optax
    from tunix.sft import peft_trainer

    from posttrain.models import build_model, get_config

    model = build_model(get_config(args.model), mesh, seed=0)
    if args.lora_rank:
        from posttrain.lora import LoraConfig, apply_lora

        model = apply_lora(model, mesh, LoraConfig(rank=args.lora_rank, alpha=args.lora_rank))
    config = peft_trainer.TrainingConfig(
        eval_every_n_steps=10**9,
        max_steps=10**9,
        gradient_accumulation_steps=args.grad_accum if args.grad_accum > 1 else None,
    )
    return cls(model, optax.adamw(1e-4), config, **kwargs)


def main(argv=None) -> int:
    args = _args(argv)
    from _timing import fake_devices, first_and_medians

    fake_devices(args.devices)

    import jax
    from tunix.sft import peft_trainer

    from posttrain import sharding
    from posttrain.training.trainer import SFTOptions, SFTTrainer

    mesh = sharding.make_mesh(sharding.parse_mesh_spec(args.mesh) if args.mesh else None)
    batch_size = args.per_device_batch_size * sharding.data_parallel_size(mesh)
    ours_batch, tunix_batch = _batches(args, batch_size)
    with sharding.use_mesh(mesh):
        ours = _trainer(SFTTrainer, args, mesh, options=SFTOptions(mesh=mesh))
        theirs = _trainer(peft_trainer.PeftTrainer, args, mesh)
        placed = {
            "SFTTrainer": ours._prepare_inputs(ours_batch),
            "PeftTrainer": ours._prepare_inputs(tunix_batch),
        }
        steps = {
            "SFTTrainer": ours.jit_train_and_eval_step(False, True)[0],
            "PeftTrainer": theirs.jit_train_and_eval_step(False, True)[0],
        }
        runs = {n: lambda s=s, n=n: jax.block_until_ready(s(placed[n])) for n, s in steps.items()}
        compile_s, median = first_and_medians(runs, args.repeats)
    tokens = int((ours_batch["segment_ids"] > 0).sum())
    print(
        f"model {args.model}, mesh {dict((k, v) for k, v in mesh.shape.items() if v > 1)}, "
        f"batch {batch_size} x {args.seq}, lora_rank {args.lora_rank}, "
        f"grad_accum {args.grad_accum}, convention {ours.convention.name}, "
        f"{jax.device_count()} {jax.devices()[0].platform} devices"
    )
    for name in steps:
        print(
            f"  {name:12s} step {median[name] * 1e3:8.1f} ms (median of {args.repeats}), "
            f"compile {compile_s[name]:.1f} s"
        )
    ratio = median["SFTTrainer"] / median["PeftTrainer"]
    print(f"  ratio SFTTrainer / PeftTrainer step time: {ratio:.3f} (target <= 1.05)")
    print(
        f"  SFTTrainer: {tokens / median['SFTTrainer']:,.0f} tokens/s "
        f"({tokens} non-padding tokens per micro-step)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
