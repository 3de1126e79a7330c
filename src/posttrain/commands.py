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

from posttrain import distributed


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
    tokens = tokens.astype(np.int32)

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
        tokens = jax.make_array_from_callback(
            tokens.shape, jax.sharding.NamedSharding(mesh, spec), lambda index: tokens[index]
        )
        step = nnx.jit(forward_stats)
        t0 = time.perf_counter()
        stats = jax.block_until_ready(step(model, tokens))
        compiled = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            stats = step(model, tokens)
        stats = jax.block_until_ready(stats)
        per_step = (time.perf_counter() - t0) / args.repeats
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


def convert(args: argparse.Namespace) -> int:
    """``posttrain convert``: host files to host files. Across processes rank 0 converts
    and the others wait for it (every process reads the same directories, one writes)."""
    from posttrain import conversion

    # A failure in rank 0 reaches the others as OtherProcessFailed (exit 1).
    status = distributed.on_writer(lambda: _convert(args, conversion), "convert")
    if not distributed.is_writer():
        print(f"rank {distributed.process_index()}: rank 0 wrote {args.dst}")
        return 0
    return status


def _convert(args: argparse.Namespace, conversion) -> int:
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
        data_shards=args.data_shards,
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
    if log_every is None and distributed.is_writer():
        print(
            f"model {cfg.model}: {result.params:,} params, {result.trainable:,} trained; "
            f"global batch {result.global_batch}; Tunix convention {result.convention}"
        )
    _print_closing(result, f"checkpoint step {result.checkpoint_step} in ")
    return 0


def _print_closing(result, checkpoints: str = "checkpoints in ") -> None:
    """The closing lines of a training command, printed by the writer process only: the
    run's summary, where checkpoints and metrics are, and each directory exported."""
    if not distributed.is_writer():
        return
    print(result.summary())
    output = result.output
    print(f"{checkpoints}{output / 'checkpoints'}; metrics in {output / 'metrics.jsonl'}")
    for path in result.exported:
        print(f"wrote {path}")


def grpo_config(args: argparse.Namespace):
    """The ``GRPORunConfig`` of parsed ``posttrain grpo`` arguments (unchecked)."""
    from posttrain import sharding
    from posttrain.rl import rewards
    from posttrain.rl.run import GRPORunConfig

    def mesh(spec):
        return sharding.parse_mesh_spec(spec) if spec else None

    return GRPORunConfig(
        model=args.model,
        tokenizer=args.tokenizer,
        mesh=mesh(args.mesh),
        rollout_mesh=mesh(args.rollout_mesh),
        rollout_dtype=args.rollout_dtype,
        per_device_batch_size=args.per_device_batch_size,
        num_generations=args.num_generations,
        steps=args.steps,
        learning_rate=args.learning_rate,
        lora_rank=args.lora_rank,
        lora_alpha=args.lora_alpha,
        algorithm=args.algorithm,
        beta=args.beta,
        epsilon=args.epsilon,
        temperature=args.temperature,
        max_prompt_length=args.max_prompt_length,
        max_new_tokens=args.max_new_tokens,
        reward=tuple(args.reward) if args.reward else rewards.DEFAULT,
        warmup_steps=args.warmup_steps,
        warmup_data_shards=args.warmup_data_shards,
        eval_samples=args.eval_samples,
        seed=args.seed,
        save_every=args.save_every,
        stop_after=args.stop_after,
        output=args.output,
    )


def grpo(args: argparse.Namespace) -> int:
    from posttrain.rl.run import run_grpo

    cfg = grpo_config(args)
    cfg.check()
    result = run_grpo(cfg, log_every=None if sys.stderr.isatty() else max(1, cfg.steps // 10))
    _print_closing(result)
    return 0


def dpo_config(args: argparse.Namespace):
    """The ``DPORunConfig`` of parsed ``posttrain dpo`` arguments (unchecked)."""
    from posttrain import sharding
    from posttrain.preference.run import DPORunConfig

    return DPORunConfig(
        model=args.model,
        data=args.data,
        eval_data=args.eval_data,
        tokenizer=args.tokenizer,
        mesh=sharding.parse_mesh_spec(args.mesh) if args.mesh else None,
        per_device_batch_size=args.per_device_batch_size,
        data_shards=args.data_shards,
        grad_accum=args.grad_accum,
        steps=args.steps,
        max_prompt_length=args.max_prompt_length,
        max_response_length=args.max_response_length,
        overflow=args.overflow,
        algorithm=args.algorithm,
        beta=args.beta,
        label_smoothing=args.label_smoothing,
        lambda_orpo=args.lambda_orpo,
        learning_rate=args.learning_rate,
        warmup_steps=args.warmup_steps,
        lora_rank=args.lora_rank,
        lora_alpha=args.lora_alpha,
        remat=args.remat,
        scan_layers=args.scan,
        seed=args.seed,
        save_every=args.save_every,
        stop_after=args.stop_after,
        output=args.output,
    )


def dpo(args: argparse.Namespace) -> int:
    from posttrain.preference.run import run_dpo

    cfg = dpo_config(args)
    cfg.check()
    result = run_dpo(cfg, log_every=None if sys.stderr.isatty() else max(1, cfg.steps // 10))
    _print_closing(result)
    return 0


def newest_export(run_dir: str = "runs/sft") -> str | None:
    """The ``model-step<N>`` directory with the largest N under ``run_dir`` (``None``: none)."""
    import pathlib
    import re

    steps = [
        (int(m.group(1)), p)
        for p in pathlib.Path(run_dir).glob("model-step*")
        if (m := re.fullmatch(r"model-step(\d+)", p.name)) and p.is_dir()
    ]
    return str(max(steps)[1]) if steps else None


def _generation_tokenizer(args: argparse.Namespace, model_spec: str):
    """``--tokenizer``; else the HF directory's ``tokenizer.json``; else the tokenizer the
    ``posttrain sft`` run that exported ``model_spec`` recorded; else the embedded one."""
    import os

    from posttrain.loading import recorded_tokenizer
    from posttrain.sft.tokenizer import load_tokenizer

    if args.tokenizer:
        return load_tokenizer(args.tokenizer)
    if os.path.isfile(os.path.join(model_spec, "tokenizer.json")):
        return load_tokenizer(model_spec)
    return load_tokenizer(recorded_tokenizer(model_spec))


def _prompts(args: argparse.Namespace) -> list[dict]:
    """``[{"prompt": text} | {"messages": [...]}]`` from ``--prompt`` and ``--prompts``."""
    import json

    from posttrain.sft.data import validate_messages

    prompts = [{"prompt": text} for text in args.prompt or ()]
    if args.prompts:
        with open(args.prompts, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{args.prompts}:{number}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ValueError(f"{where}: not JSON ({error.msg})") from None
                if isinstance(record, dict) and isinstance(record.get("prompt"), str):
                    prompts.append({"prompt": record["prompt"]})
                elif isinstance(record, dict) and "messages" in record:
                    messages = record["messages"]
                    if not isinstance(messages, list) or not messages:
                        raise ValueError(f"{where}: 'messages' must be a non-empty list")
                    prompts.append({"messages": messages})
                    validate_messages({"messages": [*messages, _STUB]}, where=where)
                else:
                    raise ValueError(
                        f'{where}: expected {{"prompt": "..."}} or {{"messages": [...]}}'
                    )
    if not prompts:
        raise ValueError("no prompt: pass --prompt TEXT (repeatable) or --prompts FILE.jsonl")
    return prompts


_STUB = {"role": "assistant", "content": ""}  # validate_messages wants an assistant turn


def generate(args: argparse.Namespace) -> int:
    """``posttrain generate``: one prompt streams its text to stdout; several write JSONL
    (``--output`` or stdout), one record per prompt."""
    import json

    import numpy as np

    from posttrain import atomic, sharding
    from posttrain import generate as gen
    from posttrain.loading import load_model
    from posttrain.sft.data import chat_prompt

    spec = args.model or newest_export()
    if spec is None:
        raise ValueError(
            "no --model given and runs/sft holds no model-step<N> export; "
            "run `posttrain sft` first, or pass --model PRESET|DIR"
        )
    prompts = _prompts(args)
    mesh = sharding.make_mesh(sharding.parse_mesh_spec(args.mesh) if args.mesh else None)
    with sharding.use_mesh(mesh):
        model, _ = load_model(spec, mesh, seed=args.seed, scratch=args.output or "generate")
        if args.adapter:
            model = _with_adapter(model, mesh, args.adapter)
        tok = _generation_tokenizer(args, spec)
        if tok.get_vocab_size() > model.config.vocab_size:
            raise ValueError(
                f"tokenizer has {tok.get_vocab_size()} ids but the model's vocab_size is "
                f"{model.config.vocab_size}; pass a matching --tokenizer"
            )
        ids = []
        for p in prompts:
            if "messages" in p or args.chat:
                messages = p.get("messages") or [{"role": "user", "content": p["prompt"]}]
                ids.append(chat_prompt(messages, tok))
            else:
                ids.append(tok.encode(p["prompt"], add_special_tokens=False).ids)
        eos = tuple(
            i
            for name in ("<|im_end|>", "<|endoftext|>", "</s>")
            if (i := tok.token_to_id(name)) is not None
        )
        pad = next((i for n in ("<|pad|>", "<pad>") if (i := tok.token_to_id(n)) is not None), 0)
        sampling = gen.SamplingConfig(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            eos_ids=eos,
            pad_id=pad,
        )
        stream = None
        # One process streams; across processes the text is printed once, at the end.
        if len(ids) == 1 and not args.output and distributed.process_count() == 1:
            shown: list[int] = []
            printed = [""]

            def stream(tokens: np.ndarray, stopped: np.ndarray) -> None:
                if stopped[0] or int(tokens[0]) in eos:
                    return
                shown.append(int(tokens[0]))
                text = tok.decode(shown, skip_special_tokens=True)
                if not text.endswith("\ufffd"):  # a partial UTF-8 character waits
                    print(text[len(printed[0]) :], end="", flush=True)
                    printed[0] = text

        out = gen.generate(model, ids, sampling, cache_size=args.cache_size, on_token=stream)
    if stream is not None:
        print(flush=True)
        return 0
    if not distributed.is_writer():  # every process generated; one writes
        return 0
    if len(ids) == 1 and not args.output:
        row = out.row(0)
        print(
            tok.decode(row[:-1] if out.stop_reasons[0] == "eos" else row, skip_special_tokens=True)
        )
        return 0
    lines = []
    for i, p in enumerate(prompts):
        row = out.row(i)
        text_ids = row[:-1] if out.stop_reasons[i] == "eos" else row
        lines.append(
            json.dumps(
                {
                    **p,
                    "text": tok.decode(text_ids, skip_special_tokens=True),
                    "tokens": row,
                    "logprobs": [round(float(x), 6) for x in out.logprobs[i, : len(row)]],
                    "stop_reason": out.stop_reasons[i],
                },
                ensure_ascii=False,
            )
        )
    text = "".join(line + "\n" for line in lines)
    if args.output:
        atomic.write_text(args.output, text)
    else:
        print(text, end="")
    return 0


def _with_adapter(model, mesh, directory: str):
    """``model`` with the LoRA adapter saved in ``directory`` applied and loaded.

    Raises:
      ValueError: no adapter there, or one that does not fit the model (named).
    """
    import json
    import os

    from posttrain.lora import LoraConfig, apply_lora
    from posttrain.lora.adapters import CONFIG_FILE, load_adapter

    path = os.path.join(directory, CONFIG_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"--adapter {directory}: no {CONFIG_FILE} (not a posttrain adapter)")
    with open(path, encoding="utf-8") as f:
        saved = json.load(f)
    if (
        saved.get("family") != model.config.family
        or saved.get("num_layers") != model.config.num_layers
    ):
        raise ValueError(
            f"--adapter {directory}: made for {saved.get('family')} with "
            f"{saved.get('num_layers')} layers, the model is {model.config.family} with "
            f"{model.config.num_layers}"
        )
    lora = LoraConfig(
        rank=saved["rank"],
        alpha=saved["alpha"],
        target=saved["target"],
        weight_qtype=saved["weight_qtype"],
        tile_size=saved["tile_size"],
    )
    return load_adapter(apply_lora(model, mesh, lora), directory)
