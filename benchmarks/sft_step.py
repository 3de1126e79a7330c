"""SFTTrainer's train step against Tunix's own PeftTrainer step, same model, mesh and batch.

Usage::

    python benchmarks/sft_step.py --model qwen3-tiny --per-device-batch-size 1 \
        --seq 256 --repeats 30 [--devices 8] [--lora-rank 0] [--grad-accum 1] \
        [--scan] [--remat none|full|save_dots] [--logit-chunk default,full,512] \
        [--attention-kernel xla|splash] [--baseline our-model|tunix-qwen3]

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

``--baseline``: PeftTrainer's model. ``our-model`` (default) is ours, the same model:
the two trainers alone are compared. ``tunix-qwen3`` is Tunix's own Qwen3 in the
preset's shape, what a Tunix user trains: built and sharded by Tunix (seed 0), its
``remat_config`` the match of ``--remat`` (``full``: ``DECODER``, the whole layer
recomputed; ``none``: ``NONE``), its own splash attention (``use_flash_attention``)
under ``--attention-kernel splash``, and under ``--lora-rank`` Qwix's LoRA on the same
projections as ours (q/k/v/o and gate/up/down), applied as Tunix's examples do.
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
        "--attention-kernel",
        default="xla",
        choices=("xla", "splash"),
        help="ModelConfig.attention_kernel (and Tunix's use_flash_attention)",
    )
    parser.add_argument(
        "--baseline",
        default="our-model",
        choices=("our-model", "tunix-qwen3"),
        help="PeftTrainer's model: ours (the trainers alone) or Tunix's own Qwen3",
    )
    parser.add_argument(
        "--logit-chunk",
        type=_forms,
        default="default",
        help="our loss's forms, each against PeftTrainer: default (chunked), full (the "
        "whole batch's logits) or N positions a chunk; comma-separated, e.g. default,full,512",
    )
    args = parser.parse_args(argv)
    if args.baseline == "tunix-qwen3" and args.remat not in TUNIX_REMAT:
        parser.error(f"--remat {args.remat}: Tunix's Qwen3 has none; expected none or full")
    if args.baseline == "tunix-qwen3" and not args.model.startswith("qwen3"):
        parser.error(f"--model {args.model}: Tunix's Qwen3 takes a qwen3 or qwen3_moe preset")
    return args


#: --remat -> Tunix's Qwen3 RematConfig name (full: the whole decoder layer, as ours)
TUNIX_REMAT = {"none": "NONE", "full": "DECODER"}


def _config(args):
    from posttrain.models import get_config

    return get_config(
        args.model,
        scan_layers=args.scan,
        remat=args.remat,
        attention_kernel=args.attention_kernel,
    )


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
    """``(cls over a fresh model (LoRA if asked), the mesh its step runs under)``: ``cls``
    our SFTTrainer or Tunix's PeftTrainer; the mesh ``None`` but for Tunix's Qwen3, whose
    splash attention reads the mesh of a ``with mesh:`` block."""
    import optax
    from tunix.sft import peft_trainer

    from posttrain.models import build_model

    if cls is peft_trainer.PeftTrainer and args.baseline == "tunix-qwen3":
        model, own_mesh = _tunix_model(args)  # with Qwix's LoRA under --lora-rank
    else:
        own_mesh = None
        model = build_model(_config(args), mesh, seed=0)
        if args.lora_rank:
            from posttrain.lora import LoraConfig, apply_lora

            lora = LoraConfig(rank=args.lora_rank, alpha=args.lora_rank)
            model = apply_lora(model, mesh, lora)
    config = peft_trainer.TrainingConfig(
        eval_every_n_steps=10**9,
        max_steps=10**9,
        gradient_accumulation_steps=args.grad_accum if args.grad_accum > 1 else None,
    )
    return cls(model, optax.adamw(1e-4), config, **kwargs), own_mesh


def _tunix_model(args):
    """``(Tunix's own Qwen3 in args.model's shape, its mesh)``
    (``benchmarks/_tunix_models.py``), with Qwix's LoRA under ``--lora-rank`` (rank =
    alpha, ours), as Tunix's examples apply it."""
    from _tunix_models import place_by_annotations, tunix_qwen3
    from flax import nnx
    from tunix.models.qwen3 import model as tunix_qwen3_model

    model, mesh = tunix_qwen3(
        _config(args),
        remat_config=tunix_qwen3_model.RematConfig[TUNIX_REMAT[args.remat]],
        use_flash_attention=args.attention_kernel == "splash",
    )
    if not args.lora_rank:
        return model, mesh
    import qwix

    from posttrain import _compat

    provider = qwix.LoraProvider(
        module_path=".*(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)",
        rank=args.lora_rank,
        alpha=float(args.lora_rank),
    )
    rngs = {"rngs": nnx.Rngs(0)} if _compat.qwix_takes_rngs(qwix.apply_lora_to_model) else {}
    model = qwix.apply_lora_to_model(model, provider, **model.get_model_input(), **rngs)
    place_by_annotations(model, mesh)  # the adapters placed as the weights are
    return model, mesh


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


def _time_form(
    args, mesh, keywords, batches, theirs_step, theirs_placed
) -> tuple[dict, dict, object]:
    """``(first-call seconds, median seconds, our trainer)`` of our SFTTrainer with the loss
    form ``keywords`` (``SFTStep.loss_options``) beside Tunix's already built step."""
    import jax
    from _timing import first_and_medians

    from posttrain.training.trainer import SFTOptions, SFTTrainer

    cls = type("SFTTrainer", (SFTTrainer,), {"loss_options": keywords})
    ours, _ = _trainer(cls, args, mesh, options=SFTOptions(mesh=mesh))
    placed = {name: ours._prepare_inputs(batch) for name, batch in batches.items()}
    if "PeftTrainer" in theirs_placed:  # Tunix's Qwen3: its batch on its own mesh
        placed["PeftTrainer"] = theirs_placed["PeftTrainer"]
    steps = {"SFTTrainer": ours.jit_train_and_eval_step(False, True)[0], "PeftTrainer": theirs_step}
    runs = {n: lambda s=s, n=n: jax.block_until_ready(s(placed[n])) for n, s in steps.items()}
    compile_s, median = first_and_medians(runs, args.repeats)
    return compile_s, median, ours


def _mfu_line(ours, median: dict, positions: int) -> str:
    """Each trainer's MFU: our model's FLOPs a step (``6 N`` a position, ``4 N`` with LoRA:
    :func:`posttrain.plan.abstract.active_matmul_params`, attention's own left out, as
    docs/benchmarks.md counts them) over its median step x the chips' peak
    (:func:`posttrain.plan.chips.peak_flops`); a device with no peak in the table says so."""
    import jax

    from posttrain.plan import abstract, chips

    peak = chips.peak_flops(jax.devices()[0]) * jax.device_count()
    if peak <= 0:
        return f"  MFU: no peak FLOP/s known for {jax.devices()[0].device_kind!r}"
    n = abstract.active_matmul_params(ours.model)
    flops = 2 * n * (2 if ours._lora_enabled else 3) * positions
    rates = ", ".join(f"{name} {flops / (s * peak):.1%}" for name, s in median.items())
    return (
        f"  MFU ({2 if ours._lora_enabled else 3} x 2 N a position over {peak:.3g} FLOP/s): {rates}"
    )


def _on_own_mesh(args, theirs, theirs_step, their_mesh, tunix_batch) -> tuple:
    """``(Tunix's step, {"PeftTrainer": its placed batch} or {})``: Tunix's Qwen3 with its
    own splash traced under its own mesh and fed on it; otherwise the step as it is."""
    if their_mesh is None or args.attention_kernel != "splash":
        # without splash Tunix's Qwen3 runs as benchmarks/dpo.py runs Tunix's DPOTrainer,
        # outside any mesh block
        return theirs_step, {}
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    # Tunix's splash path reads the mesh of a `with mesh:` block (pxla.thread_resources)
    rows = NamedSharding(their_mesh, PartitionSpec("fsdp"))
    on_theirs = {k: jax.device_put(v, rows) for k, v in tunix_batch.items()}

    def step(batch, step=theirs_step):
        with their_mesh:
            return step(batch)

    return step, {"PeftTrainer": theirs._prepare_inputs(on_theirs)}


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
        theirs, their_mesh = _trainer(peft_trainer.PeftTrainer, args, mesh)
        step = theirs.jit_train_and_eval_step(False, True)[0]
        theirs_step, theirs_placed = _on_own_mesh(args, theirs, step, their_mesh, tunix_batch)
        # each loss form in turn, our trainer built for it, beside the same Tunix step
        for i, (form, keywords) in enumerate(args.logit_chunk):
            compile_s, median, ours = _time_form(
                args, mesh, keywords, batches, theirs_step, theirs_placed
            )
            if i == 0:
                print(
                    f"model {args.model}, mesh "
                    f"{dict((k, v) for k, v in mesh.shape.items() if v > 1)}, "
                    f"batch {batch_size} x {args.seq}, lora_rank {args.lora_rank}, "
                    f"grad_accum {args.grad_accum}, scan {args.scan}, remat {args.remat}, "
                    f"convention {ours.convention.name}, "
                    f"attention {args.attention_kernel}, PeftTrainer over {args.baseline}, "
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
            print(_mfu_line(ours, median, batch_size * args.seq))
            del ours
            gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
