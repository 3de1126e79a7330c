"""One DPO step: ours against our SFT step on the same model and rows, and against Tunix's
own DPOTrainer over Tunix's Qwen3 model of the same size, in the same run.

Usage::

    python benchmarks/dpo.py [--pairs-per-device 1] [--prompt 96] [--response 160] \
        [--repeats 15] [--model qwen3-tiny] [--num-layers N] [--devices 8]

A DPO step is ``DPOTrainer._prepare_inputs`` (stacks chosen and rejected into one
``[2 x pairs, prompt + response]`` batch and runs the reference forward) plus the jitted
train step (forward and backward of both completions, the optimizer update). Expected
cost against an SFT step on the pairs' chosen rows (prompt + response tokens, one
forward and backward): with a backward at about twice a forward, 2 x (1 + 2) + 2
(reference) = 8 forwards against 3, i.e. about 2.7x.

All models are ``--model``'s shape (default qwen3-tiny: 2 layers, d_model 72, 8 heads, 4 kv
heads, head_dim 10, d_ff 88, tied embeddings, vocab 264; ``--num-layers`` keeps the first
N layers, e.g. qwen3-0.6b's 4 for a chip, where two trainers of the 28-layer model with
their references do not fit one v5e), in its dtypes, full fine-tuning with AdamW, on 8
fake CPU devices or ``--devices real`` (ours: every device on ``fsdp``; Tunix's: its own
``("fsdp", "tp")`` axes, N x 1), on the embedded preference pairs. Steps take turns, one
of each per repeat; the first call of each compiles and is excluded. Printed: medians in
ms and the ratios (target for ours / Tunix's: <= 1.0).
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3-tiny", help="a qwen3 preset")
    parser.add_argument("--num-layers", type=int, default=None, help="its first N layers")
    parser.add_argument("--pairs-per-device", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=96)
    parser.add_argument("--response", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--devices", default="8", help="N fake CPU devices, or real (a TPU)")
    args = parser.parse_args(argv)
    from _timing import fake_devices

    fake_devices(args.devices)

    import jax
    from _timing import interleaved_medians
    from jax.sharding import NamedSharding, PartitionSpec

    from posttrain import sharding
    from posttrain.models import get_config

    cfg = get_config(args.model)
    if args.num_layers is not None:
        from posttrain.plan.abstract import with_depth

        cfg = with_depth(cfg, args.num_layers)
    mesh = sharding.make_mesh(None)
    pairs = args.pairs_per_device * sharding.data_parallel_size(mesh)
    batch = _pairs(args, pairs)
    sft_rows = _sft_rows(batch, args.prompt + args.response)
    ours, sft, theirs, theirs_mesh = _trainers(cfg, mesh)
    batch_sharding = NamedSharding(theirs_mesh, PartitionSpec("fsdp"))

    def step_of(trainer, raw, place):
        step = trainer.jit_train_and_eval_step(False, True)[0]
        return lambda: jax.block_until_ready(step(trainer._prepare_inputs(place(raw))))

    runs = {
        "DPO (ours)": step_of(ours, batch, dict),
        "DPO (Tunix Qwen3)": step_of(
            theirs, batch, lambda b: {k: jax.device_put(v, batch_sharding) for k, v in b.items()}
        ),
        "SFT (ours, chosen rows)": step_of(sft, sft_rows, dict),
    }
    with sharding.use_mesh(mesh, jax_context=False):
        median = {k: s * 1e3 for k, s in interleaved_medians(runs, args.repeats).items()}
    _report(args, cfg, batch, median, pairs, ours.convention.name)
    return 0


def _pairs(args, pairs: int) -> dict:
    """The first ``pairs`` embedded preference pairs, encoded (``posttrain.preference.data``)."""
    from posttrain.preference import data
    from posttrain.preference.default_data import pydoc_pairs
    from posttrain.tokenizer import byte_tokenizer

    train, _ = pydoc_pairs()
    encoded = data.encode_pairs(
        train, byte_tokenizer(), max_prompt_length=args.prompt, max_response_length=args.response
    )
    return {k: v[:pairs] for k, v in encoded.items()}


def _sft_rows(batch: dict, seq: int) -> dict:
    """SFT rows of the pairs: each prompt + chosen, left-aligned, the chosen tokens as
    targets (``[pairs, seq]`` int32 each)."""
    import numpy as np

    pairs = len(batch["prompt_ids"])
    rows = {
        k: np.zeros((pairs, seq), np.int32)
        for k in ("input_tokens", "input_mask", "segment_ids", "positions")
    }
    for i in range(pairs):
        p = batch["prompt_ids"][i][batch["prompt_mask"][i] > 0]
        c = batch["chosen_ids"][i][batch["chosen_mask"][i] > 0]
        ids = np.concatenate([p, c])
        rows["input_tokens"][i, : len(ids)] = ids
        rows["input_mask"][i, len(p) : len(ids)] = 1
        rows["segment_ids"][i, : len(ids)] = 1
        rows["positions"][i, : len(ids)] = np.arange(len(ids))
    return rows


def _trainers(cfg, mesh):
    """``(our DPOTrainer, our SFTTrainer, Tunix's DPOTrainer over its Qwen3, Tunix's
    mesh)``, full fine-tuning with AdamW."""
    import optax
    from _tunix_models import tunix_qwen3
    from tunix.sft import peft_trainer

    from posttrain import sharding
    from posttrain.models import build_model
    from posttrain.preference import tunix_dpo
    from posttrain.preference.trainer import DPOTrainer
    from posttrain.training.policy import TunixPolicy, reference_of
    from posttrain.training.trainer import SFTOptions, SFTTrainer

    peft = {"eval_every_n_steps": 10**9, "max_steps": 10**9}

    def dpo_config():
        return tunix_dpo.training_config(
            algorithm="dpo",
            beta=0.1,
            label_smoothing=0.0,
            lambda_orpo=0.1,
            data_sharding_axis=("fsdp",),
            **peft,
        )

    with sharding.use_mesh(mesh):
        # host_init: a TPU compiles a large model's initialiser for minutes; the CPU's is quick
        policy = TunixPolicy(build_model(cfg, mesh, seed=0, host_init=True))
        options = SFTOptions(mesh=mesh)
        ours = DPOTrainer(
            policy, reference_of(policy), optax.adamw(1e-4), dpo_config(), options=options
        )
        sft = SFTTrainer(
            build_model(cfg, mesh, seed=0, host_init=True),
            optax.adamw(1e-4),
            peft_trainer.TrainingConfig(**peft),
            options=options,
        )
    (their_policy, theirs_mesh), (their_reference, _) = tunix_qwen3(cfg), tunix_qwen3(cfg)
    theirs = tunix_dpo.trainer_class()(
        their_policy, their_reference, optax.adamw(1e-4), dpo_config()
    )
    return ours, sft, theirs, theirs_mesh


def _report(args, cfg, batch: dict, median: dict, pairs: int, convention: str) -> None:
    import jax

    tokens = int(
        2 * batch["prompt_mask"].sum() + batch["chosen_mask"].sum() + batch["rejected_mask"].sum()
    )
    print(
        f"DPO step, {args.model} shape ({cfg.num_layers} layers, {cfg.param_dtype}), {pairs} "
        f"pairs x (prompt {args.prompt} + response "
        f"{args.response}), full fine-tuning, {jax.device_count()} "
        f"{jax.devices()[0].platform} devices, convention {convention}; medians of {args.repeats}"
    )
    for name, ms in median.items():
        print(f"  {name:<26}{ms:>9.1f} ms")
    print(
        f"  ours / Tunix's DPO step: {median['DPO (ours)'] / median['DPO (Tunix Qwen3)']:.2f} "
        "(target <= 1.0)"
    )
    print(
        f"  our DPO / our SFT step: {median['DPO (ours)'] / median['SFT (ours, chosen rows)']:.2f} "
        "(expected about 2.7: chosen + rejected + reference)"
    )
    print(f"  our DPO: {tokens / median['DPO (ours)'] * 1e3:,.0f} tokens/s ({tokens} per step)")


if __name__ == "__main__":
    sys.exit(main())
