"""One DPO or ORPO run end to end: model + reference + preference pairs -> our
``DPOTrainer`` over Tunix's -> outputs. ``run_dpo(DPORunConfig())`` is what
``posttrain dpo`` does with no arguments: ``qwen3-tiny`` on the embedded ``pydoc_data``
preference pairs (:mod:`posttrain.preference.default_data`), every device on ``fsdp``.

Output directory (``DPORunConfig.output``), as ``posttrain sft``'s::

    checkpoints/      Tunix's checkpoints of the policy (LoRA only when LoRA is on); a
                      rerun with the same settings resumes from the latest
    run.json          settings, and per start: the step resumed from and the held-out
                      evaluation before and after
    metrics.jsonl     one record per optimizer step (``PreferenceMetrics``), each once
    tensorboard/      Tunix's metrics (loss, rewards/*, log_probs/*)
    model-step<N>/    native safetensors of the final policy (LoRA merged) ...
    adapter-step<N>/  ... and its adapters, when LoRA is on
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import pathlib
from collections.abc import Sequence

import numpy as np

from posttrain import atomic, distributed, sharding
from posttrain.distributed import host_array
from posttrain.preference import data, tunix_dpo
from posttrain.preference.default_data import pydoc_pairs
from posttrain.preference.options import DPORunConfig
from posttrain.preference.trainer import DPOTrainer
from posttrain.tokenizer import check_coverage
from posttrain.training import record as run_record
from posttrain.training.checks import check_same_run, discard_unstarted
from posttrain.training.data import sharded_batches
from posttrain.training.directory import prepare_output
from posttrain.training.export import export_final
from posttrain.training.formats import run_tokenizer_and_formats
from posttrain.training.loading import load_run_model, pad_id_of
from posttrain.training.optimizer import (
    adam_schedule,
    peft_training_fields,
    single_process_cpu,
    trainer_options,
)
from posttrain.training.policy import TunixPolicy, reference_of
from posttrain.training.shards import data_shards, recorded_shards
from posttrain.training.trainer import NonFiniteLossError

__all__ = ["DPORunConfig", "DPOResult", "pair_arrays", "run_dpo"]


@dataclasses.dataclass
class DPOResult:
    """What a run produced."""

    history: list[dict]
    output: pathlib.Path
    checkpoint_step: int | None
    exported: list[pathlib.Path]
    convention: str
    global_batch: int
    before: dict | None
    after: dict | None

    def summary(self) -> str:
        text = run_record.steps_line(
            self.history,
            self.checkpoint_step,
            lambda r: (
                f", preference accuracy {r['preference_accuracy']:.2f}, "
                f"margin {r['reward_margin']:.3f}"
            ),
        )
        if self.before and self.after:
            text += "\n" + evaluation_line(self.before, self.after)
        return text


def evaluation_line(before: dict, after: dict) -> str:
    return (
        f"held-out ({after['pairs']} pairs): preference accuracy "
        f"{before['preference_accuracy']:.3f} -> {after['preference_accuracy']:.3f}, reward "
        f"margin {before['reward_margin']:.3f} -> {after['reward_margin']:.3f}, policy "
        f"prefers chosen {before['logp_accuracy']:.3f} -> {after['logp_accuracy']:.3f}"
    )


@dataclasses.dataclass(frozen=True)
class ShardedPairs:
    """The pairs of the data shards one process reads.

    Attributes:
      shards: how many interleaved shards the pairs are split into (pair i in shard
        ``i % shards``).
      arrays: ``{shard: arrays}`` for this process's shards, each from
        :func:`~posttrain.preference.data.encode_pairs` (``[pairs of the shard, length]``).
      total: the pairs of every shard together (every process counts every line).
    """

    shards: int
    arrays: dict[int, dict[str, np.ndarray]]
    total: int

    @property
    def here(self) -> int:
        """The pairs this process tokenised."""
        return sum(len(a["prompt_ids"]) for a in self.arrays.values())

    def batches(self, global_batch: int, grad_accum: int, *, seed: int):
        """This process's part of each global micro-batch, repeating
        (:func:`posttrain.training.data.sharded_batches`)."""
        return sharded_batches(self.arrays, self.shards, global_batch, grad_accum, seed=seed)

    def whole_batches(self, global_batch: int) -> int:
        """How many global batches a single pass takes: each shard holds at least
        ``total // shards`` pairs, every process computes the same number."""
        return self.total // self.shards // (global_batch // self.shards)


def pair_arrays(
    cfg: DPORunConfig,
    tok,
    tokenizer_name: str,
    shards: int = 1,
    mine: Sequence[int] = (0,),
    template=None,
) -> tuple[ShardedPairs, ShardedPairs | None]:
    """``(train pairs, held-out pairs or None)``: the shards ``mine`` of ``shards`` of
    each (:class:`ShardedPairs`), in ``template`` (the run's; None: the built-in ChatML
    after the tokenizer's BOS prefix); ``tokenizer_name`` names the tokenizer in a
    coverage error. A process parses, validates and tokenises the pairs of its shards
    only (the others' lines are counted)."""

    def mine_only(i: int) -> bool:  # the other shards' lines are counted, not parsed
        return i % shards in mine

    if cfg.data:
        train, held_out = data.read_preference_jsonl(cfg.data, only=mine_only), None
    else:
        train, held_out = pydoc_pairs()
    if cfg.eval_data:
        held_out = data.read_preference_jsonl(cfg.eval_data, "--eval-data", mine_only)

    def encode(pairs):
        arrays = data.encode_pairs(
            pairs,
            tok,
            max_prompt_length=cfg.max_prompt_length,
            max_response_length=cfg.max_response_length,
            overflow=cfg.overflow,
            pad_id=pad_id_of(tok),
            template=template,
        )
        ids = (
            arrays[f"{k}_ids"][arrays[f"{k}_mask"] > 0] for k in ("prompt", "chosen", "rejected")
        )
        check_coverage(ids, tok, tokenizer_name)
        return arrays

    def sharded(pairs):
        return ShardedPairs(shards, {s: encode(pairs[s::shards]) for s in mine}, len(pairs))

    return sharded(train), (sharded(held_out) if held_out else None)


def evaluate(
    trainer, pairs: ShardedPairs, global_batch: int, *, algorithm: str, scale: float
) -> dict:
    """Held-out figures of the trainer's policy, whole batches only (the remainder is
    left out): the means of ``preference_accuracy`` and ``reward_margin`` as training
    logs them, from rewards ``scale x (policy - reference)`` summed completion
    log-probabilities for DPO (``scale`` is beta) and ``scale x policy`` for ORPO
    (``scale`` is lambda_orpo, no reference); and ``logp_accuracy``, the share of pairs
    whose chosen completion the policy alone gives the higher log-probability. One
    jitted forward of the policy per batch (Tunix's ``compute_logps``); the reference's
    come from Tunix's preparation. The batches are the first pass of ``pairs``'s
    stream (seed 0): with one shard, its pairs shuffled, the remainder left out."""
    count = pairs.whole_batches(global_batch)
    n = count * global_batch
    sums = {"preference_accuracy": 0.0, "reward_margin": 0.0, "logp_accuracy": 0.0}
    with sharding.use_mesh(trainer.mesh, trainer.rules, jax_context=False):
        for batch in itertools.islice(pairs.batches(global_batch, 1, seed=0), count):
            example = trainer._prepare_inputs(batch)
            chosen, rejected = (
                host_array(x).astype(np.float64)
                for x in tunix_dpo.example_logps(trainer.model, example)
            )
            if algorithm == "dpo":
                chosen_reward = scale * (chosen - host_array(example.ref_chosen_logps))
                rejected_reward = scale * (rejected - host_array(example.ref_rejected_logps))
            else:
                chosen_reward, rejected_reward = scale * chosen, scale * rejected
            sums["preference_accuracy"] += float(np.sum(chosen_reward > rejected_reward))
            sums["reward_margin"] += float(np.sum(chosen_reward - rejected_reward))
            sums["logp_accuracy"] += float(np.sum(chosen > rejected))
    return {"pairs": n, **{k: v / n for k, v in sums.items()}}


def run_dpo(cfg: DPORunConfig, *, log_every: int | None = None, on_built=None) -> DPOResult:
    """Runs (or resumes) one DPO / ORPO run; see the module docstring for what it writes.

    Raises:
      ValueError: a bad config, mesh, model, tokenizer or dataset (one line naming it);
        ORPO on a release without it.
    """

    cfg.check()
    tunix_dpo.check_algorithm(cfg.algorithm)  # before anything is read or written
    run_record.check_resumable(cfg, cfg.output)
    # Across processes, process 0 alone writes metrics, progress, run.json and exports.
    writer = distributed.is_writer()
    log_every = log_every if writer else None
    mesh = sharding.make_mesh(cfg.mesh)
    global_batch = cfg.per_device_batch_size * sharding.data_parallel_size(mesh)
    resume_facts = check_same_run(cfg, global_batch)  # devices, data content, exports
    # the template (one BOS, the template's): refused before anything is written
    tok, formats = run_tokenizer_and_formats(cfg)
    name = repr(formats.tokenizer_path or "(embedded)")
    shards, train, held_out = _read_pairs(cfg, tok, name, mesh, global_batch, formats.template)
    model = load_run_model(cfg, mesh, tok)
    out = prepare_output(cfg.output)
    trainer = _trainer(cfg, model, mesh, out, log_every)
    if on_built is not None:
        on_built(trainer)
    if log_every:
        print(
            f"model {cfg.model}: {cfg.algorithm} on {train.total:,} pairs in {shards} data "
            f"shard(s), {train.here:,} read here (prompt {cfg.max_prompt_length} + response "
            f"{cfg.max_response_length} tokens); "
            f"global batch {global_batch} pairs x grad_accum {cfg.grad_accum}; reference "
            f"{_reference_kind(cfg)}; Tunix convention {trainer.convention.name}",
            flush=True,
        )
    facts = {
        "global_batch": global_batch,
        "pairs": train.total,
        "data_shards": shards,
        "convention": trainer.convention.name,
        **resume_facts,
        **formats.facts(),
    }
    before, after = _train(trainer, cfg, out, facts, train, held_out, write=writer)
    step = trainer.train_steps
    exported = export_final(trainer.model.model, out, step, formats=formats)
    return DPOResult(
        trainer.history,
        out,
        step,
        exported,
        trainer.convention.name,
        global_batch,
        before,
        after,
    )


def _train(trainer, cfg: DPORunConfig, out, facts: dict, train, held_out, *, write: bool):
    """Evaluates on ``held_out`` (a resumed run reports its start's evaluation, recorded
    then), records this segment (the writer), trains from the step Tunix restored and
    evaluates again; returns the figures ``(before, after)`` (None without held-out
    pairs). A non-finite loss abandons the run (no final checkpoint, no export)."""
    global_batch = facts["global_batch"]
    scale = cfg.beta if cfg.algorithm == "dpo" else cfg.lambda_orpo

    def held_out_figures():
        return evaluate(trainer, held_out, global_batch, algorithm=cfg.algorithm, scale=scale)

    restored = trainer.train_steps
    before = None
    if held_out is not None:
        before = held_out_figures() if not restored else _recorded_before(out)
    if write:
        run_record.begin_segment(out, cfg, {**facts, "evaluation_before": before}, restored)
    try:
        trainer.train(train.batches(global_batch, cfg.grad_accum, seed=cfg.seed))
    except NonFiniteLossError as error:
        trainer.abandon()
        # a run that never checkpointed leaves nothing half-written (training.checks)
        if write and discard_unstarted(out, restored):
            raise NonFiniteLossError(f"{error}; removed what the run wrote in {out}") from None
        raise
    after = held_out_figures() if held_out is not None else None
    if after is not None and write:
        _record_evaluation(out, before, after)
    return before, after


def _read_pairs(
    cfg: DPORunConfig, tok, tokenizer_name: str, mesh, global_batch: int, template=None
):
    """``(data shards, train pairs, held-out pairs or None)`` of this process
    (:func:`pair_arrays`).

    Raises:
      ValueError: bad pairs, or fewer than one optimizer step of them (one global batch
        of held-out pairs).
    """
    shards, mine = data_shards(cfg, mesh, global_batch, recorded_shards(cfg))
    # Bad data fails before the model is built or anything is written. Each process
    # tokenises its shards only, so a bad pair fails in one process: every process
    # learns it and stops (a collective), none waits for the others at the next one.
    with distributed.together("read the data"):
        train, held_out = pair_arrays(cfg, tok, tokenizer_name, shards, mine, template)
    if train.total < global_batch * cfg.grad_accum:
        raise ValueError(
            f"{cfg.data or '(embedded pairs)'} has {train.total} training pairs, fewer than "
            f"one optimizer step ({global_batch} x grad_accum {cfg.grad_accum})"
        )
    if held_out is not None and held_out.total < global_batch:
        raise ValueError(
            f"--eval-data {cfg.eval_data or '(embedded held-out pairs)'} has "
            f"{held_out.total} pairs, fewer than one global batch ({global_batch})"
        )
    return shards, train, held_out


def _trainer(cfg: DPORunConfig, model, mesh, out: pathlib.Path, log_every):
    """Our ``DPOTrainer`` of the run ``cfg``: the policy ``model`` and its reference
    (none for ORPO; the policy with adapters off under LoRA, else a frozen copy)."""
    policy = TunixPolicy(model)
    reference = None if cfg.algorithm == "orpo" else reference_of(policy)
    schedule, tx = adam_schedule(cfg)
    training_config = tunix_dpo.training_config(
        algorithm=cfg.algorithm,
        beta=cfg.beta,
        label_smoothing=cfg.label_smoothing,
        lambda_orpo=cfg.lambda_orpo,
        **peft_training_fields(cfg, out, mesh),
    )
    options = trainer_options(
        mesh, schedule, out, log_every, single_replica_saves=single_process_cpu()
    )
    return DPOTrainer(policy, reference, tx, training_config, options=options)


def _reference_kind(cfg: DPORunConfig) -> str:
    if cfg.algorithm == "orpo":
        return "none (ORPO)"
    return "the policy with adapters off" if cfg.lora_rank else "a frozen copy"


def _recorded_before(out: pathlib.Path) -> dict | None:
    """The held-out evaluation recorded at the start of the run in ``out`` (its first
    segment's ``evaluation_before``), or None."""
    body = run_record.read(out) or {}
    for segment in body.get("segments", []):
        if segment.get("evaluation_before"):
            return segment["evaluation_before"]
    return None


def _record_evaluation(out: pathlib.Path, before: dict | None, after: dict) -> None:
    """Adds the held-out figures to this segment of ``run.json``."""
    body = run_record.read(out) or {}
    segment = {**body.get("segments", [{}])[-1], "evaluation": {"before": before, "after": after}}
    body["segments"] = [*body.get("segments", [])[:-1], segment]
    body["evaluation"] = segment["evaluation"]
    atomic.write_text(out / run_record.RUN_FILE, json.dumps(body, indent=2) + "\n")
