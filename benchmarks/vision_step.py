"""The vision SFT step against the text-only SFT step at the same token count.

Usage::

    python benchmarks/vision_step.py [--seq 160] [--repeats 20] [--devices 8] [--train-tower]

Both are ``SFTTrainer`` steps (forward, loss, backward, grad norm, AdamW update) on one
batch of the embedded drawings (one conversation per row, ``--seq`` tokens, the global
batch of the mesh): the vision step on ``gemma4-vision-tiny`` with the images (64 soft
tokens each, 256 patches through the tower), its tower frozen as ``posttrain sft
--vision`` freezes it (``--train-tower``: trained); the text step on ``gemma4-tiny`` (the
same text model) with the same tokens, image tokens as ordinary tokens, no images. Steps
take turns (each ending in ``block_until_ready``) so that other load slows both alike;
the figure is the ratio of medians.
"""

from __future__ import annotations

import argparse
import tempfile


def batches(seq: int, rows: int):
    """``(vision batch, text batch)``: ``rows`` drawings' rows, the text one without images
    and with every image token replaced by an ordinary one."""
    from posttrain import chat
    from posttrain.families.gemma4_vision import vision_tiny
    from posttrain.tokenizer import byte_tokenizer
    from posttrain.vision import default_data as vision_default_data
    from posttrain.vision import run as vision_run
    from posttrain.vision.data import encode_vision_chats, read_vision_jsonl
    from posttrain.vision.rows import vision_rows, with_images

    vision, tok = vision_tiny(), byte_tokenizer()
    processing = vision_run.image_processing("gemma4-vision-tiny", vision)
    with tempfile.TemporaryDirectory() as tmp:
        path = vision_default_data.write_dataset(tmp, rows, seed=0)
        chats = read_vision_jsonl(path, vision_run.placeholder_of(tok, vision), processing)
        examples = encode_vision_chats(chats, tok, chat.chatml(), processing, vision)
    built = vision_rows(examples, seq, 1, pad_id=0)
    (with_image,) = with_images([built], "images")
    text = {k: v for k, v in with_image.items() if k != "images"}
    tokens = text["input_tokens"]
    text["input_tokens"] = tokens.copy()
    text["input_tokens"][tokens >= vision.image_token_id - 1] = 40  # boi, image, eoi
    return with_image, text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", default="8")
    parser.add_argument("--seq", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--train-tower", action="store_true")
    args = parser.parse_args(argv)
    from _timing import fake_devices, first_and_medians

    fake_devices(args.devices)

    import jax
    import optax
    from tunix.sft import peft_trainer

    from posttrain import sharding
    from posttrain.models import build_model, get_config
    from posttrain.training.trainer import SFTOptions, SFTTrainer
    from posttrain.vision.run import frozen_filter

    mesh = sharding.make_mesh(None)
    vision_batch, text_batch = batches(args.seq, sharding.data_parallel_size(mesh))

    def make(name, frozen):
        model = build_model(get_config(name), mesh, seed=0)
        config = peft_trainer.TrainingConfig(eval_every_n_steps=10**9, max_steps=10**9)
        options = SFTOptions(mesh=mesh, frozen=frozen)
        return SFTTrainer(model, optax.adamw(1e-4), config, options=options)

    with sharding.use_mesh(mesh):
        trainers = {
            "vision": make("gemma4-vision-tiny", frozen_filter(args.train_tower)),
            "text": make("gemma4-tiny", None),
        }
        placed = {
            "vision": trainers["vision"]._prepare_inputs(vision_batch),
            "text": trainers["text"]._prepare_inputs(text_batch),
        }
        steps = {n: t.jit_train_and_eval_step(False, True)[0] for n, t in trainers.items()}
        runs = {n: lambda s=s, n=n: jax.block_until_ready(s(placed[n])) for n, s in steps.items()}
        compile_s, median = first_and_medians(runs, args.repeats)
    tokens = int((text_batch["segment_ids"] > 0).sum())
    rows = len(text_batch["input_tokens"])
    print(
        f"batch {rows} x {args.seq} ({tokens} tokens, each row one 64 x 64 drawing: 256 "
        f"patches, 64 soft tokens), tower {'trained' if args.train_tower else 'frozen'}, "
        f"{jax.device_count()} {jax.devices()[0].platform} devices"
    )
    for name in steps:
        print(
            f"  {name:6s} step {median[name] * 1e3:8.1f} ms (median of {args.repeats}), "
            f"compile {compile_s[name]:.1f} s, {tokens / median[name]:,.0f} tokens/s"
        )
    print(f"  ratio vision / text-only step time: {median['vision'] / median['text']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
