"""``posttrain sft``'s options: :class:`~posttrain.runs.options.PeftRunOptions` and what
only SFT has."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

from posttrain.flags import option
from posttrain.runs.options import PeftRunOptions

ReplicaParallelSaves = Literal["auto", "on", "off"]
#: ``--vision``'s model when no ``--model`` is given (:meth:`SFTConfig.default_model`)
VISION_MODEL = "gemma4-vision-tiny"


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTConfig(PeftRunOptions):
    """Everything one SFT run needs; defaults are the embedded run (``qwen3-tiny`` on the
    embedded ``pydoc_data`` Q/A set, the byte tokenizer, every device on fsdp).

    Attributes beyond :class:`~posttrain.runs.options.PeftRunOptions`:
      data: chat JSONL file; None for the embedded ``pydoc_data`` set.
      data_shards: split the conversations into this many interleaved shards, each
        packed and shuffled on its own (:func:`posttrain.sft.data.sharded_batches`);
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
      vision: train on images (:mod:`posttrain.sft.vision_run`): ``--data`` in TRL's
        vision chat format, else the embedded drawn images; the default ``--model``
        becomes ``gemma4-vision-tiny`` (:meth:`default_model`; a given one is kept, and
        refused if it has no tower); one conversation per row; the tower frozen.
      train_vision_tower: with ``vision``, train the tower too (full fine-tuning).
      image_root: with ``vision`` and ``data``, the directory the data's images must lie
        under (resolved, links followed); None: the data file's directory
        (:func:`posttrain.sft.vision_data.read_vision_jsonl`).
    """

    #: Settings that change what a resumed run computes; the others (output,
    #: save_every, stop_after, remat, sync_saves, replica_parallel_saves, data_shards)
    #: may change between segments (a resumed run keeps its data shards unless given).
    TRAINING_FIELDS: ClassVar[tuple[str, ...]] = (
        *PeftRunOptions.TRAINING_FIELDS,
        "max_target_length",
        "packing",
        "vision",
        "train_vision_tower",
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

    vision: bool = option(
        False,
        "train on images: --data in TRL's vision chat format (default: embedded drawn "
        "images, 1 in 8 held out); the default --model becomes gemma4-vision-tiny; one "
        "conversation per row; the vision tower frozen",
    )
    train_vision_tower: bool = option(
        False, "with --vision, train the vision tower too (full fine-tuning only)"
    )
    image_root: str | None = option(
        None,
        "with --vision --data, the directory images may be read from (default: the data "
        "file's directory; paths that leave it are refused)",
    )

    def default_model(self) -> str:
        """:data:`VISION_MODEL` under ``vision`` (the text default has no tower), else the
        text default; a given ``--model`` is kept either way."""
        return VISION_MODEL if self.vision else super().default_model()

    def check_fields(self) -> None:
        super().check_fields()
        if self.train_vision_tower and not self.vision:
            self.bad("train_vision_tower", "only with --vision")
        if self.image_root is not None and not (self.vision and self.data):
            self.bad("image_root", "only with --vision and --data (where the images are read)")
        if self.train_vision_tower and self.lora_rank:
            self.bad(
                "train_vision_tower",
                "full fine-tuning (--lora-rank 0): LoRA adapts the text model only",
            )
        if self.max_target_length < 2:
            self.bad("max_target_length", ">= 2")
        if self.replica_parallel_saves not in ("auto", "on", "off"):
            self.bad("replica_parallel_saves", "auto, on or off")

    def resolved_replica_parallel_saves(self) -> bool:
        """``replica_parallel_saves`` as a bool, ``auto`` resolved for this process."""
        import jax

        if self.replica_parallel_saves == "auto":
            return not (jax.default_backend() == "cpu" and jax.process_count() == 1)
        return self.replica_parallel_saves == "on"
