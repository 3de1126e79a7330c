"""A distillation step against our SFT step on the same student, mesh and batch.

Usage::

    python benchmarks/distill_step.py --student qwen3-tiny --student-layers 1 \
        --teacher llama3-tiny --per-device-batch-size 1 --seq 256 --repeats 20 \
        [--devices 8] [--teacher-dtype float32|bfloat16]

Both trainers run on the installed google-tunix with the same optimizer and Tunix's
``jit_train_and_eval_step`` (jit with donation, bound like ``train()``). One distillation
step is what ``train()`` does per batch: ``_prepare_inputs`` (the rows placed, then the
teacher forward through the strategy's ``get_teacher_outputs``) and the jitted student
step (forward, Tunix's ``LogitStrategy`` loss per target position, backward, update).
One SFT step is ``_prepare_inputs`` (placement) and the SFT step. The expected cost of
distillation is the SFT step plus one teacher forward, so the teacher forward alone is
timed as well. Turns are interleaved (SFT, distill, teacher forward, each ending in
``block_until_ready``) so that other load slows them alike; figures are medians, and the
ratios of medians are what counts.

The same run times Tunix's own models through the same trainer: ``tunix.models.qwen3``
models with the student's and teacher's shapes (both must be full-attention qwen3-family
presets: ``--teacher qwen3-tiny``, the default), Tunix's ``DistillationTrainer`` itself
(its step, its ``LogitStrategy.get_train_loss`` over every position), fed tokens and a
causal mask as its default ``gen_model_input_fn`` does. "distill / Tunix's" is the issue's
target (<= 1.0). Tunix's models are built unsharded (on one device): compare with
``--devices 1``, where both run on the same single device.
"""

from __future__ import annotations

import argparse
import sys


def _args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--student", default="qwen3-tiny")
    parser.add_argument("--student-layers", type=int, default=1)
    parser.add_argument("--teacher", default="qwen3-tiny")
    parser.add_argument("--teacher-dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--devices", default="8")
    parser.add_argument("--per-device-batch-size", type=int, default=1)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=20)
    return parser.parse_args(argv)


def _turns(args, mesh, batch, student_cfg, teacher) -> dict:
    """The timed calls: our SFT step and distillation step on the same student, the
    teacher's forward alone, and (where its model fits) Tunix's own models through the
    same trainer."""
    import optax

    from posttrain.distill import tunix_distill
    from posttrain.distill.trainer import distill_trainer_class, labels_fn, model_logits
    from posttrain.models import build_model
    from posttrain.training.trainer import SFTOptions, SFTTrainer

    strategy = tunix_distill.logit_strategy(
        model_logits,
        model_logits,
        labels_fn(teacher.config.vocab_size),
        temperature=1.0,
        alpha=0.5,
    )
    config = tunix_distill.config_class()(eval_every_n_steps=10**9, max_steps=10**9)
    options = SFTOptions(mesh=mesh)
    # host_init: a TPU compiles a large model's initialiser for minutes; the CPU's is quick
    student = build_model(student_cfg, mesh, seed=0, host_init=True)
    sft = SFTTrainer(student, optax.adamw(1e-4), config, options=options)
    distill = distill_trainer_class()(
        build_model(student_cfg, mesh, seed=0, host_init=True),
        teacher,
        strategy,
        optax.adamw(1e-4),
        config,
        options=options,
    )
    sft_step = sft.jit_train_and_eval_step(False, True)[0]
    distill_step = distill.jit_train_and_eval_step(False, True)[0]
    fields = {
        k: distill._place_rows(batch[k]) for k in ("input_tokens", "positions", "segment_ids")
    }
    turns = {
        "sft": lambda: sft_step(sft._prepare_inputs(batch)),
        "distill": lambda: distill_step(distill._prepare_inputs(batch)),
        "teacher forward": lambda: strategy.get_teacher_outputs(teacher, fields),
    }
    if _tunix_models_fit(student_cfg, teacher.config):
        turns["Tunix's distill"] = tunix_distill_turn(student_cfg, teacher.config, batch)
    return turns


def _report(median: dict, compile_s: dict) -> None:
    for name in median:
        print(f"  {name:16s} {median[name] * 1e3:8.1f} ms   (first call {compile_s[name]:.1f} s)")
    expected = median["sft"] + median["teacher forward"]
    print(f"  ratio distill / sft step: {median['distill'] / median['sft']:.3f}")
    print(
        f"  ratio distill / (sft step + teacher forward), the expected cost: "
        f"{median['distill'] / expected:.3f}"
    )
    if "Tunix's distill" in median:
        ratio = median["distill"] / median["Tunix's distill"]
        print(f"  ratio distill / Tunix's distill (the target: <= 1.0): {ratio:.3f}")


def main(argv=None) -> int:
    args = _args(argv)
    from _timing import fake_devices, first_and_medians

    fake_devices(args.devices)

    import jax

    from posttrain import sharding, tokenizer
    from posttrain.distill.trainer import cast_params, shallower
    from posttrain.models import build_model, get_config
    from posttrain.training import data, default_data

    mesh = sharding.make_mesh(None)
    batch_size = args.per_device_batch_size * sharding.data_parallel_size(mesh)
    examples = data.encode_dataset(
        default_data.pydoc_conversations(), tokenizer.byte_tokenizer(), args.seq
    )
    batch = next(data.batches(data.to_rows(examples, args.seq, packing=True), batch_size))
    student_cfg = get_config(args.student)
    if args.student_layers:
        student_cfg = shallower(student_cfg, args.student_layers)
    teacher = cast_params(
        build_model(get_config(args.teacher), mesh, seed=1, host_init=True), args.teacher_dtype
    )
    with sharding.use_mesh(mesh):
        turns = _turns(args, mesh, batch, student_cfg, teacher)
        blocking = {n: lambda t=t: jax.block_until_ready(t()) for n, t in turns.items()}
        compile_s, median = first_and_medians(blocking, args.repeats)
    print(
        f"student {args.student} ({student_cfg.num_layers} layers), teacher {args.teacher} "
        f"({teacher.config.num_layers} layers, {args.teacher_dtype}), batch {batch_size} x "
        f"{args.seq}, {jax.device_count()} {jax.devices()[0].platform} devices, "
        f"medians of {args.repeats} interleaved turns"
    )
    _report({n: median[n] for n in turns}, compile_s)
    return 0


def _tunix_models_fit(*configs) -> bool:
    """Whether Tunix's qwen3 model can take each config's shape (a qwen3-family model
    with full attention only)."""
    return all(c.family == "qwen3" and set(c.layer_types) == {"full"} for c in configs)


def tunix_distill_turn(student_cfg, teacher_cfg, batch):
    """One step of Tunix's own ``DistillationTrainer`` on Tunix's qwen3 models with our
    configs' shapes (``_tunix_models.tunix_qwen3_config``; parameter counts asserted
    equal to ours): ``_prepare_inputs`` (the teacher forward) then its jitted step."""
    import jax
    import jax.numpy as jnp
    import optax
    from _tunix_models import tunix_qwen3_config
    from flax import nnx
    from tunix.distillation import DistillationTrainer, TrainingConfig, TrainingInput
    from tunix.distillation.strategies import LogitStrategy
    from tunix.models.qwen3 import model as tunix_qwen3

    from posttrain.models import build_model

    def forward(model, input_tokens, input_mask, **_):
        seq = input_tokens.shape[1]
        positions = jnp.broadcast_to(jnp.arange(seq), input_tokens.shape)
        mask = jnp.tril(jnp.ones((seq, seq), bool))[None] & input_mask[:, None, :].astype(bool)
        logits, _ = model(input_tokens, positions, None, mask)
        return logits[:, :-1]  # [B, T-1, V]: the positions that predict a token

    def labels(input_tokens, **_):
        return jax.nn.one_hot(input_tokens[:, 1:], student_cfg.vocab_size)

    models = []
    for seed, cfg in enumerate((student_cfg, teacher_cfg)):
        model = tunix_qwen3.Qwen3(tunix_qwen3_config(cfg), rngs=nnx.Rngs(seed))
        ours = build_model(cfg, seed=seed)
        count = [
            sum(x.size for x in jax.tree.leaves(nnx.state(m, nnx.Param))) for m in (model, ours)
        ]
        assert count[0] == count[1], (cfg.family, count)
        models.append(model)
    strategy = LogitStrategy(forward, forward, labels, temperature=1.0, alpha=0.5)
    config = TrainingConfig(eval_every_n_steps=10**9, max_steps=10**9)
    trainer = DistillationTrainer(*models, strategy, optax.adamw(1e-4), config)
    step = trainer.jit_train_and_eval_step(False, True)[0]
    inputs = TrainingInput(input_tokens=batch["input_tokens"], input_mask=batch["input_mask"])
    return lambda: step(trainer._prepare_inputs(inputs))


if __name__ == "__main__":
    sys.exit(main())
