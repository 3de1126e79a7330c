"""``posttrain distill``'s options: :class:`~posttrain.training.options.SupervisedRunOptions`
(the data, rows and saves of a supervised run, as ``posttrain sft``'s; ``--model`` is the
student) and the teacher and strategy."""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import ClassVar, Literal

from posttrain.flags import option
from posttrain.training.options import SupervisedRunOptions

#: the teacher's parameter dtypes (``--teacher-dtype``)
TeacherDType = Literal["float32", "bfloat16"]

#: where ``posttrain sft`` with no arguments exports its final weights
SFT_EXPORT = "runs/sft/model-step60"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistillRunConfig(SupervisedRunOptions):
    """One distillation run; defaults are the embedded run: the student ``qwen3-tiny``
    one layer deep, the teacher :data:`SFT_EXPORT` if present, else ``llama3-tiny``
    trained on the fly by a short SFT run (``<output>/teacher``), the embedded
    ``pydoc_data`` set with 1 conversation in 8 held out for the KL figure.

    Attributes beyond :class:`~posttrain.training.options.SupervisedRunOptions`:
      teacher: a preset, a native or HF directory, a run's export; None: the default
        above.
      student_layers: keep the first N layers of a preset student (0: all of them).
      strategy: Tunix's strategy: ``logit``, or a feature strategy
        (``feature-pooling``, ``feature-projection``, ``attention-transfer``; unscanned
        layers; :mod:`posttrain.distill.features`).
      temperature, alpha, distill_top_k: Tunix's ``LogitStrategy`` arguments (``alpha``
        weighs every strategy's distillation term; the others are the logit strategy's);
        ``distill_top_k`` > 0 only where the release has it (google-tunix >= 0.1.7).
      teacher_dtype: the teacher's parameters, cast once after loading (bfloat16 halves
        their memory; the forward still computes in the teacher config's ``dtype``).
      teacher_steps: steps of the on-the-fly teacher's SFT run.
    """

    TRAINING_FIELDS: ClassVar[tuple[str, ...]] = (
        *SupervisedRunOptions.TRAINING_FIELDS,
        "teacher",
        "student_layers",
        "strategy",
        "temperature",
        "alpha",
        "distill_top_k",
        "teacher_dtype",
    )
    model: str = option("qwen3-tiny", "the student: a preset, a native or HF directory")
    teacher: str | None = option(
        None,
        f"the teacher: a preset, a native or HF directory (default: {SFT_EXPORT} if "
        "present, else llama3-tiny trained on the fly)",
    )
    student_layers: int = option(1, "keep the first N layers of a preset student (0: all)")
    strategy: str = option(
        "logit",
        "Tunix's distillation strategy: logit, feature-pooling, feature-projection or "
        "attention-transfer",
    )
    temperature: float = option(
        1.0, "softmax temperature of the KL term (Tunix's default: 2; see docs/distill.md)"
    )
    alpha: float = option(0.5, "weight of the KL term; 1 - alpha weighs the task loss")
    distill_top_k: int = option(
        0, "KL over the teacher's top k logits (0: all; google-tunix >= 0.1.7)"
    )
    teacher_dtype: TeacherDType = option(
        "float32", "the teacher's parameter dtype, cast once after loading"
    )
    teacher_steps: int = option(60, "steps of the on-the-fly teacher's SFT run")
    steps: int = option(40, "optimizer steps")
    max_target_length: int = option(128, "tokens per row", show_default=False)
    output: str = option("runs/distill", "run directory; a rerun resumes from its checkpoint")

    def check_fields(self) -> None:
        super().check_fields()
        if self.student_layers < 0:
            self.bad("student_layers", ">= 0 (0 = every layer)")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            self.bad("temperature", "a finite value > 0")
        if not 0.0 <= self.alpha <= 1.0:
            self.bad("alpha", "a value in [0, 1]")
        if self.distill_top_k < 0:
            self.bad("distill_top_k", ">= 0 (0 = every logit)")
        if self.teacher_dtype not in typing.get_args(TeacherDType):
            self.bad("teacher_dtype", " or ".join(typing.get_args(TeacherDType)))
        if self.teacher_steps < 1:
            self.bad("teacher_steps", ">= 1")
