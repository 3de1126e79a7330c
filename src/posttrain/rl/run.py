"""One GRPO run end to end: warm-up SFT -> policy + reference -> Tunix's cluster and
learner -> outputs. ``run_grpo(GRPORunConfig())`` is what ``posttrain grpo`` does with
no arguments: ``qwen3-tiny`` on the embedded addition task
(:mod:`posttrain.rl.arithmetic`), every device on ``fsdp``.

Output directory (``GRPORunConfig.output``)::

    warmup/           the warm-up SFT run (``posttrain sft`` layout) and its export
    checkpoints/      Tunix's checkpoints of the actor (LoRA only when LoRA is on); a
                      rerun with the same settings resumes from the latest
    run.json          settings, and per start: the step resumed from and the evaluation
    metrics.jsonl     one record per GRPO step (:func:`posttrain.rl.metrics.step_record`),
                      each step once
    tensorboard/      Tunix's metrics
    model-step<N>/    native safetensors of the final policy (LoRA merged) ...
    adapter-step<N>/  ... and its adapters, when LoRA is on
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
import time

import numpy as np

from posttrain import atomic, distributed, sharding
from posttrain.rl import arithmetic, rewards
from posttrain.rl.metrics import progress_line, step_record, write_metrics
from posttrain.rl.options import GRPORunConfig
from posttrain.runs import record as run_record

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


def _check_resumable(cfg: GRPORunConfig, out: pathlib.Path) -> dict | None:
    record = run_record.read(out)  # None, or an object whose keys have their types
    if record is None:
        return None
    if "settings" not in record:
        raise ValueError(f"{out / 'run.json'}: not a posttrain grpo run record (no 'settings')")
    settings = record["settings"]
    current = json.loads(json.dumps(cfg.training_settings()))
    changed = [k for k in cfg.TRAINING_FIELDS if settings.get(k) != current[k]]
    if changed:
        k = changed[0]
        raise ValueError(
            f"output {str(out)!r} holds a run with {k}={settings.get(k)!r}, not "
            f"{current[k]!r}; use another --output to start a new run"
        )
    return record


def evaluate(model, tok, problems, cfg: GRPORunConfig, fns, template=None) -> float:
    """The policy's mean summed reward on ``problems``: ``cfg.eval_samples`` completions
    each, sampled at the rollout temperature with a fixed seed (``cfg.seed``), so two
    evaluations of the same weights agree and two policies see the same random draws.
    Prompts in ``template`` (default: the built-in ChatML); a completion stops at any of
    ``tok.stop_ids`` (the checkpoint's), which its text leaves out."""
    from posttrain.generate import SamplingConfig, generate

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
    gen = generate(model, prompts, sampling)
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
    from posttrain.sft.run import SFTConfig, run_sft

    if cfg.warmup_steps == 0:
        return cfg.model
    done = out / "warmup" / f"model-step{cfg.warmup_steps}"
    if done.is_dir():  # finished by an earlier start of this run
        return str(done)
    data = out / "warmup" / "data.jsonl"
    distributed.on_writer(
        lambda: arithmetic.write_warmup_jsonl(problems, data, repeats=4), "write the warm-up data"
    )
    sft = SFTConfig(
        model=cfg.model,
        data=str(data),
        tokenizer=cfg.tokenizer,
        chat_template=cfg.chat_template,
        mesh=cfg.mesh,
        steps=cfg.warmup_steps,
        max_target_length=64,
        learning_rate=3e-3,
        seed=cfg.seed,
        data_shards=cfg.warmup_data_shards,
        save_every=cfg.warmup_steps,
        sync_saves=True,
        output=str(out / "warmup"),
    )
    result = run_sft(sft, log_every=log_every)
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
    import jax

    from posttrain.loading import load_trainable
    from posttrain.rl import tunix_rl
    from posttrain.runs.checks import check_global_batch
    from posttrain.runs.export import export_final
    from posttrain.runs.formats import run_tokenizer_and_formats
    from posttrain.tunix_sampler import TunixTokenizer

    cfg.check()
    # Across processes, process 0 alone writes metrics, progress, run.json and exports.
    writer = distributed.is_writer()
    log_every = log_every if writer else None
    out = pathlib.Path(cfg.output)
    previous = _check_resumable(cfg, out)
    tunix_rl.learner_and_config(cfg.algorithm)  # a missing algorithm fails before work
    mesh, rollout_mesh = _meshes(cfg)
    _check_accumulation(cfg, mesh)
    check_global_batch(out, previous, _batch(cfg, mesh))  # --devices changes it
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
        before = previous["evaluations"][0]["before"] if previous else None
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
            **formats.facts(),
            "global_batch": _batch(cfg, mesh),
            "devices": jax.device_count(),
        }
        _record(out, cfg, previous, restored, before, after, step, seconds, found, facts)
    if log_every:
        for record in history[log_every - 1 :: log_every]:
            print(progress_line(record), flush=True)
    return GRPOResult(history, out, step, before, after, exported, cfg.eval_samples)


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
    from posttrain.rl import tunix_rl

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
    from posttrain.rl import tunix_rl

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


def _configs(cfg: GRPORunConfig, out: pathlib.Path, mesh, eos_ids):
    """Tunix's ``(training config, rollout config, algorithm config)`` of the run; the
    rollout stops at any of ``eos_ids``."""
    import jax.numpy as jnp
    import optax
    from tunix.sft import metrics_logger

    from posttrain import _compat
    from posttrain.rl import tunix_rl

    batch = _batch(cfg, mesh)
    training = tunix_rl.training_config(
        actor_optimizer=optax.adamw(cfg.learning_rate, b2=0.99, weight_decay=0.0),
        eval_every_n_steps=cfg.steps + 1,
        max_steps=min(cfg.steps, cfg.stop_after or cfg.steps),
        mini_batch_size=batch,
        micro_batch_size=batch // cfg.grad_accum,
        # one rollout (and one logps pass) over the whole batch, whatever the
        # accumulation: Tunix's default is the train micro-batch, which would sample
        # another batch shape and so other completions
        rollout_micro_batch_size=batch,
        compute_logps_micro_batch_size=batch,
        checkpoint_root_directory=str((out / "checkpoints").resolve()),
        checkpointing_options=_compat.interval_checkpoint_options(
            min(cfg.save_every, cfg.stop_after or cfg.save_every),
            max_to_keep=2,
            enable_async_checkpointing=False,
        ),
        # One TensorBoard file, process 0's: Tunix's logger opens one in every process
        # it is given options in (and only process 0's gets the scalars).
        metrics_logging_options=metrics_logger.MetricsLoggerOptions(
            log_dir=str(out / "tensorboard"), flush_every_n_steps=10
        )
        if distributed.is_writer()
        else None,
        data_sharding_axis=tuple(sharding.batch_spec(mesh))[:1] or ("fsdp",),
    )
    rollout = tunix_rl.rollout_config(
        max_tokens_to_generate=cfg.max_new_tokens,
        max_prompt_length=cfg.max_prompt_length,
        kv_cache_size=_pow2(cfg.max_prompt_length) + cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_p=1.0,
        top_k=None,
        seed=cfg.seed,
        eos_tokens=list(eos_ids),
        **({"data_type": jnp.dtype(cfg.rollout_dtype)} if cfg.rollout_dtype else {}),
    )
    algo = tunix_rl.algo_config(
        cfg.algorithm, num_generations=cfg.num_generations, beta=cfg.beta, epsilon=cfg.epsilon
    )
    return training, rollout, algo


def _train(cfg: GRPORunConfig, model, tok, meshes, task, fns, on_built, writer: bool):
    """Builds Tunix's cluster and learner over ``model`` and trains from the step it
    restored on ``task``, ``(problems, template)``; returns ``(trained model, step,
    restored step, history, seconds)``."""
    from posttrain.rl import tunix_cluster, tunix_rl
    from posttrain.rl.policy import TunixPolicy, reference_of

    mesh, rollout_mesh = meshes
    task, template = task
    out = pathlib.Path(cfg.output)
    training, rollout, algo = _configs(cfg, out, mesh, tok.stop_ids)
    rewards_seen: dict[int, dict[str, np.ndarray]] = {}

    def sink(name: str, values: np.ndarray) -> None:  # called inside step global_steps + 1
        rewards_seen.setdefault(int(cluster.global_steps) + 1, {})[name] = values

    actor, reference = TunixPolicy(model), TunixPolicy(reference_of(model))
    cluster = tunix_rl.cluster(
        actor=actor,
        reference=reference,
        tokenizer=tok,
        meshes={"actor": mesh, "reference": mesh, "rollout": rollout_mesh},
        training=training,
        rollout=rollout,
    )
    recorded = [rewards.recorded(fn, sink) for fn in fns]
    learner = tunix_rl.learner(cfg.algorithm, cluster, algo, recorded, seed=None)
    tunix_cluster.place_actor_optimizer(cluster, mesh)
    moe = model.config.moe
    tunix_rl.with_moe_aux_loss(cluster.actor_trainer, moe.aux_loss_weight if moe else 0.0)
    tap = tunix_cluster.MetricsTap()
    tap.attach(cluster)
    restored = int(cluster.actor_trainer.train_steps)
    tunix_cluster.reshard_syncs_on_device(learner)
    tunix_cluster.sync_rollout(learner)  # a restored actor must not leave the rollout stale
    tunix_cluster.vary_rollout_seed(cluster, cfg.seed)
    if on_built is not None:
        on_built(learner, (actor, reference))
    started = time.perf_counter()
    data = arithmetic.batches(task, _batch(cfg, mesh), cfg.steps, cfg.seed, template)
    try:
        with _saves():
            learner.train(data)
    finally:
        history = write_metrics(out, restored, tap, rewards_seen, write=writer)
    seconds = time.perf_counter() - started
    step = int(cluster.actor_trainer.train_steps)
    trained = cluster.actor_trainer.model.model  # the trained one (Tunix may re-place it)
    return trained, step, restored, history, seconds


def _check_accumulation(cfg: GRPORunConfig, mesh) -> None:
    """Raises ValueError (one line) unless ``grad_accum`` divides the step's prompts and
    each micro-batch's completions divide over the mesh's data-parallel shards."""
    batch, shards = _batch(cfg, mesh), sharding.data_parallel_size(mesh)
    micro = batch // cfg.grad_accum
    if batch % cfg.grad_accum or (micro * cfg.num_generations) % shards:
        raise ValueError(
            f"grad_accum={cfg.grad_accum} (--grad-accum): the step's {batch} prompts "
            f"(x {cfg.num_generations} completions) do not split into {cfg.grad_accum} "
            f"micro-batches over {shards} data-parallel shards; expected a divisor of "
            f"{batch} leaving a multiple of {shards} completions per micro-batch"
        )


def _batch(cfg: GRPORunConfig, mesh) -> int:
    """Prompts per GRPO step: ``per_device_batch_size`` x the mesh's data-parallel size."""
    return cfg.per_device_batch_size * sharding.data_parallel_size(mesh)


def _saves():
    """Orbax writes each replicated array from one replica in one CPU process (its
    replica-parallel slicing is pure overhead there, and on jax 0.7 its eager slices fail
    inside Tunix's ``with mesh:``; :func:`posttrain._compat.single_replica_array_saves`)."""
    import contextlib

    import jax

    from posttrain import _compat

    if jax.default_backend() == "cpu" and jax.process_count() == 1:
        return _compat.single_replica_array_saves()
    return contextlib.nullcontext()


def _pow2(n: int) -> int:
    """Tunix's sampler pads prompts to the next power of two of the longest."""
    return 1 << max(0, (n - 1).bit_length())


def _record(out, cfg, previous, restored, before, after, step, seconds, found, facts) -> None:
    record = previous or {"settings": json.loads(json.dumps(cfg.training_settings()))}
    record["tunix_rl"] = found
    record.update(facts)  # the template's sha256: a resume in another is refused
    record.setdefault("evaluations", []).append(
        {"resumed_from": restored, "step": step, "before": before, "after": after}
    )
    record["seconds"] = record.get("seconds", 0.0) + seconds
    atomic.write_text(out / "run.json", json.dumps(record, indent=2) + "\n")
