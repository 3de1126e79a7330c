"""The options every training run shares, extended by each workflow's own (as Tunix's
``DPOTrainingConfig`` extends ``TrainingConfig``):

- :class:`RunOptions`: model, tokenizer, mesh, batch, gradient accumulation, steps,
  learning rate, gradient clipping, LoRA, seed, save cadence, stop, output (every
  workflow: ``posttrain sft``, ``dpo``, ``grpo`` and ``distill``);
- :class:`PeftRunOptions`: a dataset file, its shards, the overflow rule, the warm-up of
  the learning-rate schedule and the decoder options (``posttrain sft``, ``dpo`` and
  ``distill``, whose trainers are Tunix ``PeftTrainer``\\ s);
- :class:`SupervisedRunOptions`: chat rows of a fixed length, packed or not, and how
  Orbax saves (a supervised run, :mod:`posttrain.training.supervised`: ``posttrain sft``,
  its ``--vision`` runs, ``distill``, GRPO's warm-up).

Each field is also its command-line flag (:mod:`posttrain.flags`); a workflow that wants
another default redeclares the field. ``check()`` raises one line naming the first bad
field and its flag; nothing is read or written before it passes.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import ClassVar, Literal, NoReturn

from posttrain.config import AttentionKernel, AttentionKernelChoice, RematPolicy, choices
from posttrain.flags import flag_of, option
from posttrain.training.directory import check_output_dir

DEFAULT_MODEL = "qwen3-tiny"
#: ``posttrain sft --vision``'s model when no ``--model`` is given
VISION_MODEL = "gemma4-vision-tiny"


class NotGiven(str):
    """A default that stands for "not given": it reads (``--help``, argparse, ``==``) as
    its text, but is told apart from that text given on purpose. :class:`RunOptions`
    resolves it once, at construction (``__post_init__``), into the workflow's value, a
    plain ``str``; so ``posttrain sft --vision --model qwen3-tiny`` keeps ``qwen3-tiny``
    while ``posttrain sft --vision`` alone trains the vision preset."""

    __slots__ = ()


#: ``--model``'s default before resolution: :meth:`RunOptions.default_model`.
MODEL_NOT_GIVEN = NotGiven(DEFAULT_MODEL)
#: What to do with an example longer than a row.
Overflow = Literal["truncate", "reject"]
ReplicaParallelSaves = Literal["auto", "on", "off"]


def parse_mesh(text: str) -> dict[str, int]:
    """``--mesh data=2,fsdp=4`` -> ``{"data": 2, "fsdp": 4}``
    (:func:`posttrain.sharding.parse_mesh_spec`; JAX is imported only here)."""
    from posttrain import sharding

    return sharding.parse_mesh_spec(text)


def finite_positive(value: float) -> bool:
    return math.isfinite(value) and value > 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunOptions:
    """What every training run needs; see each field's help."""

    #: Settings that change what a resumed run computes: a rerun into the same output
    #: with another value is refused (:func:`posttrain.training.record.check_resumable`);
    #: the others (output, save cadence, stop) may change between segments. The chat
    #: template is compared by content, not path (:mod:`posttrain.training.formats`).
    TRAINING_FIELDS: ClassVar[tuple[str, ...]] = (
        "model",
        "tokenizer",
        "mesh",
        "per_device_batch_size",
        "grad_accum",
        "steps",
        "learning_rate",
        "max_grad_norm",
        "lora_rank",
        "lora_alpha",
        "seed",
    )

    model: str = option(MODEL_NOT_GIVEN, "preset name, native or HF checkpoint directory")
    tokenizer: str | None = option(
        None, "tokenizer.json (default: the HF dir's, else the byte tokenizer)"
    )
    chat_template: str | None = option(
        None,
        "a Jinja chat template file, or chatml (default: the model's or tokenizer's own, "
        "else ChatML); run.json records its sha256, a resume must keep it",
    )
    mesh: dict[str, int] | None = option(
        None, "axis sizes, e.g. data=2,fsdp=4 (default: every device on fsdp)", parse=parse_mesh
    )
    per_device_batch_size: int = option(1, "global batch = this x data-parallel size")
    grad_accum: int = option(1, "micro-batches per step", show_default=False)
    steps: int = option(60, "optimizer steps")
    learning_rate: float = option(3e-3, "peak learning rate", show_default=False)
    max_grad_norm: float = option(
        1.0, "clip the gradient's global norm to this before each update (0: no clipping)"
    )
    lora_rank: int = option(0, "LoRA rank (0: full fine-tuning)", show_default=False)
    lora_alpha: float | None = option(None, "default 2 x rank")
    seed: int = option(0, "model init, adapter init, data order", show_default=False)
    save_every: int = option(50, "checkpoint interval (steps)", show_default=False)
    stop_after: int | None = option(
        None, "stop at this step; rerun with the same --output to resume"
    )
    output: str = option("runs/sft", "run directory; a rerun resumes from its checkpoint")

    def __post_init__(self) -> None:
        if isinstance(self.model, NotGiven):  # the one place "not given" is resolved
            object.__setattr__(self, "model", str(self.default_model()))

    def default_model(self) -> str:
        """The model of a run given no ``--model``: :data:`DEFAULT_MODEL`; a workflow
        whose default depends on its other options overrides this."""
        return DEFAULT_MODEL

    def bad(self, name: str, expected: str) -> NoReturn:
        """Raises the one-line ValueError of a bad field: its name, value and flag."""
        flag = flag_of(type(self), name)
        raise ValueError(f"{name}={getattr(self, name)!r} ({flag}): expected {expected}")

    def check(self) -> None:
        """Raises ValueError naming the first bad field (and its flag), the output path
        last (:func:`~posttrain.training.directory.check_output_dir`)."""
        self.check_fields()
        check_output_dir(self.output)

    def check_fields(self) -> None:
        """The fields' own rules; a workflow's options add theirs after calling this."""
        for name in ("per_device_batch_size", "grad_accum", "steps", "save_every"):
            if getattr(self, name) < 1:
                self.bad(name, ">= 1")
        if self.mesh is not None and any(v < 1 for v in self.mesh.values()):
            self.bad("mesh", "axis sizes >= 1")
        if self.stop_after is not None and self.stop_after < 1:
            self.bad("stop_after", ">= 1")
        if self.lora_rank < 0:
            self.bad("lora_rank", ">= 0 (0 = full fine-tuning)")
        if self.lora_alpha is not None and not finite_positive(self.lora_alpha):
            self.bad("lora_alpha", "a finite value > 0")
        if not finite_positive(self.learning_rate):
            self.bad("learning_rate", "a finite value > 0")
        if not (math.isfinite(self.max_grad_norm) and self.max_grad_norm >= 0):
            self.bad("max_grad_norm", "a finite value >= 0 (0: no clipping)")
        if self.seed < 0:
            self.bad("seed", "a non-negative integer")
        if self.chat_template not in (None, "chatml") and not os.path.isfile(self.chat_template):
            self.bad("chat_template", "a Jinja chat template file, or chatml")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PeftRunOptions(RunOptions):
    """A run over a dataset file through a Tunix ``PeftTrainer`` (``sft``, ``dpo``)."""

    TRAINING_FIELDS: ClassVar[tuple[str, ...]] = (
        *RunOptions.TRAINING_FIELDS,
        "data",
        "overflow",
        "warmup_steps",
        "scan_layers",
    )

    data: str | None = option(None, "data JSONL file (default: the embedded set)")
    data_shards: int | None = option(
        None,
        "split the data into N shards, each shuffled on its own; each process tokenises "
        "only its shards (default: one per process slice of the batch)",
    )
    overflow: Overflow = option("truncate", "examples longer than a row")
    warmup_steps: int = option(5, "linear warm-up steps of the learning rate", show_default=False)
    remat: RematPolicy = option("none", "rematerialisation of the decoder layers")
    scan_layers: bool = option(False, "scan_layers=True", flag="--scan")
    #: ``splash_interpret`` (Python only, not a flag: the kernel under Pallas' interpreter)
    #: is accepted for tests
    attention_kernel: AttentionKernelChoice = option(
        "xla",
        "splash: JAX's Pallas splash attention (TPU only) in the causal self-attention of "
        "training; xla elsewhere",
    )

    def check_fields(self) -> None:
        super().check_fields()
        if self.data_shards is not None and self.data_shards < 1:
            self.bad("data_shards", ">= 1")
        if self.overflow not in choices(Overflow):
            self.bad("overflow", " or ".join(choices(Overflow)))
        if self.warmup_steps < 0:
            self.bad("warmup_steps", ">= 0")
        if self.remat not in choices(RematPolicy):
            self.bad("remat", " or ".join(choices(RematPolicy)))
        if self.attention_kernel not in choices(AttentionKernel):
            self.bad("attention_kernel", " or ".join(choices(AttentionKernelChoice)))
        if self.attention_kernel == "splash":  # only it asks the backend, which imports JAX
            from posttrain.layers.splash import check_backend

            flag = flag_of(type(self), "attention_kernel")
            check_backend(self.attention_kernel, f"{flag} {self.attention_kernel}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SupervisedRunOptions(PeftRunOptions):
    """A supervised run on chat rows (:mod:`posttrain.training.supervised`).

    Attributes beyond :class:`PeftRunOptions`:
      data: chat JSONL file; None for the embedded ``pydoc_data`` set.
      data_shards: split the conversations into this many interleaved shards, each
        packed and shuffled on its own (:func:`posttrain.training.data.sharded_batches`);
        each process tokenises only the shards of its own rows of every global batch.
        None: a resumed run's count, else one shard per distinct slice of the batch
        across processes (1 in one process: the unsharded order). The same value gives
        the same batches on any number of processes whose rows are whole shards (the
        count a multiple of the processes' slices of the batch).
      max_target_length: tokens per row.
      packing: pack several conversations per row (else one per row, padded).
      sync_saves: each checkpoint is complete on disk before the next step starts
        (Orbax ``enable_async_checkpointing=False``); by default Orbax saves in the
        background, so a kill can lose the steps since the last completed save.
      replica_parallel_saves: how Orbax writes arrays replicated over the mesh: ``on``
        (Orbax's default: the replicas share each array's writes), ``off`` (one replica
        writes it; same checkpoint), ``auto`` (``off`` in one process on the CPU
        backend, where there is nobody to share with and the per-replica slicing costs
        about a third of each save; ``on`` elsewhere). The choice is printed and
        recorded in ``run.json``.
    """

    #: Settings that change what a resumed run computes; the others (output,
    #: save_every, stop_after, remat, sync_saves, replica_parallel_saves, data_shards)
    #: may change between segments (a resumed run keeps its data shards unless given).
    TRAINING_FIELDS: ClassVar[tuple[str, ...]] = (
        *PeftRunOptions.TRAINING_FIELDS,
        "max_target_length",
        "packing",
    )

    data: str | None = option(None, "chat JSONL file (default: embedded pydoc_data)")
    max_target_length: int = option(256, "tokens per row", show_default=False)
    packing: bool = option(True, "one conversation per row")
    sync_saves: bool = option(
        False,
        "finish each checkpoint before the next step (default: Orbax saves in the "
        "background; a kill loses the steps since the last completed save)",
    )
    replica_parallel_saves: ReplicaParallelSaves = option(
        "auto",
        "Orbax's replica-parallel writes of replicated arrays (auto: off in one CPU "
        "process, else on)",
        checked=True,
    )

    def check_fields(self) -> None:
        super().check_fields()
        if self.max_target_length < 2:
            self.bad("max_target_length", ">= 2")
        if self.replica_parallel_saves not in choices(ReplicaParallelSaves):
            self.bad("replica_parallel_saves", "auto, on or off")

    def resolved_replica_parallel_saves(self) -> bool:
        """``replica_parallel_saves`` as a bool, ``auto`` resolved for this process."""
        import jax

        if self.replica_parallel_saves == "auto":
            return not (jax.default_backend() == "cpu" and jax.process_count() == 1)
        return self.replica_parallel_saves == "on"
