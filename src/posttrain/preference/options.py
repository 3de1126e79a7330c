"""``posttrain dpo``'s options: :class:`~posttrain.training.options.PeftRunOptions` and what
only preference tuning has."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

from posttrain.config import choices
from posttrain.flags import option
from posttrain.training.options import DEFAULT_MODEL, PeftRunOptions, finite_positive

PreferenceAlgorithm = Literal["dpo", "orpo"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DPORunConfig(PeftRunOptions):
    """Everything one preference run needs; defaults are the embedded run (``qwen3-tiny``
    on the embedded ``pydoc_data`` preference pairs, every device on fsdp).

    Attributes beyond :class:`~posttrain.training.options.PeftRunOptions`:
      data: preference JSONL (:mod:`posttrain.preference.data`); None for the embedded
        pairs.
      eval_data: held-out preference JSONL for the evaluation before and after; None:
        the embedded held-out pairs with the embedded data, no evaluation with ``data``.
      data_shards: split the pairs (train and held-out) into this many interleaved
        shards (pair i in shard ``i % data_shards``), each shuffled on its own; as
        ``posttrain sft``'s (:attr:`posttrain.training.options.SupervisedRunOptions.data_shards`).
      max_prompt_length, max_response_length: tokens of the left-padded prompt and of
        each right-padded completion.
      algorithm: ``dpo`` or ``orpo`` (google-tunix >= 0.1.4).
      beta: DPO's inverse temperature (scales the log-ratios).
      label_smoothing: the DPO (and ORPO odds-ratio) label smoothing, in [0, 0.5).
      lambda_orpo: ORPO's weight of the odds-ratio term.
      lora_rank: LoRA when > 0 (the reference is then the policy with adapters off); 0
        trains every weight (the reference is a frozen copy).
    """

    #: Settings that change what a resumed run computes.
    TRAINING_FIELDS: ClassVar[tuple[str, ...]] = (
        *PeftRunOptions.TRAINING_FIELDS,
        "max_prompt_length",
        "max_response_length",
        "algorithm",
        "beta",
        "label_smoothing",
        "lambda_orpo",
    )

    model: str = option(
        DEFAULT_MODEL, "preset, native directory (e.g. runs/sft/model-step60) or HF directory"
    )
    data: str | None = option(
        None, "preference JSONL: prompt, chosen, rejected (default: embedded)"
    )
    eval_data: str | None = option(
        None,
        "held-out preference JSONL, evaluated before and after (default: the embedded "
        "held-out pairs with the embedded data)",
    )
    per_device_batch_size: int = option(1, "pairs per data-parallel shard")
    steps: int = option(40, "optimizer steps")
    max_prompt_length: int = option(96, "tokens of the left-padded prompt", show_default=False)
    max_response_length: int = option(
        160, "tokens of each right-padded completion", show_default=False
    )
    algorithm: PreferenceAlgorithm = option("dpo", "preference objective", checked=True)
    beta: float = option(0.1, "DPO beta")
    label_smoothing: float = option(0.0, "DPO label smoothing", show_default=False)
    lambda_orpo: float = option(0.1, "ORPO odds-ratio weight")
    learning_rate: float = option(1e-3, "peak learning rate", show_default=False)
    output: str = option("runs/dpo", "run directory; a rerun resumes from its checkpoint")

    def check_fields(self) -> None:
        super().check_fields()
        for name in ("max_prompt_length", "max_response_length"):
            if getattr(self, name) < 1:
                self.bad(name, ">= 1")
        if self.algorithm not in choices(PreferenceAlgorithm):
            self.bad("algorithm", " or ".join(choices(PreferenceAlgorithm)))
        for name in ("beta", "lambda_orpo"):
            if not finite_positive(getattr(self, name)):
                self.bad(name, "a finite value > 0")
        if not (0.0 <= self.label_smoothing < 0.5):
            self.bad("label_smoothing", "a value in [0, 0.5)")
