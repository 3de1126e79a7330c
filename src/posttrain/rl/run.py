"""One GRPO run end to end: warm-up SFT -> policy + reference -> Tunix's cluster and
learner -> outputs. ``run_grpo(GRPORunConfig())`` is what ``posttrain grpo`` does with
no arguments: ``qwen3-tiny`` on the embedded addition task
(:mod:`posttrain.rl.arithmetic`), every device on ``fsdp``.

Output directory (``GRPORunConfig.output``)::

    warmup/           the warm-up SFT run (``posttrain sft`` layout) and its export
    checkpoints/      Tunix's checkpoints of the actor (LoRA only when LoRA is on); a
                      rerun with the same settings resumes from the latest
    run.json          settings, and per start: the step resumed from and the evaluation
    metrics.jsonl     one record per GRPO step (see :func:`step_record`), each step once
    tensorboard/      Tunix's metrics
    model-step<N>/    native safetensors of the final policy (LoRA merged) ...
    adapter-step<N>/  ... and its adapters, when LoRA is on
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import sys
import time

import numpy as np

from posttrain import atomic, distributed, sharding
from posttrain.rl import arithmetic, rewards

#: Settings that change what a resumed run computes.
TRAINING_FIELDS = (
    "model",
    "tokenizer",
    "mesh",
    "rollout_mesh",
    "rollout_dtype",
    "per_device_batch_size",
    "num_generations",
    "steps",
    "learning_rate",
    "lora_rank",
    "lora_alpha",
    "algorithm",
    "beta",
    "epsilon",
    "temperature",
    "max_prompt_length",
    "max_new_tokens",
    "reward",
    "warmup_steps",
    "seed",
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GRPORunConfig:
    """Everything one GRPO run needs; defaults are the embedded run.

    Attributes:
      model: preset, native or HF directory (as ``posttrain sft --model``).
      tokenizer: ``tokenizer.json``; None for the embedded byte tokenizer.
      mesh: the actor's and reference's axis sizes; None puts every device on fsdp.
      rollout_mesh: the rollout's axis sizes (same devices, another layout; weights
        are synced every step); None shares the actor's mesh and model.
      rollout_dtype: ``float32`` or ``bfloat16``: the rollout copy's parameter dtype
        (Tunix's ``RolloutConfig.data_type``, google-tunix 0.1.2+; each sync casts the
        actor's parameters to it); needs ``rollout_mesh`` (on one mesh the rollout
        shares the actor's parameters). None: the actor's dtype.
      per_device_batch_size: prompts per data-parallel shard of the actor mesh; the
        global batch is this x its data-parallel size, x ``num_generations``
        completions.
      num_generations: G, completions per prompt (>= 2).
      steps: GRPO steps (one rollout and one optimizer update each).
      learning_rate: AdamW's, constant.
      lora_rank, lora_alpha: LoRA on the projections when rank > 0 (the reference is
        then the actor with adapters off); 0 trains every weight (the reference is a
        frozen copy).
      algorithm: ``grpo``, ``dapo`` (google-tunix >= 0.1.4) or ``drgrpo`` (>= 0.1.6).
      beta: the KL coefficient (None: the algorithm's; DAPO has no KL term).
      epsilon: the clipping range.
      temperature: rollout sampling temperature (> 0).
      max_prompt_length, max_new_tokens: rollout lengths (the KV cache holds both).
      reward: reward functions, built-in names or ``module:function``; summed.
      warmup_steps: SFT steps on the task before GRPO (0: none).
      warmup_data_shards: the warm-up SFT's ``data_shards``
        (:attr:`posttrain.sft.run.SFTConfig.data_shards`; None: one per process slice
        of its batch). The same value gives the same warm-up on any number of processes.
      eval_samples: completions of each task problem in the evaluation before and after
        training (0: no evaluation).
      seed: model init, adapters, data order and rollout sampling.
      save_every: checkpoint interval in steps.
      stop_after: stop at this step (a checkpoint is written there); a rerun with the
        same output resumes, as after an interruption.
      output: run directory (see the module docstring).
    """

    model: str = "qwen3-tiny"
    tokenizer: str | None = None
    mesh: dict[str, int] | None = None
    rollout_mesh: dict[str, int] | None = None
    rollout_dtype: str | None = None
    per_device_batch_size: int = 2
    num_generations: int = 8
    steps: int = 150
    learning_rate: float = 5e-4
    lora_rank: int = 0
    lora_alpha: float | None = None
    algorithm: str = "grpo"
    beta: float | None = None
    epsilon: float = 0.2
    temperature: float = 1.0
    max_prompt_length: int = 32
    max_new_tokens: int = 6
    reward: tuple[str, ...] = rewards.DEFAULT
    warmup_steps: int = 100
    warmup_data_shards: int | None = None
    eval_samples: int = 4
    seed: int = 0
    save_every: int = 10
    stop_after: int | None = None
    output: str = "runs/grpo"

    def check(self) -> None:
        """Raises ValueError naming the first bad field (and its ``posttrain grpo`` flag);
        nothing is read or written before this passes."""
        from posttrain.rl.tunix_rl import ALGORITHMS
        from posttrain.sft.run import check_output_dir

        def bad(name: str, expected: str):
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{name}={getattr(self, name)!r} ({flag}): expected {expected}")

        for name in ("per_device_batch_size", "steps", "save_every", "max_new_tokens"):
            if getattr(self, name) < 1:
                bad(name, ">= 1")
        if self.num_generations < 2:
            bad("num_generations", ">= 2 (advantages are relative to the group)")
        if self.max_prompt_length < 1:
            bad("max_prompt_length", ">= 1")
        if self.warmup_steps < 0:
            bad("warmup_steps", ">= 0")
        if self.warmup_data_shards is not None and self.warmup_data_shards < 1:
            bad("warmup_data_shards", ">= 1")
        if self.eval_samples < 0:
            bad("eval_samples", ">= 0 (0: no evaluation)")
        if self.stop_after is not None and self.stop_after < 1:
            bad("stop_after", ">= 1")
        if self.lora_rank < 0:
            bad("lora_rank", ">= 0 (0 = full fine-tuning)")
        if self.lora_alpha is not None and not (
            math.isfinite(self.lora_alpha) and self.lora_alpha > 0
        ):
            bad("lora_alpha", "a finite value > 0")
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            bad("learning_rate", "a finite value > 0")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            bad("temperature", "a finite value > 0 (GRPO samples its rollouts)")
        if not (math.isfinite(self.epsilon) and 0 < self.epsilon < 1):
            bad("epsilon", "a value in (0, 1)")
        if self.algorithm not in ALGORITHMS:
            bad("algorithm", " or ".join(ALGORITHMS))
        if self.beta is not None:
            if not (math.isfinite(self.beta) and self.beta >= 0):
                bad("beta", "a finite value >= 0")
            if self.algorithm == "dapo":
                bad("beta", "unset with --algorithm dapo (DAPO has no KL term)")
        if self.seed < 0:
            bad("seed", "a non-negative integer")
        if not self.reward:
            bad("reward", "at least one reward function")
        for spec in self.reward:
            rewards.resolve(spec)
        for name in ("mesh", "rollout_mesh"):
            value = getattr(self, name)
            if value is not None and any(v < 1 for v in value.values()):
                bad(name, "axis sizes >= 1")
        if self.rollout_dtype not in (None, "float32", "bfloat16"):
            bad("rollout_dtype", "float32 or bfloat16")
        if self.rollout_dtype is not None and self.rollout_mesh is None:
            bad(
                "rollout_dtype",
                "--rollout-mesh too (on one mesh the rollout shares the actor's parameters)",
            )
        check_output_dir(self.output)

    def training_settings(self) -> dict:
        out = {k: getattr(self, k) for k in TRAINING_FIELDS}
        out["reward"] = list(self.reward)
        return out


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


def _mesh_text(mesh) -> str:
    return ",".join(f"{a}={s}" for a, s in mesh.shape.items() if s > 1) or "one device"


def _check_resumable(cfg: GRPORunConfig, out: pathlib.Path) -> dict | None:
    path = out / "run.json"
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        settings = record["settings"]
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path}: not a posttrain grpo run record ({err})") from None
    current = json.loads(json.dumps(cfg.training_settings()))
    changed = [k for k in TRAINING_FIELDS if settings.get(k) != current[k]]
    if changed:
        k = changed[0]
        raise ValueError(
            f"output {str(out)!r} holds a run with {k}={settings.get(k)!r}, not "
            f"{current[k]!r}; use another --output to start a new run"
        )
    return record


def evaluate(model, tok, problems, cfg: GRPORunConfig, fns) -> float:
    """The policy's mean summed reward on ``problems``: ``cfg.eval_samples`` completions
    each, sampled at the rollout temperature with a fixed seed (``cfg.seed``), so two
    evaluations of the same weights agree and two policies see the same random draws."""
    from posttrain.generate import SamplingConfig, generate

    repeated = [p for p in problems for _ in range(cfg.eval_samples)]
    prompts = [tok.encode(p.prompt) for p in repeated]
    sampling = SamplingConfig(
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        seed=cfg.seed,
        eos_ids=(tok.eos_id(),),
        pad_id=tok.pad_id(),
    )
    gen = generate(model, prompts, sampling)
    completions = [
        tok.decode([t for t in gen.row(i) if t != tok.eos_id()]) for i in range(len(repeated))
    ]
    columns = {"answer": [p.answer for p in repeated], "mode": "eval"}
    total = np.zeros(len(repeated))
    for fn in fns:
        total += np.asarray(
            fn(prompts=[p.prompt for p in repeated], completions=completions, **columns), float
        )
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


def step_record(step: int, tunix: dict, rewards_by_fn: dict, tap) -> dict:
    """One ``metrics.jsonl`` record: ``step``; ``reward/<fn>/mean|std`` per function and
    ``reward/total/mean|std``; Tunix's ``loss``, ``kl``, ``pg_clipfrac`` and
    ``completions/mean_length`` where the release logs them; rollout tokens and
    tokens/s; the step's wall time."""
    record: dict = {"step": step}
    total = None
    for name, values in rewards_by_fn.items():
        record[f"reward/{name}/mean"] = float(np.mean(values))
        record[f"reward/{name}/std"] = float(np.std(values))
        total = values if total is None else total + values
    if total is not None:
        record["reward/total/mean"] = float(np.mean(total))
        record["reward/total/std"] = float(np.std(total))
    for key in ("loss", "kl", "pg_clipfrac", "completions/mean_length"):
        for name, value in tunix.items():
            if name == key or name.endswith("/" + key):
                record[key] = value
                break
    seconds = tap.rollout_seconds.get(step - 1)
    if seconds:
        record["rollout_tokens"] = tap.rollout_tokens[step - 1]
        record["rollout_tokens_per_s"] = tap.rollout_tokens[step - 1] / seconds
    return record


def progress_line(record: dict) -> str:
    """``step 15: reward 0.414 (exact_answer 0.180, answer_format 0.234), kl 0.193, ...``"""
    per_fn = ", ".join(
        f"{k.split('/')[1]} {v:.3f}"
        for k, v in record.items()
        if k.startswith("reward/") and k.endswith("/mean") and k != "reward/total/mean"
    )
    parts = [f"step {record['step']}: reward {record.get('reward/total/mean', float('nan')):.3f}"]
    parts[0] += f" ({per_fn})" if per_fn else ""
    if "kl" in record:
        parts.append(f"kl {record['kl']:.3f}")
    if "completions/mean_length" in record:
        parts.append(f"{record['completions/mean_length']:.1f} tokens per completion")
    if "rollout_tokens_per_s" in record:
        parts.append(f"rollout {record['rollout_tokens_per_s']:,.0f} tokens/s")
    return ", ".join(parts)


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
    import jax.numpy as jnp
    import optax
    from tunix.sft import metrics_logger

    from posttrain import _compat
    from posttrain.loading import export_final, load_trainable
    from posttrain.rl import tunix_rl
    from posttrain.rl.policy import TunixPolicy, reference_of
    from posttrain.sft.tokenizer import load_tokenizer
    from posttrain.tunix_sampler import TunixTokenizer

    cfg.check()
    # Across processes, process 0 alone writes metrics, progress, run.json and exports.
    writer = distributed.is_writer()
    log_every = log_every if writer else None
    out = pathlib.Path(cfg.output)
    previous = _check_resumable(cfg, out)
    tunix_rl.learner_and_config(cfg.algorithm)  # a missing algorithm fails before work
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
    batch = cfg.per_device_batch_size * sharding.data_parallel_size(mesh)
    fns = [rewards.resolve(spec) for spec in cfg.reward]
    tok = TunixTokenizer(load_tokenizer(cfg.tokenizer))
    task = arithmetic.problems()
    too_long = max(len(tok.encode(p.prompt)) for p in task)
    if too_long > cfg.max_prompt_length:
        raise ValueError(
            f"max_prompt_length={cfg.max_prompt_length} (--max-prompt-length): the task's "
            f"longest prompt has {too_long} tokens"
        )
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
    actor, reference = TunixPolicy(model), TunixPolicy(reference_of(model))

    rewards_seen: dict[int, dict[str, np.ndarray]] = {}

    def sink(name: str, values: np.ndarray) -> None:  # called inside step global_steps + 1
        rewards_seen.setdefault(int(cluster.global_steps) + 1, {})[name] = values

    recorded = [rewards.recorded(fn, sink) for fn in fns]
    training = tunix_rl.training_config(
        actor_optimizer=optax.adamw(cfg.learning_rate, b2=0.99, weight_decay=0.0),
        eval_every_n_steps=cfg.steps + 1,
        max_steps=min(cfg.steps, cfg.stop_after or cfg.steps),
        mini_batch_size=batch,
        micro_batch_size=batch,
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
        eos_tokens=[tok.eos_id()],
        **({"data_type": jnp.dtype(cfg.rollout_dtype)} if cfg.rollout_dtype else {}),
    )
    algo = tunix_rl.algo_config(
        cfg.algorithm, num_generations=cfg.num_generations, beta=cfg.beta, epsilon=cfg.epsilon
    )
    # Our mesh for tracing, not JAX's mesh context: Orbax's eager per-shard copies fail
    # under it on jax 0.7-0.8 (as in SFTTrainer.train).
    with sharding.use_mesh(mesh, jax_context=False):
        before = previous["evaluations"][0]["before"] if previous else None
        if before is None and cfg.eval_samples:
            before = evaluate(model, tok, task, cfg, fns)
        cluster = tunix_rl.cluster(
            actor=actor,
            reference=reference,
            tokenizer=tok,
            meshes={"actor": mesh, "reference": mesh, "rollout": rollout_mesh},
            training=training,
            rollout=rollout,
        )
        learner = tunix_rl.learner(cfg.algorithm, cluster, algo, recorded, seed=None)
        tunix_rl.place_actor_optimizer(cluster, mesh)
        moe = model.config.moe
        tunix_rl.with_moe_aux_loss(cluster.actor_trainer, moe.aux_loss_weight if moe else 0.0)
        tap = tunix_rl.MetricsTap()
        tap.attach(cluster)
        restored = int(cluster.actor_trainer.train_steps)
        tunix_rl.reshard_syncs_on_device(learner)
        tunix_rl.sync_rollout(learner)  # a restored actor must not leave the rollout stale
        tunix_rl.vary_rollout_seed(cluster, cfg.seed)
        if on_built is not None:
            on_built(learner, (actor, reference))
        started = time.perf_counter()
        data = arithmetic.batches(task, batch, cfg.steps, cfg.seed)
        try:
            with _saves():
                learner.train(data)
        finally:
            history = _write_metrics(out, restored, tap, rewards_seen, write=writer)
        seconds = time.perf_counter() - started
        step = int(cluster.actor_trainer.train_steps)
        model = cluster.actor_trainer.model.model  # the trained one (Tunix may re-place it)
        after = evaluate(model, tok, task, cfg, fns) if cfg.eval_samples else None
    exported = export_final(model, out, step)
    if writer:
        _record(out, cfg, previous, restored, before, after, step, seconds, found)
    if log_every:
        for record in history[log_every - 1 :: log_every]:
            print(progress_line(record), flush=True)
    return GRPOResult(history, out, step, before, after, exported, cfg.eval_samples)


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


def _write_metrics(
    out: pathlib.Path, restored: int, tap, rewards_seen, *, write: bool = True
) -> list[dict]:
    """Appends the steps after ``restored`` to ``metrics.jsonl`` (dropping any a killed
    run logged past its checkpoint; ``write=False``: only computes them); returns them."""
    path = out / "metrics.jsonl"
    kept = []
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip() and json.loads(line)["step"] <= restored:
                kept.append(line)
    steps = sorted(s for s in set(tap.records) | set(rewards_seen) if s > restored)
    history = [step_record(s, tap.records.get(s, {}), rewards_seen.get(s, {}), tap) for s in steps]
    lines = kept + [json.dumps(r) for r in history]
    if write:
        atomic.write_text(path, "\n".join(lines) + ("\n" if lines else ""))
    return history


def _record(out, cfg, previous, restored, before, after, step, seconds, found) -> None:
    record = previous or {"settings": json.loads(json.dumps(cfg.training_settings()))}
    record["tunix_rl"] = found
    record.setdefault("evaluations", []).append(
        {"resumed_from": restored, "step": step, "before": before, "after": after}
    )
    record["seconds"] = record.get("seconds", 0.0) + seconds
    atomic.write_text(out / "run.json", json.dumps(record, indent=2) + "\n")
