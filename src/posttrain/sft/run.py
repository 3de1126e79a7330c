"""One SFT run end to end: model + tokenizer + data + mesh -> ``SFTTrainer`` -> outputs.

``run_sft(SFTConfig())`` is what ``posttrain sft`` does with no arguments:
``qwen3-tiny`` on the embedded ``pydoc_data`` Q/A set and the embedded byte
tokenizer, on every device on ``fsdp``.

Output directory (``SFTConfig.output``)::

    checkpoints/      Tunix CheckpointManager (Orbax): params (LoRA only when LoRA is on)
                      and optimizer state, every ``save_every`` steps and at the end;
                      a rerun with the same output and the same training settings
                      resumes from the latest step (another setting is refused)
    run.json          settings and one record per start or resume (``run_record``)
    metrics.jsonl     one record per optimizer step, each step once across resumes
    tensorboard/      Tunix's MetricsLogger (loss, perplexity, grad_norm, learning_rate)
    model-step<N>/    native safetensors of the final weights (LoRA merged) ...
    adapter-step<N>/  ... and the adapters alone, when LoRA is on
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib

import numpy as np

from posttrain import distributed, sharding
from posttrain.config import RematPolicy, choices
from posttrain.sft import run_record


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTConfig:
    """Everything one run needs; defaults are the embedded run.

    Attributes:
      model: preset name (``posttrain.models.PRESETS``), an HF checkpoint directory or a
        native one (``posttrain convert --to native``).
      data: chat JSONL file; None for the embedded ``pydoc_data`` set.
      tokenizer: ``tokenizer.json`` (or a directory holding one); None for the HF
        directory's own, else the embedded byte tokenizer.
      mesh: axis sizes (``{"fsdp": 4, "tensor": 2}``); None puts every device on fsdp.
      per_device_batch_size: rows per data-parallel shard; global batch = this x
        the data-parallel product of the mesh (MaxText's convention).
      grad_accum: micro-batches per optimizer step.
      steps: optimizer steps (``TrainingConfig.max_steps``).
      max_target_length: tokens per row.
      packing: pack several conversations per row (else one per row, padded).
      data_shards: split the conversations into this many interleaved shards, each
        packed and shuffled on its own (:func:`posttrain.sft.data.sharded_batches`);
        each process tokenises only the shards of its own rows of every global batch.
        None: a resumed run's count, else one shard per distinct slice of the batch
        across processes (1 in one process: the unsharded order). The same value gives
        the same batches on any number of processes whose rows are whole shards (the
        count a multiple of the processes' slices of the batch).
      overflow: ``truncate`` or ``reject`` conversations longer than a row.
      learning_rate, warmup_steps: peak of a linear-warmup cosine schedule (to 10%).
      lora_rank, lora_alpha: LoRA on the attention and MLP projections when rank > 0
        (alpha defaults to 2 x rank).
      remat, scan_layers: decoder options (``none``/``full``/``save_dots``).
      seed: model init, adapter init and data order.
      save_every: checkpoint interval in steps.
      sync_saves: each checkpoint is complete on disk before the next step starts
        (Orbax ``enable_async_checkpointing=False``); by default Orbax saves in the
        background, so a kill can lose the steps since the last completed save.
      replica_parallel_saves: how Orbax writes arrays replicated over the mesh: ``on``
        (Orbax's default: the replicas share each array's writes), ``off`` (one replica
        writes it; same checkpoint), ``auto`` (``off`` in one process on the CPU
        backend, where there is nobody to share with and the per-replica slicing costs
        about a third of each save; ``on`` elsewhere). The choice is printed and
        recorded in ``run.json``.
      stop_after: stop at this step (the schedule still spans ``steps``); a rerun
        with the same output resumes, as after an interruption.
      output: run directory (see the module docstring).
    """

    model: str = "qwen3-tiny"
    data: str | None = None
    tokenizer: str | None = None
    mesh: dict[str, int] | None = None
    per_device_batch_size: int = 1
    grad_accum: int = 1
    steps: int = 60
    max_target_length: int = 256
    packing: bool = True
    data_shards: int | None = None
    overflow: str = "truncate"
    learning_rate: float = 3e-3
    warmup_steps: int = 5
    lora_rank: int = 0
    lora_alpha: float | None = None
    remat: str = "none"
    scan_layers: bool = False
    seed: int = 0
    save_every: int = 50
    sync_saves: bool = False
    replica_parallel_saves: str = "auto"
    stop_after: int | None = None
    output: str = "runs/sft"

    def check(self) -> None:
        """Raises ValueError naming the first bad field (and its ``posttrain sft`` flag).

        Nothing is read or written before this passes; the output path is checked too
        (:func:`check_output_dir`).
        """

        def bad(name: str, expected: str):
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{name}={getattr(self, name)!r} ({flag}): expected {expected}")

        def finite_positive(value) -> bool:
            return math.isfinite(value) and value > 0

        if self.stop_after is not None and self.stop_after < 1:
            bad("stop_after", ">= 1")
        for name in ("per_device_batch_size", "grad_accum", "steps", "save_every"):
            if getattr(self, name) < 1:
                bad(name, ">= 1")
        if self.lora_rank < 0:
            bad("lora_rank", ">= 0 (0 = full fine-tuning)")
        if not finite_positive(self.learning_rate):
            bad("learning_rate", "a finite value > 0")
        if self.lora_alpha is not None and not finite_positive(self.lora_alpha):
            bad("lora_alpha", "a finite value > 0")
        if self.warmup_steps < 0:
            bad("warmup_steps", ">= 0")
        if self.seed < 0:
            bad("seed", "a non-negative integer")
        if self.max_target_length < 2:
            bad("max_target_length", ">= 2")
        if self.remat not in choices(RematPolicy):
            bad("remat", " or ".join(choices(RematPolicy)))
        if self.data_shards is not None and self.data_shards < 1:
            bad("data_shards", ">= 1")
        if self.overflow not in ("truncate", "reject"):
            bad("overflow", "truncate or reject")
        if self.replica_parallel_saves not in ("auto", "on", "off"):
            bad("replica_parallel_saves", "auto, on or off")
        check_output_dir(self.output)

    def resolved_replica_parallel_saves(self) -> bool:
        """``replica_parallel_saves`` as a bool, ``auto`` resolved for this process."""
        import jax

        if self.replica_parallel_saves == "auto":
            return not (jax.default_backend() == "cpu" and jax.process_count() == 1)
        return self.replica_parallel_saves == "on"


def check_output_dir(output: str) -> None:
    """Checks, before any work, that ``output`` can be a run directory: a non-empty path
    that is a directory or does not exist yet, under a writable directory.

    Raises:
      ValueError: naming the path and what is wrong with it.
    """
    if not output or not output.strip():
        raise ValueError("output=''; expected a run directory path")
    path = pathlib.Path(output)
    if path.absolute().parts[1:2] in (("proc",), ("sys",), ("dev",)):
        raise ValueError(f"output {output!r} is under a kernel file system; expected a directory")
    if path.exists() and not path.is_dir():
        raise ValueError(f"output {output!r} exists and is not a directory")
    probe = path if path.exists() else next(p for p in path.absolute().parents if p.exists())
    if not probe.is_dir():
        raise ValueError(f"output {output!r}: {probe} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        where = "" if probe == path else f": {probe}"
        raise ValueError(f"output {output!r}{where} is not writable")


@dataclasses.dataclass
class SFTResult:
    """What a run produced: per-step records and paths."""

    history: list[dict]
    output: pathlib.Path
    checkpoint_step: int | None
    exported: list[pathlib.Path]
    convention: str
    global_batch: int
    params: int
    trainable: int

    def summary(self) -> str:
        h = [r for r in self.history if r.get("loss") is not None]
        if not h:
            return f"no steps run (already at step {self.checkpoint_step})"
        speeds = [r["tokens_per_s"] for r in h if r.get("tokens_per_s")]
        speed = f", {np.median(speeds):,.0f} tokens/s" if speeds else ""
        return (
            f"steps {h[0]['step']}-{h[-1]['step']}: loss {h[0]['loss']:.3f} -> "
            f"{h[-1]['loss']:.3f} (perplexity {h[-1]['perplexity']:.1f}){speed}"
        )


def run_tokenizer_path(cfg, hf_dir: str | None) -> str | None:
    """Where a run's tokenizer comes from: ``cfg.tokenizer``; else the model directory's
    ``tokenizer.json``; else the tokenizer recorded by the run that exported it
    (``posttrain.loading.recorded_tokenizer``: ``posttrain dpo --model
    runs/sft/model-step60`` continues with the SFT run's); else None, the embedded byte
    tokenizer."""
    from posttrain.loading import recorded_tokenizer

    if cfg.tokenizer is not None or not hf_dir:
        return cfg.tokenizer
    if os.path.isfile(os.path.join(hf_dir, "tokenizer.json")):
        return hf_dir
    return recorded_tokenizer(hf_dir)


def run_tokenizer(cfg, hf_dir: str | None):
    """The tokenizer at :func:`run_tokenizer_path`."""
    from posttrain.sft.tokenizer import load_tokenizer

    return load_tokenizer(run_tokenizer_path(cfg, hf_dir))


def pad_id_of(tok) -> int:
    """The id padding is written with: the first of ``<|pad|>``, ``<|endoftext|>``,
    ``<pad>``, ``</s>`` the tokenizer has, else 0 (masks, not this id, mark padding)."""
    for name in ("<|pad|>", "<|endoftext|>", "<pad>", "</s>"):
        if tok.token_to_id(name) is not None:
            return tok.token_to_id(name)
    return 0


def build_rows(cfg: SFTConfig, tok, shard: tuple[int, int] = (0, 1)) -> dict[str, np.ndarray]:
    """The dataset as padded / packed rows (``posttrain.sft.data.to_rows``); ``shard``:
    ``(index, count)``, only conversations ``index, index + count, ...`` are tokenised."""
    from posttrain.sft import data
    from posttrain.sft.default_data import pydoc_conversations
    from posttrain.sft.tokenizer import check_coverage

    index, count = shard
    if cfg.data:  # the other shards' lines are counted, not parsed
        conversations = data.read_chat_jsonl(cfg.data, only=lambda i: i % count == index)
    else:
        conversations = pydoc_conversations()
    numbers = range(index, len(conversations), count)  # errors name the file's index
    conversations = conversations[index::count]
    examples = data.encode_dataset(
        conversations, tok, cfg.max_target_length, overflow=cfg.overflow, numbers=numbers
    )
    check_coverage((e.tokens for e in examples), tok, repr(cfg.tokenizer or "(embedded)"))
    return data.to_rows(examples, cfg.max_target_length, packing=cfg.packing, pad_id=pad_id_of(tok))


def recorded_shards(cfg: SFTConfig) -> int | None:
    """The data shards the run in ``cfg.output`` trained with, when there is one to
    resume (1 for a run recorded before the setting existed); None for a new run.
    ``posttrain sft``'s and ``dpo``'s configs (``output``)."""
    record = run_record.read(cfg.output)
    if not record:
        return None
    return int(record.get("data_shards", 1))


def data_shards(
    cfg: SFTConfig, mesh, global_batch: int, recorded: int | None = None
) -> tuple[int, range]:
    """``(shards, the shards this process reads)`` (:attr:`SFTConfig.data_shards`): the
    process reads the shards whose rows of every global batch its devices hold. A run
    resumed without ``data_shards`` keeps the count it was ``recorded`` with, so the
    data order survives a change in the number of processes. ``posttrain sft``'s and
    ``dpo``'s configs (``data_shards``, ``output``).

    Raises:
      ValueError: the global batch does not divide into the shards, a process's rows
        are not whole shards (both numbers named), or ``data_shards`` differs from the
        resumed run's.
    """
    from posttrain import sharding

    start, stop = distributed.local_rows(sharding.batch_sharding(mesh), global_batch)
    if recorded is not None and cfg.data_shards not in (None, recorded):
        raise ValueError(
            f"data_shards={cfg.data_shards} (--data-shards): the run in {cfg.output} "
            f"trained with {recorded} data shards; resuming with another count would "
            "change its data order"
        )
    shards = cfg.data_shards or recorded or global_batch // (stop - start)
    if global_batch % shards:
        raise ValueError(
            f"data_shards={shards} (--data-shards): the global batch {global_batch} does "
            "not divide into it"
        )
    per = global_batch // shards
    if start % per or stop % per:
        source = (
            f"the run in {cfg.output} trained with {shards} data shard(s), kept on resume"
            if cfg.data_shards is None and recorded is not None
            else f"data_shards={shards} (--data-shards)"
        )
        raise ValueError(
            f"{source}: this process holds rows {start}-{stop} of each global batch, not "
            f"whole shards of {per} rows; expected a multiple of {global_batch // (stop - start)}"
        )
    return shards, range(start // per, stop // per)


def load_run_model(cfg, mesh, tok):
    """:func:`posttrain.loading.load_trainable` with a run config's ``model``,
    ``lora_rank``, ``lora_alpha``, ``seed``, ``remat`` and ``scan_layers`` (an HF
    directory is converted beside ``output``); ``posttrain sft`` and ``dpo``."""
    from posttrain.loading import load_trainable

    return load_trainable(
        cfg.model,
        mesh,
        vocab_size=tok.get_vocab_size(),
        lora_rank=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        seed=cfg.seed,
        scratch=cfg.output,
        remat=cfg.remat,
        scan_layers=cfg.scan_layers,
    )


def prepare_output(output: str) -> pathlib.Path:
    """Creates run directory ``output`` and sweeps what a killed run left: its exports'
    temporaries and its on-the-fly HF conversion beside it."""
    from posttrain import distributed
    from posttrain.conversion.safetensors_io import sweep_stale_temporaries

    out = pathlib.Path(output)
    out.mkdir(parents=True, exist_ok=True)
    if distributed.is_writer():
        sweep_stale_temporaries(out)
        sweep_stale_temporaries(out.absolute().parent, out.name)
    return out


def adamw_schedule(cfg):
    """``(schedule, optimizer)`` of a run config with ``learning_rate``, ``warmup_steps``
    and ``steps``: linear warm-up to the peak, cosine to 10% of it; AdamW (b2 0.95, no
    weight decay) after clipping the global norm at 1. ``posttrain sft`` and ``dpo``."""
    import optax

    schedule = optax.warmup_cosine_decay_schedule(
        0.0,
        cfg.learning_rate,
        min(cfg.warmup_steps, cfg.steps - 1),
        cfg.steps,
        end_value=cfg.learning_rate * 0.1,
    )
    tx = optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.95, weight_decay=0.0)
    )
    return schedule, tx


def peft_training_fields(cfg, out: pathlib.Path, mesh, *, async_saves: bool = True) -> dict:
    """Tunix ``TrainingConfig`` fields of a run config with ``steps``, ``stop_after``,
    ``grad_accum`` and ``save_every``: checkpoints in ``out/checkpoints`` (2 kept),
    TensorBoard in ``out/tensorboard``, batches on the mesh's first batch axis, no eval."""
    from tunix.sft import metrics_logger

    from posttrain import _compat

    batch_axes = tuple(sharding.batch_spec(mesh))[:1]
    return dict(
        # No eval dataset; google-tunix <= 0.1.2 still requires a multiple of the GA steps.
        eval_every_n_steps=(cfg.steps + 1) * cfg.grad_accum,
        max_steps=min(cfg.steps, cfg.stop_after or cfg.steps),
        gradient_accumulation_steps=cfg.grad_accum if cfg.grad_accum > 1 else None,
        checkpoint_root_directory=str((out / "checkpoints").resolve()),
        checkpointing_options=_compat.interval_checkpoint_options(
            cfg.save_every, max_to_keep=2, enable_async_checkpointing=async_saves
        ),
        # One TensorBoard file, process 0's: Tunix's logger opens one in every process
        # it is given options in (and only process 0's gets the scalars).
        metrics_logging_options=metrics_logger.MetricsLoggerOptions(
            log_dir=str(out / "tensorboard"), flush_every_n_steps=10
        )
        if distributed.is_writer()
        else None,
        data_sharding_axis=batch_axes or ("fsdp",),
    )


def run_sft(
    cfg: SFTConfig,
    *,
    trainer_class: type | None = None,
    on_built=None,
    log_every: int | None = None,
) -> SFTResult:
    """Runs (or resumes) one SFT run; see the module docstring for what it writes.

    Args:
      cfg: the run.
      trainer_class: the trainer (default :class:`posttrain.sft.trainer.SFTTrainer`);
        tests pass SFTTrainerMixin over an emulated Tunix convention.
      on_built: called with the trainer before training (tests, benchmarks).
      log_every: print a progress line every this many steps.

    Raises:
      ValueError: a bad config, mesh, model, tokenizer or dataset (one line naming it).
    """
    import jax
    from flax import nnx
    from tunix.sft import peft_trainer

    from posttrain.loading import export_final
    from posttrain.sft import data
    from posttrain.sft.trainer import NonFiniteLossError, SFTOptions, SFTTrainer

    cfg.check()
    run_record.check_resumable(cfg, cfg.output)  # before anything is read or written
    # Across processes, process 0 alone writes metrics, progress and run.json; every
    # process trains, checkpoints (Orbax's collective saves) and gathers the export.
    writer = distributed.is_writer()
    log_every = log_every if writer else None
    mesh = sharding.make_mesh(cfg.mesh)
    dp = sharding.data_parallel_size(mesh)
    global_batch = cfg.per_device_batch_size * dp
    sp = sharding.sequence_parallel_size(mesh)
    if cfg.max_target_length % sp:
        raise ValueError(
            f"max_target_length={cfg.max_target_length} is not divisible by the "
            f"sequence-parallel size {sp} of the mesh"
        )
    hf_dir = cfg.model if os.path.isdir(cfg.model) else None
    tok = run_tokenizer(cfg, hf_dir)
    shards, mine = data_shards(cfg, mesh, global_batch, recorded_shards(cfg))
    # Bad data fails before the model is built. Each process tokenises its shards only,
    # so a bad shard fails in one process: every process learns it and stops (a
    # collective), none waits for the others at the next one.
    with distributed.together("read the data"):
        shard_rows = {s: build_rows(cfg, tok, (s, shards)) for s in mine}
    n_rows = distributed.sum_by_key(
        {s: len(r["input_tokens"]) for s, r in shard_rows.items()}, shards
    )
    model = load_run_model(cfg, mesh, tok)

    out = prepare_output(cfg.output)
    schedule, tx = adamw_schedule(cfg)
    training_config = peft_trainer.TrainingConfig(
        **peft_training_fields(cfg, out, mesh, async_saves=not cfg.sync_saves)
    )
    replica_parallel = cfg.resolved_replica_parallel_saves()
    cls = trainer_class or SFTTrainer  # its train() makes the mesh current
    options = SFTOptions(
        mesh=mesh,
        learning_rate_fn=schedule,
        metrics_path=out / "metrics.jsonl" if writer else None,
        log_every=log_every,
        single_replica_saves=not replica_parallel,
        process_local_batches=True,
    )
    trainer = cls(model, tx, training_config, options=options)
    params = sum(
        int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(trainer.model, nnx.Param))
    )
    trainable = sum(
        int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(trainer.model, trainer._wrt))
    )
    if log_every:
        print(
            f"model {cfg.model}: {params:,} params, {trainable:,} trained; "
            f"{n_rows:,} rows of {cfg.max_target_length} in {shards} data shard(s), "
            f"{sum(len(r['input_tokens']) for r in shard_rows.values()):,} read here; global "
            f"batch {global_batch} x grad_accum {cfg.grad_accum}; Tunix convention "
            f"{trainer.convention.name}; replica-parallel saves "
            f"{'on' if replica_parallel else 'off'} ({cfg.replica_parallel_saves})",
            flush=True,
        )
    if on_built is not None:
        on_built(trainer)
    restored = trainer.train_steps  # Tunix restored the latest checkpoint, if any
    facts = {
        "global_batch": global_batch,
        "rows": n_rows,
        "data_shards": shards,
        "convention": trainer.convention.name,
        "replica_parallel_saves_resolved": replica_parallel,
    }
    if writer:  # metrics.jsonl keeps each step once: replayed steps re-log
        run_record.begin_segment(out, cfg, facts, restored)
    try:
        batches = data.sharded_batches(
            shard_rows,
            shards,
            global_batch,
            cfg.grad_accum,
            seed=cfg.seed,
            step_total=lambda counts: distributed.sum_by_key(counts, shards),
        )
        trainer.train(batches)
    except NonFiniteLossError:
        trainer.abandon()  # no final checkpoint, no export of a non-finite model
        raise
    step = trainer.train_steps
    exported = export_final(trainer.model, out, step)
    return SFTResult(
        trainer.history,
        out,
        step,
        exported,
        trainer.convention.name,
        global_batch,
        params,
        trainable,
    )
