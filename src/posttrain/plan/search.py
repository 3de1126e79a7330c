"""``posttrain plan --search``: the fastest setting that fits, among the rematerialisation
policies and per-device batch sizes, by compiling each candidate for the slice.

For each policy of :data:`REMATS` the per-device batch doubles from 1 up to
``search_max_batch`` and stops at the first that does not fit (a larger batch needs at
least as much memory). Each candidate is a whole :func:`posttrain.plan.plan`: its peak
decides whether it fits, its estimate (the model's FLOPs and the compiled bytes at the
chip's measured rates, :func:`posttrain.plan.report.judge`) how fast it runs. The fastest
is the one with the most rows per second (per-device rows x data-parallel devices / step
time); where the estimate is level (every compute-bound candidate of a length runs the
model's FLOPs at the same rate), the one moving the fewest bytes a row: the memory
traffic the roofline's ``max`` hides behind the FLOPs is what still separates them (a
larger batch spreads the weights' and optimizer's traffic over more rows). Then the
smaller peak.

The estimate is within :data:`ESTIMATE_ERROR` of the v5e's steps, and the settings worth
choosing between are often closer than that (remat full at 8 x 1024 ran 17% more tokens a
second than none at 4 on the v5e, where the estimate ranks them level): the advice names
the candidates within that margin of the fastest. With ``--run-steps N`` on the slice's
own chips every candidate that fits is also run (:func:`posttrain.plan.measure.measure`),
and the fastest is the chip's: a candidate the chip cannot hold does not fit.

MaxText's v5e configurations pick remat and batch by hand (``configs/v5e/*.yml``); here
the compiler's figures, or the chip's, choose.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

from posttrain.plan import plan, topology
from posttrain.plan.compile import DoesNotFit
from posttrain.plan.options import PlanOptions

#: the policies searched, least recomputation first
REMATS = ("none", "save_dots", "full")
#: how far the step estimate may be off: the v5e's thirteen chip steps are within it in
#: MFU (tests/test_plan_chip.py, docs/scale.md)
ESTIMATE_ERROR = 0.15
#: the advice names up to this many close calls; more it counts (the table marks them)
NAMED_CLOSE_CALLS = 3


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
      refusal: the compiler's, the verdict's or the chip's line when it does not fit,
        else ``""``.
      measured_seconds: the chip's step time (``--run-steps``; 0 when not run). When set,
        ``rows_per_second`` is the chip's.
      bytes_per_row: the plan's bytes accessed per device over its rows per device (0
        when it does not fit).
    """

    remat: str
    per_device_batch_size: int
    fits: bool
    peak_bytes: int
    estimate_seconds: float
    rows_per_second: float
    mfu: float
    refusal: str = ""
    measured_seconds: float = 0.0
    bytes_per_row: float = 0.0

    @property
    def measured_mfu(self) -> float:
        """The MFU of the chip's step (0 when not run): the plan's MFU scaled by
        estimate / measured time (the same model FLOPs)."""
        if self.measured_seconds <= 0:
            return 0.0
        return self.mfu * self.estimate_seconds / self.measured_seconds


def candidates(options: PlanOptions) -> Iterator[PlanOptions]:
    """Every (policy, batch) a search may compile, in search order: for each policy of
    :data:`REMATS`, per-device batches 1, 2, 4, ... up to ``search_max_batch``."""
    for remat in REMATS:
        batch = 1
        while batch <= options.search_max_batch:
            yield dataclasses.replace(
                options, remat=remat, per_device_batch_size=batch, search=False
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
        bytes_per_row=result.figures.bytes_accessed / options.per_device_batch_size
        if verdict.fits
        else 0.0,
    )


def data_parallel(options: PlanOptions) -> int:
    """Devices that hold different rows: data x fsdp of the plan's mesh (every device on
    fsdp when none is given)."""
    mesh = options.mesh or {"fsdp": topology.get(options.topology).chips}
    return mesh.get("data", 1) * mesh.get("fsdp", 1)


def run_candidate(candidate: Candidate, options: PlanOptions, measure_fn: Callable) -> Candidate:
    """``candidate`` (which fits by its plan) with its step run on the chips
    (``measure_fn(options)``, a :class:`~posttrain.plan.measure.Measured`): its measured
    time and rows per second; one the chip cannot hold does not fit."""
    measured = measure_fn(options)
    if not measured.fits:
        refusal = f"the chip refused it: {measured.error[:120]}"
        return dataclasses.replace(candidate, fits=False, rows_per_second=0.0, refusal=refusal)
    rows = options.per_device_batch_size * data_parallel(options)
    return dataclasses.replace(
        candidate,
        measured_seconds=measured.step_seconds,
        rows_per_second=rows / measured.step_seconds,
    )


def search(
    options: PlanOptions, plan_fn: Callable | None = None, measure_fn: Callable | None = None
) -> list[Candidate]:
    """Plans :func:`candidates` in order, and with ``options.run_steps`` runs each that
    fits on the chips; a policy's larger batches are skipped after its first that does not
    fit (by the plan or on the chip).

    Args:
      plan_fn: the planner (default :func:`posttrain.plan.plan`).
      measure_fn: the chip's run (default :func:`posttrain.plan.measure.measure`).

    Returns:
      The candidates planned, in search order.
    """
    if plan_fn is None:
        plan_fn = plan
    if measure_fn is None:
        from posttrain.plan.measure import measure as measure_fn
    seen: list[Candidate] = []
    stopped: set[str] = set()
    for candidate in candidates(options):
        if candidate.remat in stopped:
            continue
        judged = judge_candidate(candidate, plan_fn)
        if judged.fits and options.run_steps:
            judged = run_candidate(judged, candidate, measure_fn)
        seen.append(judged)
        if not judged.fits:
            stopped.add(candidate.remat)
    return seen


def fastest(found: list[Candidate]) -> Candidate | None:
    """The fitting candidate with the most rows per second (the chip's where it ran them;
    level to 6 significant digits: the fewer bytes a row, then the smaller peak), or
    ``None`` when none fits."""
    fitting = [c for c in found if c.fits]
    if not fitting:
        return None
    return max(
        fitting, key=lambda c: (float(f"{c.rows_per_second:.6g}"), -c.bytes_per_row, -c.peak_bytes)
    )


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


def close_calls(found: list[Candidate]) -> list[Candidate]:
    """The fitting candidates not run on the chip, other than the fastest, whose rows per
    second are within :data:`ESTIMATE_ERROR` of the fastest's: the estimate cannot tell
    them from it."""
    best = fastest(found)
    if best is None or best.measured_seconds > 0:
        return []
    near = best.rows_per_second * (1 - ESTIMATE_ERROR)
    return [c for c in found if c is not best and c.fits and c.rows_per_second >= near]


def table(found: list[Candidate], seq: int) -> str:
    """The searched settings, one line each, the fastest marked ``*`` and its
    :func:`close_calls` ``~`` (``seq``: tokens a row, :func:`tokens_per_row`); the chip's
    step and MFU beside the estimate's where it ran them, and tokens a second from the
    chip's step then."""
    best = fastest(found)
    near = close_calls(found)
    ran = any(c.measured_seconds > 0 for c in found)
    chip = f" {'chip ms':>9} {'chip MFU':>8}" if ran else ""
    lines = [
        f"{'':1} {'remat':9} {'batch/dev':>9} {'peak GiB':>9} {'step ms':>9} "
        f"{'tokens/s':>11} {'MFU':>6}{chip}  verdict"
    ]
    for c in found:
        mark = "*" if c is best else "~" if any(c is n for n in near) else ""
        head = f"{mark:1} {c.remat:9} {c.per_device_batch_size:>9}"
        if c.fits:
            measured = f" {c.measured_seconds * 1e3:>9.1f} {c.measured_mfu:>8.1%}" if ran else ""
            lines.append(
                f"{head} {c.peak_bytes / 2**30:>9.2f} {c.estimate_seconds * 1e3:>9.1f} "
                f"{c.rows_per_second * seq:>11,.0f} {c.mfu:>6.1%}{measured}  fits"
            )
        else:
            blank = f" {'':>9} {'':>8}" if ran else ""
            lines.append(
                f"{head} {'':>9} {'':>9} {'':>11} {'':>6}{blank}  does not fit ({c.refusal[:120]})"
            )
    return "\n".join(lines)


def advice(found: list[Candidate]) -> str:
    """One line naming the fastest setting's flags, or saying that nothing fits."""
    best = fastest(found)
    if best is None:
        return "no searched setting fits: try --lora-rank, a wider mesh or a shorter --seq"
    flags = f"--remat {best.remat} --per-device-batch-size {best.per_device_batch_size}"
    if best.measured_seconds > 0:
        return (
            f"fastest that fits, on the chip: {flags} ({best.measured_seconds * 1e3:.1f} ms "
            f"a step, MFU {best.measured_mfu:.1%})"
        )
    line = (
        f"fastest that fits: {flags} ({best.estimate_seconds * 1e3:.1f} ms a step, "
        f"MFU {best.mfu:.1%} estimated)"
    )
    near = close_calls(found)
    if len(near) > NAMED_CLOSE_CALLS:
        line += (
            f"; {len(near)} others are within the estimate's {ESTIMATE_ERROR:.0%} of it (marked ~)"
        )
    elif near:
        named = "; ".join(
            f"--remat {c.remat} --per-device-batch-size {c.per_device_batch_size}" for c in near
        )
        line += f"; within the estimate's {ESTIMATE_ERROR:.0%} of it: {named}"
    if near:
        line += " (--run-steps N on the slice's chips runs each and picks by their steps)"
    return line
