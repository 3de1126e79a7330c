"""SFTTrainer's train step against Tunix's own PeftTrainer step, same model, mesh and batch.

Usage::

    python benchmarks/sft_step.py --model qwen3-tiny --per-device-batch-size 1 \
        --seq 256 --repeats 30 [--devices 8] [--lora-rank 0] [--grad-accum 1] \
        [--scan] [--remat none|full|save_dots] [--logit-chunk default,full,512]

Both trainers are built on the installed google-tunix (same optimizer, same
Tunix ``jit_train_and_eval_step``: jit with donation, bound with
``cached_partial`` like ``train()``); both steps run forward, loss, backward,
grad norm and the optimizer update. Differences that stay: Tunix's default loss
(one-hot x log-softmax, causal+padding mask passed as a ``[batch, seq, seq]``
input) against ours (gathered log-probs, the mask built from segment ids). Steps
take turns (one of each per repeat, each ending in ``block_until_ready``) so that
other load slows both alike; the figure is the ratio of medians. Then tokens/s of
SFTTrainer on the same batch. ``--logit-chunk`` lists forms of our loss
(``SFTStep.loss_options``: the chunked NLL's default, the full logits, or N positions a
chunk), each built in turn and timed against the same PeftTrainer.
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
    parser.add_argument(
        "--scan", action="store_true", help="scan the layers (ModelConfig.scan_layers)"
    )
    parser.add_argument(
        "--remat", default="none", choices=("none", "full", "save_dots"), help="ModelConfig.remat"
    )
    parser.add_argument(
        "--logit-chunk",
        type=_forms,
        default="default",
        help="our loss's forms, each against PeftTrainer: default (chunked), full (the "
        "whole batch's logits) or N positions a chunk; comma-separated, e.g. default,full,512",
    )
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

    model = build_model(
        get_config(args.model, scan_layers=args.scan, remat=args.remat), mesh, seed=0
    )
    if args.lora_rank:
        from posttrain.lora import LoraConfig, apply_lora

        model = apply_lora(model, mesh, LoraConfig(rank=args.lora_rank, alpha=args.lora_rank))
    config = peft_trainer.TrainingConfig(
        eval_every_n_steps=10**9,
        max_steps=10**9,
        gradient_accumulation_steps=args.grad_accum if args.grad_accum > 1 else None,
    )
    return cls(model, optax.adamw(1e-4), config, **kwargs)


def _forms(text: str) -> list[tuple[str, dict]]:
    """``--logit-chunk``'s forms of our loss: ``(name, sft_terms keywords)`` each."""
    forms = []
    for name in text.split(","):
        if name == "default":
            forms.append((name, {}))
        elif name == "full":
            forms.append((name, {"chunked": False}))
        elif name.isdigit() and int(name) > 0:
            forms.append((name, {"logit_chunk": int(name)}))
        else:
            raise argparse.ArgumentTypeError(
                f"{name!r}: expected default, full or a positive number of positions, "
                "comma-separated"
            )
    return forms


def _time_form(args, mesh, keywords, batches, theirs_step) -> tuple[dict, dict, object]:
    """``(first-call seconds, median seconds, our trainer)`` of our SFTTrainer with the loss
    form ``keywords`` (``SFTStep.loss_options``) beside Tunix's already built step."""
    import jax
    from _timing import first_and_medians

    from posttrain.training.trainer import SFTOptions, SFTTrainer

    cls = type("SFTTrainer", (SFTTrainer,), {"loss_options": keywords})
    ours = _trainer(cls, args, mesh, options=SFTOptions(mesh=mesh))
    placed = {name: ours._prepare_inputs(batch) for name, batch in batches.items()}
    steps = {"SFTTrainer": ours.jit_train_and_eval_step(False, True)[0], "PeftTrainer": theirs_step}
    runs = {n: lambda s=s, n=n: jax.block_until_ready(s(placed[n])) for n, s in steps.items()}
    compile_s, median = first_and_medians(runs, args.repeats)
    return compile_s, median, ours


def main(argv=None) -> int:
    args = _args(argv)
    from _timing import fake_devices

    fake_devices(args.devices)

    import gc

    import jax
    from tunix.sft import peft_trainer

    from posttrain import sharding

    mesh = sharding.make_mesh(sharding.parse_mesh_spec(args.mesh) if args.mesh else None)
    batch_size = args.per_device_batch_size * sharding.data_parallel_size(mesh)
    ours_batch, tunix_batch = _batches(args, batch_size)
    batches = {"SFTTrainer": ours_batch, "PeftTrainer": tunix_batch}
    tokens = int((ours_batch["segment_ids"] > 0).sum())
    with sharding.use_mesh(mesh):
        theirs = _trainer(peft_trainer.PeftTrainer, args, mesh)
        theirs_step = theirs.jit_train_and_eval_step(False, True)[0]
        # each loss form in turn, our trainer built for it, beside the same Tunix step
        for i, (form, keywords) in enumerate(args.logit_chunk):
            compile_s, median, ours = _time_form(args, mesh, keywords, batches, theirs_step)
            if i == 0:
                print(
                    f"model {args.model}, mesh "
                    f"{dict((k, v) for k, v in mesh.shape.items() if v > 1)}, "
                    f"batch {batch_size} x {args.seq}, lora_rank {args.lora_rank}, "
                    f"grad_accum {args.grad_accum}, scan {args.scan}, remat {args.remat}, "
                    f"convention {ours.convention.name}, "
                    f"{jax.device_count()} {jax.devices()[0].platform} devices"
                )
            print(f" our loss: {form} (--logit-chunk)")
            tunix = f"compile {compile_s['PeftTrainer']:.1f} s" if i == 0 else "(compiled above)"
            for name, when in (
                ("SFTTrainer", f"compile {compile_s['SFTTrainer']:.1f} s"),
                ("PeftTrainer", tunix),
            ):
                ms = median[name] * 1e3
                print(f"  {name:12s} step {ms:8.1f} ms (median of {args.repeats}), {when}")
            ratio = median["SFTTrainer"] / median["PeftTrainer"]
            print(f"  ratio SFTTrainer / PeftTrainer step time: {ratio:.3f} (target <= 0.95)")
            print(
                f"  SFTTrainer: {tokens / median['SFTTrainer']:,.0f} tokens/s "
                f"({tokens} non-padding tokens per micro-step)"
            )
            del ours
            gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
