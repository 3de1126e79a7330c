"""What a compiled program needs of one device, against what the chip has.

Per-device bytes come from the compiler (``Compiled.memory_analysis()``: arguments,
outputs, aliased outputs, temporaries) and, by kind, from the shardings of the
abstract arguments (parameters, optimizer state, inputs, KV cache) and of the trained
parameters (gradients, which live among the temporaries). The peak estimate is XLA's
peak of live buffers (``peak_memory_in_bytes``, its heap simulation of the program:
arguments included, temporaries only while they live), plus what the workflow keeps on
the device outside the program (``resident``: DPO's reference while the policy trains,
GRPO's optimizer state while it samples), against the chip's HBM. Not the sum
``arguments + outputs - aliased + temporaries`` (MaxText's ``train_compile.py`` total,
this plan's before issue 54): on a lent v5e that sum was 19-20% above the donated SFT
step's ``peak_bytes_in_use`` and the headroom a ballast probe found
(:mod:`posttrain.plan.headroom`), where the live peak was 1.1-1.7% below (docs/scale.md).
The sum stays the estimate where the compiler reports no live peak (0). A workflow of
several programs (DPO: the train step and the reference forward; GRPO: the rollout, the
reference forward and the train step) fits when each of them does (:func:`judge_stages`).

Time (Williams et al. 2009, "Roofline"), per device:

- the floor, ``max(FLOPs / peak FLOP/s, (arguments + outputs) / HBM bandwidth)``: no step
  runs faster (every FLOP at peak; the state read and written once). Not
  ``cost_analysis()``'s bytes accessed, which counts traffic that stays on the chip: on
  a v5e its roofline read 639.5 ms for a step that ran in 556 ms (issue 54);
- the estimate, ``max((model + attention FLOPs) / (peak x flop_efficiency), bytes
  accessed x hbm_share / bandwidth, the floor)``, the chip's efficiencies measured
  (:class:`~posttrain.plan.topology.Chip`), and its MFU: the model FLOPs
  (:class:`~posttrain.plan.steps.Program`) over ``estimate x peak x chips``. The model's
  FLOPs (``6 N`` a token, and attention's ``12 L H Q T``: PaLM's count, Chowdhery et al.
  2022, appendix B), not the compiled ones: a rematerialised step's recomputed forward is
  in the compiled FLOPs, and on the v5e it cost far less than its share of them (remat
  full ran 47% more FLOPs than none at about the same time a token). At the compiled
  FLOPs the best two efficiencies missed one of thirteen chip steps by 18.5% (a fit
  leaving each out: 40%); at the model's, 14.8% (19.3%), docs/scale.md.
"""

from __future__ import annotations

import dataclasses
import json
import os

from posttrain import atomic
from posttrain.plan.topology import GIB, Topology

#: what helps a program that does not fit, in the order worth trying
KNOBS = "--remat full, more fsdp (--mesh fsdp=N), a smaller --per-device-batch-size, LoRA"


def knobs(options, topology: Topology) -> str:
    """:data:`KNOBS` less what ``options`` (:class:`~posttrain.plan.options.PlanOptions`)
    already set or ``topology`` cannot give: ``--remat full`` when given, more fsdp on one
    chip, a smaller batch at one row (per shard, or a global ``--batch`` of 1), LoRA when
    LoRA is what is planned."""
    if options.batch is not None:
        smaller = ("a smaller --batch", options.batch == 1)
    else:
        smaller = ("a smaller --per-device-batch-size", options.per_device_batch_size == 1)
    tried = [
        ("--remat full", options.remat == "full"),
        ("more fsdp (--mesh fsdp=N)", topology.chips == 1),
        smaller,
        ("LoRA", options.lora_rank > 0),
    ]
    left = [name for name, done in tried if not done]
    return ", ".join(left) if left else "a slice with more chips"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Figures:
    """One compiled program on one device.

    Attributes:
      arguments, outputs, aliased, temporaries, code: ``memory_analysis()`` bytes.
      kinds: bytes by kind from the shardings (``parameters``, ``optimizer state``,
        ``gradients``, ``inputs``, ``KV cache``).
      flops, bytes_accessed: ``cost_analysis()`` per device.
      model_flops: the step's model FLOPs, whole slice.
      attention_flops: attention's own matmul FLOPs, whole slice
        (:func:`posttrain.plan.abstract.attention_flops`; 0 in records from before it).
      compile_seconds: ``lower`` + ``compile`` wall time (every compile the figures
        needed).
      cost_source: where ``flops`` and ``bytes_accessed`` come from (``compiled``, or the
        shallow unscanned compiles they were extrapolated from).
      resident: bytes the workflow holds on the device outside this program's arguments
        (other models, the optimizer state while sampling), computed from shardings.
      live_peak: ``memory_analysis().peak_memory_in_bytes``, the most bytes the program's
        live buffers (its arguments among them) hold at once; 0 where the compiler gives
        none (records from before it was kept).
    """

    arguments: int
    outputs: int
    aliased: int
    temporaries: int
    code: int
    kinds: dict
    flops: float
    bytes_accessed: float
    model_flops: float
    compile_seconds: float
    attention_flops: float = 0.0
    cost_source: str = "compiled"
    resident: int = 0
    live_peak: int = 0

    @property
    def peak(self) -> int:
        """Estimated peak bytes: the live peak + resident; without a live peak, arguments
        + outputs - aliased + temporaries + resident (module docstring)."""
        if self.live_peak > 0:
            return self.live_peak + self.resident
        return self.arguments + self.outputs - self.aliased + self.temporaries + self.resident


#: :class:`Figures`' name of each ``memory_analysis()`` field (XLA's ``CompiledMemoryStats``)
MEMORY_FIELDS: dict[str, str] = {
    "arguments": "argument_size_in_bytes",
    "outputs": "output_size_in_bytes",
    "aliased": "alias_size_in_bytes",
    "temporaries": "temp_size_in_bytes",
    "code": "generated_code_size_in_bytes",
    "live_peak": "peak_memory_in_bytes",
}


def memory_of(compiled) -> dict[str, int]:
    """A ``jax.stages.Compiled``'s ``memory_analysis()``, bytes one device holds, under
    :data:`MEMORY_FIELDS`' names; ``{}`` where the backend gives none."""
    memory = compiled.memory_analysis()
    if memory is None:
        return {}
    return {name: int(getattr(memory, field)) for name, field in MEMORY_FIELDS.items()}


def figures_of(
    compiled,
    kinds: dict,
    model_flops: float,
    seconds: float,
    resident: int = 0,
    attention_flops: float = 0.0,
) -> Figures:
    """:class:`Figures` of a ``jax.stages.Compiled`` (``resident``: :attr:`Figures.resident`;
    ``attention_flops``: :attr:`Figures.attention_flops`)."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    return Figures(
        **memory_of(compiled),
        kinds=dict(kinds),
        flops=float(cost.get("flops", 0.0)),
        bytes_accessed=float(cost.get("bytes accessed", 0.0)),
        model_flops=float(model_flops),
        compile_seconds=float(seconds),
        resident=int(resident),
        attention_flops=float(attention_flops),
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Verdict:
    """Whether a program fits one chip of ``topology``.

    Attributes:
      fits: peak <= HBM (and the compiler accepted it).
      headroom: HBM - peak, bytes (negative: the overflow).
      floor_seconds: the step-time floor (no step runs faster).
      mfu: model FLOPs / (estimate x peak FLOP/s x chips).
      bound: ``compute`` or ``memory``: which term of the estimate is the larger (of a
        workflow: the slowest program's).
      stage: the program with the least headroom (a workflow of several), else ``""``.
      estimate_seconds: the estimated step time (module docstring).
    """

    fits: bool
    headroom: int
    floor_seconds: float
    mfu: float
    bound: str
    stage: str = ""
    estimate_seconds: float = 0.0


def roofline(flops: float, bytes_accessed: float, topology: Topology) -> tuple[float, str]:
    """``(floor seconds, 'compute' | 'memory')`` of one device's step.

    Raises:
      ValueError: negative figures.
    """
    if flops < 0 or bytes_accessed < 0:
        raise ValueError(f"flops={flops} and bytes_accessed={bytes_accessed} must be >= 0")
    compute = flops / topology.chip.peak_flops
    memory = bytes_accessed / topology.chip.hbm_bandwidth
    return (compute, "compute") if compute >= memory else (memory, "memory")


def floor(figures: Figures, topology: Topology) -> float:
    """Seconds no step of ``figures`` can beat on one device: its FLOPs at peak, or its
    arguments read and outputs written once, whichever is longer."""
    state = figures.arguments + figures.outputs
    return roofline(figures.flops, state, topology)[0]


def judge(figures: Figures, topology: Topology) -> Verdict:
    """The :class:`Verdict` of ``figures`` on ``topology``."""
    headroom = topology.hbm_bytes - figures.peak
    chip = topology.chip  # the model's FLOPs and the bytes, at the chip's measured rates
    work = (figures.model_flops + figures.attention_flops) / topology.chips
    moved = figures.bytes_accessed * chip.hbm_share
    estimate, bound = roofline(work / chip.flop_efficiency, moved, topology)
    estimate = max(estimate, floor(figures, topology))
    denominator = estimate * topology.chip.peak_flops * topology.chips
    mfu = figures.model_flops / denominator if denominator > 0 else 0.0
    return Verdict(
        fits=headroom >= 0,
        headroom=headroom,
        floor_seconds=floor(figures, topology),
        mfu=mfu,
        bound=bound,
        estimate_seconds=estimate,
    )


def judge_stages(stages: dict[str, Figures], topology: Topology) -> Verdict:
    """The :class:`Verdict` of a workflow whose step runs the programs ``stages`` (name ->
    figures) one after the other: it fits when every program does; its headroom is the
    tightest program's (named in ``stage``); its floor and estimate are the sums of the
    programs', and its MFU the sum of their model FLOPs over ``estimate x peak x chips``.

    Raises:
      ValueError: no stages.
    """
    if not stages:
        raise ValueError("judge_stages needs at least one program")
    verdicts = {name: judge(f, topology) for name, f in stages.items()}
    tightest = min(verdicts, key=lambda name: verdicts[name].headroom)
    slowest = max(verdicts, key=lambda name: verdicts[name].estimate_seconds)
    estimate = sum(v.estimate_seconds for v in verdicts.values())
    denominator = estimate * topology.chip.peak_flops * topology.chips
    flops = sum(f.model_flops for f in stages.values())
    return Verdict(
        fits=all(v.fits for v in verdicts.values()),
        headroom=verdicts[tightest].headroom,
        floor_seconds=sum(v.floor_seconds for v in verdicts.values()),
        mfu=flops / denominator if denominator > 0 else 0.0,
        bound=verdicts[slowest].bound,
        stage=tightest if len(stages) > 1 else "",
        estimate_seconds=estimate,
    )


def overflow_line(peak: int, topology: Topology, what: str, advice: str = KNOBS) -> str:
    """The one line of a program that does not fit (``advice``: :func:`knobs`)."""
    over = peak - topology.hbm_bytes
    return (
        f"{what} does not fit {topology.name}: {gib(peak)} per device, {gib(over)} over the "
        f"chip's {gib(topology.hbm_bytes)} HBM; try {advice}"
    )


def calibration(topology: Topology) -> str:
    """Where the step estimate's efficiencies come from, in a few words."""
    if (chip := topology.chip).calibration_source:
        return f"model FLOPs at {chip.flop_efficiency:g} of peak, measured on a {chip.name}"
    return "uncalibrated: no chip of this kind measured"


def gib(n: float) -> str:
    """``12.34 GiB``, or ``56.7 MiB`` below one GiB."""
    if abs(n) < GIB:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n / GIB:.2f} GiB"


def table(what: str, topology: Topology, figures: Figures, verdict: Verdict) -> str:
    """The plan's table (one program), for stdout."""
    return stages_table(what, topology, {"": figures}, verdict)


def stages_table(
    what: str, topology: Topology, stages: dict[str, Figures], verdict: Verdict
) -> str:
    """The plan's table, for stdout: one column per program of the workflow (``stages``,
    name -> figures; one unnamed column for a single program), then the workflow's
    verdict, floor and MFU."""
    named = len(stages) > 1
    estimate_note = f"{verdict.bound}-bound, {calibration(topology)}"
    kinds = list(dict.fromkeys(k for f in stages.values() for k in f.kinds))

    def per(fn) -> list[str]:
        return [fn(f) for f in stages.values()]

    rows = [("what", [what]), ("topology", [f"{topology.name} ({topology.chips} chips)"])]
    if named:
        rows.append(("program", list(stages)))
    rows += [
        (f"  {k}", per(lambda f, k=k: gib(f.kinds[k]) if k in f.kinds else "-")) for k in kinds
    ]
    rows += [
        ("arguments (compiled)", per(lambda f: gib(f.arguments))),
        ("temporaries (compiled)", per(lambda f: gib(f.temporaries))),
        ("outputs - aliased", per(lambda f: gib(f.outputs - f.aliased))),
        ("live buffers at peak", per(lambda f: gib(f.live_peak) if f.live_peak else "-")),
    ]
    if any(f.resident for f in stages.values()):
        rows.append(("held outside it", per(lambda f: gib(f.resident))))
    rows += [
        ("peak per device", per(lambda f: gib(f.peak))),
        ("HBM per chip", [gib(topology.hbm_bytes)]),
        ("headroom", [gib(verdict.headroom) + (f" ({verdict.stage})" if verdict.stage else "")]),
        ("verdict", ["fits" if verdict.fits else "does NOT fit"]),
        ("compile", [f"{sum(f.compile_seconds for f in stages.values()):.1f} s"]),
        ("FLOPs per device", per(lambda f: f"{f.flops:.3e} ({f.cost_source})")),
        ("model FLOPs (slice)", per(lambda f: f"{f.model_flops:.3e}")),
        ("floor", [f"{verdict.floor_seconds * 1e3:.1f} ms (no step runs faster)"]),
        ("step estimate", [f"{verdict.estimate_seconds * 1e3:.1f} ms ({estimate_note})"]),
        ("MFU (estimated)", [f"{verdict.mfu:.1%}"]),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {' | '.join(v)}" for k, v in rows)


def record(what: str, topology: Topology, figures: Figures, verdict: Verdict, **extra) -> dict:
    """The plan's JSON record (one program)."""
    return {
        "what": what,
        "topology": topology.name,
        "chips": topology.chips,
        "hbm_bytes": topology.hbm_bytes,
        "chip_source": topology.chip.source,
        **dataclasses.asdict(figures),
        "peak_bytes": figures.peak,
        **dataclasses.asdict(verdict),
        **extra,
    }


def write_json(path: str | os.PathLike, records: list[dict]) -> None:
    """Writes ``records`` to ``path`` atomically (a partial file never appears)."""
    atomic.write_text(path, json.dumps(records, indent=2, sort_keys=True) + "\n")


def _error(predicted: float, actual: float) -> str:
    """The prediction's error against ``actual``, signed (``-`` when ``actual`` is 0)."""
    return f"{(predicted - actual) / actual:+.1%}" if actual else "-"


def against_the_chip(figures: Figures, verdict: Verdict, measured, topology: Topology) -> str:
    """The plan's peak, floor, estimate and MFU beside what ``measured``
    (:class:`posttrain.plan.measure.Measured`) found on the chips, with the errors; the
    plan's memory figures beside the ``memory_analysis()`` of the executable the steps
    ran (rows ``... (chip's compile)``), when ``measured`` has one; the predicted headroom
    beside the probed one (:mod:`posttrain.plan.headroom`), when it was probed."""
    rows = [("", "predicted", "measured", "error")]
    rows.append(
        (
            "peak per device",
            gib(figures.peak),
            gib(measured.peak_bytes),
            _error(figures.peak, measured.peak_bytes),
        )
    )
    # the executable the steps ran, as the chips' compiler sized it: tells a compile that
    # differs from the plan's apart from a runtime that holds less than its program
    compiled = measured.compiled
    for name in [n for n in MEMORY_FIELDS if n in compiled]:  # records before a field: none
        predicted, actual = getattr(figures, name), compiled[name]
        rows.append(
            (f"{name} (chip's compile)", gib(predicted), gib(actual), _error(predicted, actual))
        )
    rows.append(
        (
            "HBM per chip",
            gib(topology.hbm_bytes),
            gib(measured.bytes_limit),
            _error(topology.hbm_bytes, measured.bytes_limit),
        )
    )
    if measured.headroom_bytes >= 0:  # the largest ballast the step ran beside
        probed = measured.headroom_bytes
        rows.append(
            (
                "headroom (probed)",
                gib(verdict.headroom),
                gib(probed),
                _error(verdict.headroom, probed),
            )
        )
    rows.append(
        (
            "verdict",
            "fits" if verdict.fits else "does NOT fit",
            "ran" if measured.fits else f"refused ({measured.error[:80]})",
            "",
        )
    )
    if measured.fits:
        rows.extend(_step_rows(figures, verdict, measured, topology))
    width = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, width, strict=True)).rstrip() for r in rows
    )


def _step_rows(figures: Figures, verdict: Verdict, measured, topology: Topology) -> list:
    """:func:`against_the_chip`'s rows of the step's time: floor, estimate, MFU, steps."""
    seconds = measured.step_seconds
    step = f"{seconds * 1e3:.1f} ms"
    below = "at or below" if verdict.floor_seconds <= seconds else "ABOVE the step"
    estimate = verdict.estimate_seconds
    mfu = figures.model_flops / (seconds * topology.chip.peak_flops * topology.chips)
    return [
        ("floor", f"{verdict.floor_seconds * 1e3:.1f} ms", step, below),
        ("step", f"{estimate * 1e3:.1f} ms", step, _error(estimate, seconds)),
        ("MFU", f"{verdict.mfu:.1%}", f"{mfu:.1%}", _error(verdict.mfu, mfu)),
        ("steps", "", f"{measured.steps} (first {measured.first_step_seconds:.1f} s)", ""),
    ]
