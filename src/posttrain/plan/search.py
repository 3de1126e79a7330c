"""``posttrain plan --search``: the fastest setting that fits, among the rematerialisation
policies and per-device batch sizes, by compiling each candidate for the slice.

For each policy of :data:`REMATS` the per-device batch doubles from 1 up to
``search_max_batch`` and stops at the first that does not fit (a larger batch needs at
least as much memory). Each candidate is a whole :func:`posttrain.plan.plan`: its peak
decides whether it fits, its estimate (the compiled costs at the chip's measured
efficiencies, :func:`posttrain.plan.report.judge`) how fast it runs. The fastest is the
one with the most rows per second (per-device rows x data-parallel devices / estimate);
a tie goes to the smaller peak.

MaxText's v5e configurations pick remat and batch by hand (``configs/v5e/*.yml``); here
the compiler's own figures choose, and ``--run-steps`` then checks the choice on the chip.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

from posttrain.plan import plan, topology
from posttrain.plan.compile import DoesNotFit
from posttrain.plan.options import PlanOptions

#: the policies searched, least recomputation first
REMATS = ("none", "save_dots", "full")


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One searched setting and what its plan said.

    Attributes:
      remat, per_device_batch_size: the setting.
      fits: the plan fits the chip (and the compiler accepted it).
      peak_bytes: the predicted peak per device (0 when the compiler refused it).
      estimate_seconds: the estimated step time (0 when it does not fit).
      rows_per_second: global rows over the estimate (0 when it does not fit).
      mfu: the plan's MFU at the estimate.
      refusal: the compiler's or the verdict's line when it does not fit, else ``""``.
    """

    remat: str
    per_device_batch_size: int
    fits: bool
    peak_bytes: int
    estimate_seconds: float
    rows_per_second: float
    mfu: float
    refusal: str = ""


def candidates(options: PlanOptions) -> Iterator[PlanOptions]:
    """Every (policy, batch) a search may compile, in search order: for each policy of
    :data:`REMATS`, per-device batches 1, 2, 4, ... up to ``search_max_batch``."""
    for remat in REMATS:
        batch = 1
        while batch <= options.search_max_batch:
            yield dataclasses.replace(
                options, remat=remat, per_device_batch_size=batch, search=False, run_steps=0
            )
            batch *= 2


def judge_candidate(options: PlanOptions, plan_fn: Callable) -> Candidate:
    """Plans one setting; a compiler refusal is a candidate that does not fit."""
    try:
        result = plan_fn(options)
    except DoesNotFit as e:
        return Candidate(
            options.remat, options.per_device_batch_size, False, 0, 0.0, 0.0, 0.0, str(e)
        )
    verdict = result.verdict
    rows = options.per_device_batch_size * data_parallel(options)
    fast = verdict.fits and verdict.estimate_seconds > 0
    return Candidate(
        remat=options.remat,
        per_device_batch_size=options.per_device_batch_size,
        fits=verdict.fits,
        peak_bytes=result.figures.peak,
        estimate_seconds=verdict.estimate_seconds if verdict.fits else 0.0,
        rows_per_second=rows / verdict.estimate_seconds if fast else 0.0,
        mfu=verdict.mfu,
        refusal="" if verdict.fits else f"peak {result.figures.peak / 2**30:.2f} GiB",
    )


def data_parallel(options: PlanOptions) -> int:
    """Devices that hold different rows: data x fsdp of the plan's mesh (every device on
    fsdp when none is given)."""
    mesh = options.mesh or {"fsdp": topology.get(options.topology).chips}
    return mesh.get("data", 1) * mesh.get("fsdp", 1)


def search(options: PlanOptions, plan_fn: Callable | None = None) -> list[Candidate]:
    """Plans :func:`candidates` in order; a policy's larger batches are skipped after its
    first that does not fit.

    Args:
      plan_fn: the planner (default :func:`posttrain.plan.plan`).

    Returns:
      The candidates planned, in search order.
    """
    if plan_fn is None:
        plan_fn = plan
    seen: list[Candidate] = []
    stopped: set[str] = set()
    for candidate in candidates(options):
        if candidate.remat in stopped:
            continue
        judged = judge_candidate(candidate, plan_fn)
        seen.append(judged)
        if not judged.fits:
            stopped.add(candidate.remat)
    return seen


def fastest(found: list[Candidate]) -> Candidate | None:
    """The fitting candidate with the most rows per second (a tie: the smaller peak), or
    ``None`` when none fits."""
    fitting = [c for c in found if c.fits]
    if not fitting:
        return None
    return max(fitting, key=lambda c: (c.rows_per_second, -c.peak_bytes))


def tokens_per_row(options: PlanOptions) -> int:
    """Tokens one row of the workflow's step processes: SFT's sequence; a DPO pair's two
    sequences of prompt and completion; a GRPO completion's prompt and completion;
    ``generate``'s sampled tokens."""
    if options.workflow == "sft":
        return options.seq
    if options.workflow == "dpo":
        return 2 * (options.seq + options.new_tokens)
    if options.workflow == "grpo":
        return options.seq + options.new_tokens
    return options.new_tokens


def table(found: list[Candidate], seq: int) -> str:
    """The searched settings, one line each, the fastest marked ``*`` (``seq``: tokens a
    row, :func:`tokens_per_row`)."""
    best = fastest(found)
    lines = [
        f"{'':1} {'remat':9} {'batch/dev':>9} {'peak GiB':>9} {'step ms':>9} "
        f"{'tokens/s':>11} {'MFU':>6}  verdict"
    ]
    for c in found:
        mark = "*" if c is best else ""
        if c.fits:
            lines.append(
                f"{mark:1} {c.remat:9} {c.per_device_batch_size:>9} "
                f"{c.peak_bytes / 2**30:>9.2f} {c.estimate_seconds * 1e3:>9.1f} "
                f"{c.rows_per_second * seq:>11,.0f} {c.mfu:>6.1%}  fits"
            )
        else:
            lines.append(
                f"{mark:1} {c.remat:9} {c.per_device_batch_size:>9} {'':>9} {'':>9} {'':>11} "
                f"{'':>6}  does not fit ({c.refusal[:120]})"
            )
    return "\n".join(lines)


def advice(found: list[Candidate]) -> str:
    """One line naming the fastest setting's flags, or saying that nothing fits."""
    best = fastest(found)
    if best is None:
        return "no searched setting fits: try --lora-rank, a wider mesh or a shorter --seq"
    return (
        f"fastest that fits: --remat {best.remat} --per-device-batch-size "
        f"{best.per_device_batch_size} ({best.estimate_seconds * 1e3:.1f} ms a step, "
        f"MFU {best.mfu:.1%} estimated)"
    )
