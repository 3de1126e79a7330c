"""``posttrain grpo``'s options: :class:`~posttrain.training.options.RunOptions` and what
only RL has (the rollout, the algorithm, the rewards, the warm-up SFT, the evaluation)."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, Literal

from posttrain.config import choices
from posttrain.flags import option
from posttrain.rl import rewards
from posttrain.training.options import RunOptions, finite_positive, parse_mesh

#: GRPO's family of learners: ``dapo`` since google-tunix 0.1.4, ``drgrpo`` since 0.1.6.
GRPOAlgorithm = Literal["grpo", "dapo", "drgrpo"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class GRPORunConfig(RunOptions):
    """Everything one GRPO run needs; defaults are the embedded run (``qwen3-tiny`` on the
    embedded addition task after a warm-up SFT, every device on fsdp).

    Attributes beyond :class:`~posttrain.training.options.RunOptions`, and what its
    shared ones mean here:
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
      grad_accum: micro-batches per optimizer update: the step's rollout stays one
        batch, and its completions are trained in this many micro-batches whose
        gradients are averaged (Tunix's ``train_micro_batch_size`` = the batch /
        ``grad_accum``); it must divide the batch of prompts.
      learning_rate: Adam's (b2 0.99; :func:`posttrain.training.optimizer.run_adam`),
        constant.
      max_grad_norm: 0 (no clipping) by default, as before the option: GRPO's optimizer
        never clipped.
      lora_rank: LoRA when > 0 (the reference is then the actor with adapters off); 0
        trains every weight (the reference is a frozen copy).
      algorithm: ``grpo``, ``dapo`` (google-tunix >= 0.1.4) or ``drgrpo`` (>= 0.1.6).
      beta: the KL coefficient (None: the algorithm's; DAPO has no KL term).
      epsilon: the clipping range.
      temperature: rollout sampling temperature (> 0).
      max_prompt_length, max_new_tokens: rollout lengths (the KV cache holds both).
      reward: reward functions, built-in names or ``module:function``; summed.
      warmup_steps: SFT steps on the task before GRPO (0: none), a recipe of its own:
        ``posttrain sft``'s defaults (full fine-tuning, peak learning rate 3e-3, clipping
        at 1.0) on 64-token rows; ``learning_rate``, ``max_grad_norm`` and ``lora_rank``
        here are the GRPO steps'.
      warmup_data_shards: the warm-up SFT's ``data_shards``
        (:attr:`posttrain.training.options.SupervisedRunOptions.data_shards`; None: one per process
        slice of its batch). The same value gives the same warm-up on any number of
        processes.
      eval_samples: completions of each task problem in the evaluation before and after
        training (0: no evaluation).
      seed: model init, adapters, data order and rollout sampling.
    """

    #: Settings that change what a resumed run computes.
    TRAINING_FIELDS: ClassVar[tuple[str, ...]] = (
        *RunOptions.TRAINING_FIELDS,
        "rollout_mesh",
        "rollout_dtype",
        "num_generations",
        "algorithm",
        "beta",
        "epsilon",
        "temperature",
        "max_prompt_length",
        "max_new_tokens",
        "reward",
        "warmup_steps",
    )

    mesh: dict[str, int] | None = option(
        None, "actor/reference axis sizes (default: fsdp)", parse=parse_mesh
    )
    rollout_mesh: dict[str, int] | None = option(
        None,
        "rollout axis sizes on the same devices, e.g. data=8 (default: the actor's)",
        parse=parse_mesh,
    )
    rollout_dtype: str | None = option(
        None,
        "float32 or bfloat16: the rollout copy's parameters, cast at each sync; needs "
        "--rollout-mesh and google-tunix >= 0.1.2 (default: the actor's)",
    )
    per_device_batch_size: int = option(2, "prompts per data-parallel shard")
    num_generations: int = option(8, "completions per prompt", show_default=False)
    steps: int = option(150, "GRPO steps")
    learning_rate: float = option(5e-4, "Adam's learning rate, constant", show_default=False)
    max_grad_norm: float = option(
        0.0, "clip the gradient's global norm to this before each update (0: no clipping)"
    )
    algorithm: GRPOAlgorithm = option("grpo", "GRPO learner", checked=True)
    beta: float | None = option(None, "KL coefficient (default: Tunix's)")
    epsilon: float = option(0.2, "clipping range", show_default=False)
    temperature: float = option(1.0, "rollout temperature", show_default=False)
    max_prompt_length: int = option(32, "rollout prompt tokens", show_default=False)
    max_new_tokens: int = option(6, "rollout completion tokens", show_default=False)
    reward: tuple[str, ...] = option(
        rewards.DEFAULT,
        "built-in name (exact_answer, answer_format) or module:function; repeatable "
        "(default: exact_answer and answer_format)",
    )
    warmup_steps: int = option(
        100,
        "SFT steps first (0: none), full fine-tuning at posttrain sft's learning rate and "
        "clipping, whatever GRPO's --learning-rate, --max-grad-norm and --lora-rank",
        show_default=False,
    )
    warmup_data_shards: int | None = option(
        None, "the warm-up SFT's --data-shards (default: one per process slice of the batch)"
    )
    eval_samples: int = option(
        4,
        "completions per task problem in the evaluation before and after (0: none)",
        show_default=False,
    )
    save_every: int = option(10, "checkpoint interval (steps)", show_default=False)
    output: str = option("runs/grpo", "run directory; a rerun resumes from its checkpoint")

    def check_fields(self) -> None:
        super().check_fields()
        self._check_rollout()
        if self.num_generations < 2:
            self.bad("num_generations", ">= 2 (advantages are relative to the group)")
        for name in ("max_prompt_length", "max_new_tokens"):
            if getattr(self, name) < 1:
                self.bad(name, ">= 1")
        if self.warmup_steps < 0:
            self.bad("warmup_steps", ">= 0")
        if self.warmup_data_shards is not None and self.warmup_data_shards < 1:
            self.bad("warmup_data_shards", ">= 1")
        if self.eval_samples < 0:
            self.bad("eval_samples", ">= 0 (0: no evaluation)")
        if not finite_positive(self.temperature):
            self.bad("temperature", "a finite value > 0 (GRPO samples its rollouts)")
        if not (math.isfinite(self.epsilon) and 0 < self.epsilon < 1):
            self.bad("epsilon", "a value in (0, 1)")
        if self.algorithm not in choices(GRPOAlgorithm):
            self.bad("algorithm", " or ".join(choices(GRPOAlgorithm)))
        if self.beta is not None:
            if not (math.isfinite(self.beta) and self.beta >= 0):
                self.bad("beta", "a finite value >= 0")
            if self.algorithm == "dapo":
                self.bad("beta", "unset with --algorithm dapo (DAPO has no KL term)")
        if not self.reward:
            self.bad("reward", "at least one reward function")
        for spec in self.reward:  # imported and called once, before anything is written
            rewards.probe(spec, rewards.resolve(spec))

    def _check_rollout(self) -> None:
        if self.rollout_mesh is not None and any(v < 1 for v in self.rollout_mesh.values()):
            self.bad("rollout_mesh", "axis sizes >= 1")
        if self.rollout_dtype not in (None, "float32", "bfloat16"):
            self.bad("rollout_dtype", "float32 or bfloat16")
        if self.rollout_dtype is not None and self.rollout_mesh is None:
            self.bad(
                "rollout_dtype",
                "--rollout-mesh too (on one mesh the rollout shares the actor's parameters)",
            )
