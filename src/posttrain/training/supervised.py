"""One supervised run end to end: model + tokenizer + chat rows + mesh -> a trainer
(``SFTTrainer`` by default) -> outputs. ``posttrain sft`` (:mod:`posttrain.sft.run`), its
``--vision`` runs (their rows, images and held-out figures: ``prepare_images``), ``posttrain
distill`` (its trainer) and GRPO's warm-up are this run.

Output directory (``SupervisedRunOptions.output``)::

    checkpoints/      Tunix CheckpointManager (Orbax): params (LoRA only when LoRA is on)
                      and optimizer state, every ``save_every`` steps and at the end;
                      a rerun with the same output and the same training settings
                      resumes from the latest step (another setting is refused)
    run.json          settings and one record per start or resume (``run_record``)
    metrics.jsonl     one record per optimizer step, each step once across resumes
    tensorboard/      Tunix's MetricsLogger (loss, perplexity, grad_norm, learning_rate)
    model-step<N>/    native safetensors of the final weights (LoRA merged), with the
                      run's chat template, tokenizer and generation_config.json
                      (:mod:`posttrain.training.formats`) ...
    adapter-step<N>/  ... and the adapters alone, when LoRA is on
"""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import numpy as np
from flax import nnx

from posttrain import distributed, limits, sharding
from posttrain.tokenizer import check_coverage
from posttrain.training import chunked_loss, data
from posttrain.training import record as run_record
from posttrain.training.checks import check_same_run, discard_unstarted
from posttrain.training.default_data import pydoc_conversations
from posttrain.training.directory import prepare_output
from posttrain.training.export import export_final
from posttrain.training.formats import run_tokenizer_and_formats
from posttrain.training.loading import load_run_model, pad_id_of
from posttrain.training.optimizer import adam_schedule, peft_training_fields, trainer_options
from posttrain.training.options import SupervisedRunOptions
from posttrain.training.shards import data_shards, recorded_shards
from posttrain.training.trainer import NonFiniteLossError, SFTTrainer

__all__ = ["SFTResult", "build_rows", "run_supervised"]


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
    held_out: str | None = None  # --vision: the held-out answers' line, before -> after

    def summary(self) -> str:
        line = run_record.steps_line(
            self.history, self.checkpoint_step, lambda r: f" (perplexity {r['perplexity']:.1f})"
        )
        if self.held_out is not None:
            line += "\n" + self.held_out
        return line


def build_rows(
    cfg: SupervisedRunOptions, tok, shard: tuple[int, int] = (0, 1), template=None
) -> dict[str, np.ndarray]:
    """The dataset as padded / packed rows (``posttrain.training.data.to_rows``) in ``template``
    (default: the built-in ChatML; a data file is also checked in its terms); ``shard``:
    ``(index, count)``, only conversations ``index, index + count, ...`` are tokenised."""
    index, count = shard
    if cfg.data:  # the other shards' lines are counted, not parsed
        conversations = data.read_chat_jsonl(
            cfg.data, only=lambda i: i % count == index, template=template
        )
    else:
        conversations = pydoc_conversations()
    numbers = range(index, len(conversations), count)  # errors name the file's index
    conversations = conversations[index::count]
    examples = data.encode_dataset(
        conversations,
        tok,
        cfg.max_target_length,
        overflow=cfg.overflow,
        numbers=numbers,
        template=template,
    )
    check_coverage((e.tokens for e in examples), tok, repr(cfg.tokenizer or "(embedded)"))
    return data.to_rows(examples, cfg.max_target_length, packing=cfg.packing, pad_id=pad_id_of(tok))


def run_supervised(
    cfg: SupervisedRunOptions,
    *,
    trainer_class: type | None = None,
    on_built=None,
    log_every: int | None = None,
    prepare_images=None,
) -> SFTResult:
    """Runs (or resumes) one supervised run; see the module docstring for what it writes.

    Args:
      cfg: the run.
      trainer_class: the trainer (default :class:`posttrain.training.trainer.SFTTrainer`);
        tests pass SFTTrainerMixin over an emulated Tunix convention.
      on_built: called with the trainer before training (tests, benchmarks).
      log_every: print a progress line every this many steps.
      prepare_images: ``prepare_images(cfg, tok, template, pad_id)`` checks and reads an
        image run's data before anything is written and returns its rows, batches,
        frozen variables, held-out scores and export (``VisionRun``); None: text rows
        (:func:`build_rows`).

    Raises:
      ValueError: a bad config, mesh, model, tokenizer or dataset (one line naming it).
    """
    cfg, mesh, global_batch, resume_facts = _checked(cfg)
    # Across processes, process 0 alone writes metrics, progress and run.json; every
    # process trains, checkpoints (Orbax's collective saves) and gathers the export.
    writer = distributed.is_writer()
    log_every = log_every if writer else None
    tok, formats = run_tokenizer_and_formats(cfg)  # the template: refused before any write
    images = prepare_images and prepare_images(cfg, tok, formats.template, pad_id_of(tok))
    rows_of = build_rows if images is None else images.rows
    shards, shard_rows, n_rows = _read_rows(cfg, tok, mesh, global_batch, formats.template, rows_of)
    model = load_run_model(cfg, mesh, tok)
    before = images and images.score(model, mesh, global_batch)
    out = prepare_output(cfg.output)
    frozen = images and images.frozen
    trainer, replica_parallel = _trainer(cfg, model, mesh, out, log_every, trainer_class, frozen)
    params, trainable = _parameter_counts(trainer)
    facts = {
        "global_batch": global_batch,
        "rows": n_rows,
        "data_shards": shards,
        "convention": trainer.convention.name,
        "replica_parallel_saves_resolved": replica_parallel,
        **resume_facts,
        **formats.facts(),
    }
    if log_every:
        here = sum(len(r["input_tokens"]) for r in shard_rows.values())
        print(_start_line(cfg, facts, params, trainable, here), flush=True)
    if on_built is not None:
        on_built(trainer)
    _train(trainer, cfg, out, facts, shard_rows, write=writer, images=images)
    step = trainer.train_steps
    exported = export_final(trainer.model, out, step, formats=formats)
    held_out = None
    if before:
        after = images.score(trainer.model, mesh, global_batch)
        held_out = images.held_out_summary(before, after)
    if images:
        images.write(exported)
    convention = trainer.convention.name
    return SFTResult(
        trainer.history, out, step, exported, convention, global_batch, params, trainable, held_out
    )


def _checked(cfg: SupervisedRunOptions):
    """What is refused before any row is read or anything written: the options, a resume
    of another run (devices, data content, exports) and a length past the model's
    positions or a step's memory.

    Returns:
        ``(cfg, mesh, global_batch, resume_facts)`` (with ``--vision`` and no
        ``--model``, ``cfg.model`` is already the vision preset: ``SFTConfig.default_model``).
    """
    cfg.check()
    run_record.check_resumable(cfg, cfg.output)
    mesh = sharding.make_mesh(cfg.mesh)
    global_batch = _global_batch(cfg, mesh)
    limits.check_training_length(
        cfg.model,
        cfg.max_target_length,
        global_batch,
        flag="--max-target-length",
        logit_chunk_bytes=chunked_loss.LOGIT_CHUNK_BYTES,  # sft_terms chunks the NLL
    )
    return cfg, mesh, global_batch, check_same_run(cfg, global_batch)


def _global_batch(cfg: SupervisedRunOptions, mesh) -> int:
    """Rows per step: ``per_device_batch_size`` x the mesh's data-parallel size.

    Raises:
      ValueError: ``max_target_length`` does not divide by the sequence-parallel size.
    """
    sp = sharding.sequence_parallel_size(mesh)
    if cfg.max_target_length % sp:
        raise ValueError(
            f"max_target_length={cfg.max_target_length} is not divisible by the "
            f"sequence-parallel size {sp} of the mesh"
        )
    return cfg.per_device_batch_size * sharding.data_parallel_size(mesh)


def _start_line(
    cfg: SupervisedRunOptions, facts: dict, params: int, trainable: int, here: int
) -> str:
    """The first progress line: the model, the data, the batch, Tunix's convention."""
    return (
        f"model {cfg.model}: {params:,} params, {trainable:,} trained; "
        f"{facts['rows']:,} rows of {cfg.max_target_length} in {facts['data_shards']} data "
        f"shard(s), {here:,} read here; global batch {facts['global_batch']} x grad_accum "
        f"{cfg.grad_accum}; Tunix convention {facts['convention']}; replica-parallel saves "
        f"{'on' if facts['replica_parallel_saves_resolved'] else 'off'} "
        f"({cfg.replica_parallel_saves})"
    )


def _read_rows(
    cfg: SupervisedRunOptions, tok, mesh, global_batch: int, template=None, rows_of=build_rows
):
    """``(data shards, {shard: rows} of this process's shards, rows of all shards)``;
    ``rows_of(cfg, tok, shard, template)`` builds a shard's rows (default :func:`build_rows`).

    Bad data fails before the model is built. Each process tokenises its shards only, so
    a bad shard fails in one process: every process learns it and stops (a collective),
    none waits for the others at the next one."""
    shards, mine = data_shards(cfg, mesh, global_batch, recorded_shards(cfg))
    with distributed.together("read the data"):
        shard_rows = {s: rows_of(cfg, tok, (s, shards), template) for s in mine}
    n_rows = distributed.sum_by_key(
        {s: len(r["input_tokens"]) for s, r in shard_rows.items()}, shards
    )
    return shards, shard_rows, n_rows


def _trainer(
    cfg: SupervisedRunOptions, model, mesh, out: pathlib.Path, log_every, trainer_class, frozen=None
):
    """``(trainer, whether Orbax's saves are replica-parallel)`` of the run ``cfg``."""
    from tunix.sft import peft_trainer

    schedule, tx = adam_schedule(cfg)
    training_config = peft_trainer.TrainingConfig(
        **peft_training_fields(cfg, out, mesh, async_saves=not cfg.sync_saves)
    )
    replica_parallel = cfg.resolved_replica_parallel_saves()
    cls = trainer_class or SFTTrainer  # its train() makes the mesh current
    options = trainer_options(
        mesh, schedule, out, log_every, single_replica_saves=not replica_parallel
    )
    options = dataclasses.replace(options, frozen=frozen)
    return cls(model, tx, training_config, options=options), replica_parallel


def _parameter_counts(trainer) -> tuple[int, int]:
    """``(parameters, trained parameters)`` of the trainer's model."""

    def count(kind) -> int:
        leaves = jax.tree.leaves(nnx.state(trainer.model, kind))
        return sum(int(np.prod(x.shape)) for x in leaves)

    return count(nnx.Param), count(trainer.learned)


def _train(
    trainer, cfg: SupervisedRunOptions, out, facts: dict, shard_rows, *, write: bool, images=None
) -> None:
    """Records this segment (the writer) and trains from the step Tunix restored; a
    non-finite loss abandons the run (no final checkpoint, no export)."""
    restored = trainer.train_steps  # Tunix restored the latest checkpoint, if any
    if write:  # metrics.jsonl keeps each step once: replayed steps re-log
        run_record.begin_segment(out, cfg, facts, restored)
    shards = facts["data_shards"]
    try:
        batches = data.sharded_batches(
            shard_rows,
            shards,
            facts["global_batch"],
            cfg.grad_accum,
            seed=cfg.seed,
            step_total=lambda counts: distributed.sum_by_key(counts, shards),
        )
        trainer.train(batches if images is None else images.batches(batches))
    except NonFiniteLossError as error:
        trainer.abandon()  # no final checkpoint, no export of a non-finite model
        # a run that never checkpointed leaves nothing half-written (training.checks)
        if write and discard_unstarted(out, restored):
            raise NonFiniteLossError(f"{error}; removed what the run wrote in {out}") from None
        raise
