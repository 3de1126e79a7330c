"""One GRPO run end to end: warm-up SFT -> policy + reference -> Tunix's cluster and
learner -> outputs. ``run_grpo(GRPORunConfig())`` is what ``posttrain grpo`` does with
no arguments: ``qwen3-tiny`` on the embedded addition task
(:mod:`posttrain.rl.arithmetic`), every device on ``fsdp``.

Output directory (``GRPORunConfig.output``)::

    warmup/           the warm-up SFT run (``posttrain sft`` layout) and its export
    checkpoints/      Tunix's checkpoints of the actor (LoRA only when LoRA is on); a
                      rerun with the same settings resumes from the latest
    run.json          settings and one record per start or resume (``run_record``), each
                      with the step it resumed from, the held-out evaluation before and after
    metrics.jsonl     one record per GRPO step (:func:`posttrain.rl.metrics.step_record`),
                      each step once
    tensorboard/      Tunix's metrics
    model-step<N>/    native safetensors of the final policy (LoRA merged) ...
    adapter-step<N>/  ... and its adapters, when LoRA is on
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
import time

import jax
import numpy as np

from posttrain import distributed, sharding
from posttrain import generate as generation
from posttrain.generate import SamplingConfig
from posttrain.loading import load_trainable
from posttrain.rl import arithmetic, rewards, tunix_cluster, tunix_rl
from posttrain.rl.build import batch_size, build_learner, saves
from posttrain.rl.metrics import progress_line, step_record, write_metrics
from posttrain.rl.options import GRPORunConfig
from posttrain.training import record as run_record
from posttrain.training.checks import check_global_batch
from posttrain.training.export import export_final
from posttrain.training.formats import run_tokenizer_and_formats
from posttrain.training.options import SupervisedRunOptions
from posttrain.training.supervised import run_supervised
from posttrain.tunix_sampler import TunixTokenizer

__all__ = ["GRPOResult", "GRPORunConfig", "progress_line", "run_grpo", "step_record"]


@dataclasses.dataclass
class GRPOResult:
    """What a run produced."""

    history: list[dict]
    output: pathlib.Path
    step: int
    eval_before: float | None
    eval_after: float | None
    exported: list[pathlib.Path]
    eval_samples: int

    def summary(self) -> str:
        steps = [r for r in self.history if "reward/total/mean" in r]
        trained = (
            f"steps {steps[0]['step']}-{steps[-1]['step']}: reward "
            f"{steps[0]['reward/total/mean']:.3f} -> {steps[-1]['reward/total/mean']:.3f}; "
            if steps
            else f"no steps run (already at step {self.step}); "
        )
        if self.eval_before is None or self.eval_after is None:
            return trained.removesuffix("; ")
        return (
            f"{trained}eval reward ({self.eval_samples} samples of each task problem) "
            f"{self.eval_before:.3f} -> {self.eval_after:.3f}"
        )


def evaluate(model, tok, problems, cfg: GRPORunConfig, fns, template=None) -> float:
    """The policy's mean summed reward on ``problems``: ``cfg.eval_samples`` completions
    each, sampled at the rollout temperature with a fixed seed (``cfg.seed``), so two
    evaluations of the same weights agree and two policies see the same random draws.
    Prompts in ``template`` (default: the built-in ChatML); a completion stops at any of
    ``tok.stop_ids`` (the checkpoint's), which its text leaves out."""
    repeated = [p for p in problems for _ in range(cfg.eval_samples)]
    texts = [p.prompt_in(template) for p in repeated]
    prompts = [tok.encode(text) for text in texts]
    sampling = SamplingConfig(
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        seed=cfg.seed,
        eos_ids=tok.stop_ids,
        pad_id=tok.pad_id(),
    )
    gen = generation.generate(model, prompts, sampling)
    completions = [
        tok.decode([t for t in gen.row(i) if t not in tok.stop_ids]) for i in range(len(repeated))
    ]
    columns = {"answer": [p.answer for p in repeated], "mode": "eval"}
    total = np.zeros(len(repeated))
    for fn in fns:
        total += np.asarray(fn(prompts=texts, completions=completions, **columns), float)
    return float(total.mean())


def _warmup(cfg: GRPORunConfig, out: pathlib.Path, problems, log_every) -> str:
    """Runs (or finds) the warm-up SFT; returns the model to start GRPO from."""
    if cfg.warmup_steps == 0:
        return cfg.model
    done = out / "warmup" / f"model-step{cfg.warmup_steps}"
    if done.is_dir():  # finished by an earlier start of this run
        return str(done)
    data = out / "warmup" / "data.jsonl"
    distributed.on_writer(
        lambda: arithmetic.write_warmup_jsonl(problems, data, repeats=4), "write the warm-up data"
    )
    sft = SupervisedRunOptions(
        model=cfg.model,
        data=str(data),
        tokenizer=cfg.tokenizer,
        chat_template=cfg.chat_template,
        mesh=cfg.mesh,
        steps=cfg.warmup_steps,
        max_target_length=64,  # the rest posttrain sft's defaults (docs/rl.md)
        seed=cfg.seed,
        data_shards=cfg.warmup_data_shards,
        save_every=cfg.warmup_steps,
        sync_saves=True,
        output=str(out / "warmup"),
    )
    result = run_supervised(sft, log_every=log_every)
    if log_every:
        print(f"warm-up SFT: {result.summary()}", flush=True)
    return str(done)


def run_grpo(cfg: GRPORunConfig, *, log_every: int | None = None, on_built=None) -> GRPOResult:
    """Runs (or resumes) one GRPO run; see the module docstring for what it writes.

    Args:
      cfg: the run.
      log_every: print a line every this many steps (None: quiet).
      on_built: called with ``(learner, policies)`` before training (tests).

    Raises:
      ValueError: a bad config, mesh, model or tokenizer, or an algorithm the installed
        Tunix does not have (one line naming it).
    """
    cfg.check()
    # Across processes, process 0 alone writes metrics, progress, run.json and exports.
    writer = distributed.is_writer()
    log_every = log_every if writer else None
    out = pathlib.Path(cfg.output)
    previous, (mesh, rollout_mesh) = _check_before_work(cfg, out)
    fns = [rewards.resolve(spec) for spec in cfg.reward]
    # the template and stop ids: the checkpoint's (ChatML's <|im_end|> first for ChatML)
    raw, formats = run_tokenizer_and_formats(cfg)
    tok = TunixTokenizer(raw, eos_ids=formats.eos_ids)
    template = formats.template
    task = _task(cfg, tok, template)
    found = _surface(cfg, writer, log_every)
    out.mkdir(parents=True, exist_ok=True)
    start = _warmup(cfg, out, task, log_every)
    model = load_trainable(
        start,
        mesh,
        vocab_size=tok.tokenizer.get_vocab_size(),
        lora_rank=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        seed=cfg.seed,
        scratch=cfg.output,
    )
    # Our mesh for tracing, not JAX's mesh context: Orbax's eager per-shard copies fail
    # under it on jax 0.7-0.8 (as in SFTTrainer.train).
    with sharding.use_mesh(mesh, jax_context=False):
        before = _recorded_before(previous)
        if before is None and cfg.eval_samples:
            before = evaluate(model, tok, task, cfg, fns, template)
        trained = _train(
            cfg, model, tok, (mesh, rollout_mesh), (task, template), fns, on_built, writer
        )
        model, step, restored, history, seconds = trained
        after = evaluate(model, tok, task, cfg, fns, template) if cfg.eval_samples else None
    exported = export_final(model, out, step, formats=formats)
    if writer:
        facts = {
            **formats.facts(),  # the template's sha256: a resume in another is refused
            "global_batch": batch_size(cfg, mesh),
            "devices": jax.device_count(),
            "tunix_rl": found,
            "step": step,
            "seconds": round(seconds, 2),
            "evaluation": {"before": before, "after": after},
        }
        run_record.record_segment(out, cfg, facts, restored)
    if log_every:
        for record in history[log_every - 1 :: log_every]:
            print(progress_line(record), flush=True)
    return GRPOResult(history, out, step, before, after, exported, cfg.eval_samples)


def _check_before_work(cfg: GRPORunConfig, out: pathlib.Path):
    """What can be refused before anything is read or written: a resume with other
    settings or another global batch, an algorithm the installed Tunix lacks, the
    meshes, the accumulation. Returns ``(the recorded run.json or None, (actor mesh,
    rollout mesh))``.

    Raises:
      ValueError: one line naming the offending option.
    """
    run_record.check_resumable(cfg, out)
    previous = run_record.read(out)
    tunix_rl.learner_and_config(cfg.algorithm)
    mesh, rollout_mesh = _meshes(cfg)
    _check_accumulation(cfg, mesh)
    check_global_batch(out, previous, batch_size(cfg, mesh))  # --devices changes it
    return previous, (mesh, rollout_mesh)


def _task(cfg: GRPORunConfig, tok, template=None) -> list:
    """The embedded task's problems (:func:`posttrain.rl.arithmetic.problems`).

    Raises:
      ValueError: its longest prompt in ``template`` is over ``max_prompt_length`` tokens.
    """
    task = arithmetic.problems()
    too_long = max(len(tok.encode(p.prompt_in(template))) for p in task)
    if too_long > cfg.max_prompt_length:
        raise ValueError(
            f"max_prompt_length={cfg.max_prompt_length} (--max-prompt-length): the task's "
            f"longest prompt has {too_long} tokens"
        )
    return task


def _meshes(cfg: GRPORunConfig):
    """``(actor mesh, rollout mesh)``; the rollout's is the actor's without
    ``rollout_mesh``.

    Raises:
      ValueError: ``rollout_dtype`` on a Tunix without it, or with one mesh.
    """
    mesh = sharding.make_mesh(cfg.mesh)
    rollout_mesh = mesh if cfg.rollout_mesh is None else sharding.make_mesh(cfg.rollout_mesh)
    if cfg.rollout_dtype and not tunix_rl.rollout_takes_data_type():
        raise ValueError(
            f"rollout_dtype={cfg.rollout_dtype!r} (--rollout-dtype): this google-tunix's "
            "RolloutConfig has no data_type (0.1.2+)"
        )
    if cfg.rollout_dtype and rollout_mesh == mesh:  # Tunix then shares the actor's model
        raise ValueError(
            f"rollout_dtype={cfg.rollout_dtype!r} (--rollout-dtype): the rollout mesh "
            f"{cfg.rollout_mesh} is the actor's, whose parameters it shares; expected "
            "another --rollout-mesh"
        )
    return mesh, rollout_mesh


def _surface(cfg: GRPORunConfig, writer: bool, log_every) -> dict:
    """What the installed Tunix RL does (:func:`posttrain.rl.tunix_rl.surface`), printed
    with ``log_every``; warns of a biased ratio at a temperature other than 1 where its
    trainer computes logps at 1."""
    found = tunix_rl.surface()
    if writer and cfg.temperature != 1.0 and found["trainer logps at rollout temperature"] == "no":
        print(
            f"posttrain grpo: warning: temperature={cfg.temperature}: the installed Tunix "
            "computes the trainer's logps at temperature 1, so the ratio and the KL are "
            "biased (fixed in google-tunix 0.1.7; docs/rl.md)",
            file=sys.stderr,
        )
    if log_every:
        print("Tunix RL: " + "; ".join(f"{k}: {v}" for k, v in found.items()), flush=True)
    return found


def _train(cfg: GRPORunConfig, model, tok, meshes, task, fns, on_built, writer: bool):
    """Builds Tunix's cluster and learner over ``model`` and trains from the step it
    restored on ``task``, ``(problems, template)``; returns ``(trained model, step,
    restored step, history, seconds)``."""
    task, template = task
    out = pathlib.Path(cfg.output)
    rewards_seen: dict[int, dict[str, np.ndarray]] = {}

    def sink(name: str, values: np.ndarray) -> None:  # called inside step global_steps + 1
        rewards_seen.setdefault(int(cluster.global_steps) + 1, {})[name] = values

    recorded = [rewards.recorded(fn, sink) for fn in fns]
    cluster, learner, policies = build_learner(cfg, model, tok, meshes, recorded)
    tap = tunix_cluster.MetricsTap()
    tap.attach(cluster)
    restored = int(cluster.actor_trainer.train_steps)
    tunix_cluster.reshard_syncs_on_device(learner)
    tunix_cluster.sync_rollout(learner)  # a restored actor must not leave the rollout stale
    tunix_cluster.vary_rollout_seed(cluster, cfg.seed)
    if on_built is not None:
        on_built(learner, policies)
    started = time.perf_counter()
    data = arithmetic.batches(task, batch_size(cfg, meshes[0]), cfg.steps, cfg.seed, template)
    try:
        with saves():
            learner.train(data)
    finally:
        history = write_metrics(out, restored, tap, rewards_seen, write=writer)
    seconds = time.perf_counter() - started
    step = int(cluster.actor_trainer.train_steps)
    trained = cluster.actor_trainer.model.model  # the trained one (Tunix may re-place it)
    return trained, step, restored, history, seconds


def _check_accumulation(cfg: GRPORunConfig, mesh) -> None:
    """Raises ValueError (one line) unless ``grad_accum`` divides the step's prompts and
    each micro-batch's completions divide over the mesh's data-parallel shards, or when
    ``grad_accum`` > 1 on a Tunix that would update once per micro-batch."""
    if cfg.grad_accum > 1 and not tunix_rl.accumulates_micro_batches():
        raise ValueError(
            f"grad_accum={cfg.grad_accum} (--grad-accum): this google-tunix's GRPO takes an "
            "optimizer update per micro-batch instead of accumulating them (accumulation "
            "came in 0.1.0); expected 1 on this release"
        )
    batch, shards = batch_size(cfg, mesh), sharding.data_parallel_size(mesh)
    micro = batch // cfg.grad_accum
    if batch % cfg.grad_accum or (micro * cfg.num_generations) % shards:
        raise ValueError(
            f"grad_accum={cfg.grad_accum} (--grad-accum): the step's {batch} prompts "
            f"(x {cfg.num_generations} completions) do not split into {cfg.grad_accum} "
            f"micro-batches over {shards} data-parallel shards; expected a divisor of "
            f"{batch} leaving a multiple of {shards} completions per micro-batch"
        )


def _recorded_before(recorded: dict | None) -> float | None:
    """The held-out reward recorded at the start of the run (its first segment's
    ``evaluation``), or None: a resumed run compares against where it began."""
    segments = (recorded or {}).get("segments") or [{}]
    return (segments[0].get("evaluation") or {}).get("before")
