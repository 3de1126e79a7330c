"""How many data shards a run reads its data in, and which this process reads
(:attr:`posttrain.training.options.PeftRunOptions.data_shards`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from posttrain import distributed, sharding
from posttrain.training import record as run_record

if TYPE_CHECKING:
    from posttrain.training.options import PeftRunOptions


def recorded_shards(cfg: PeftRunOptions) -> int | None:
    """The data shards the run in ``cfg.output`` trained with, when there is one to
    resume (1 for a run recorded before the setting existed); None for a new run.
    ``posttrain sft``'s and ``dpo``'s configs (``output``)."""
    record = run_record.read(cfg.output)
    if not record:
        return None
    return int(record.get("data_shards") or 1)  # null: the option, recorded unset


def data_shards(
    cfg: PeftRunOptions, mesh, global_batch: int, recorded: int | None = None
) -> tuple[int, range]:
    """``(shards, the shards this process reads)``
    (:attr:`~posttrain.training.options.PeftRunOptions.data_shards`): the process reads the
    shards whose rows of every global batch its devices hold. A run resumed without
    ``data_shards`` keeps the count it was ``recorded`` with, so the data order survives
    a change in the number of processes.

    Raises:
      ValueError: the global batch does not divide into the shards, a process's rows
        are not whole shards (both numbers named), or ``data_shards`` differs from the
        resumed run's.
    """
    start, stop = distributed.local_rows(sharding.batch_sharding(mesh), global_batch)
    if recorded is not None and cfg.data_shards not in (None, recorded):
        raise ValueError(
            f"data_shards={cfg.data_shards} (--data-shards): the run in {cfg.output} "
            f"trained with {recorded} data shards; resuming with another count would "
            "change its data order"
        )
    shards = cfg.data_shards or recorded or global_batch // (stop - start)
    if global_batch % shards:
        raise ValueError(
            f"data_shards={shards} (--data-shards): the global batch {global_batch} does "
            "not divide into it"
        )
    per = global_batch // shards
    if start % per or stop % per:
        source = (
            f"the run in {cfg.output} trained with {shards} data shard(s), kept on resume"
            if cfg.data_shards is None and recorded is not None
            else f"data_shards={shards} (--data-shards)"
        )
        raise ValueError(
            f"{source}: this process holds rows {start}-{stop} of each global batch, not "
            f"whole shards of {per} rows; expected a multiple of {global_batch // (stop - start)}"
        )
    return shards, range(start // per, stop // per)
