"""``posttrain plan``: the trainer's real step compiled for a TPU slice that is not there.

Model config + topology + workflow -> abstract model with shardings (never
materialised; LoRA / QLoRA through :func:`posttrain.lora.abstract.abstract_lora`) -> the
program the workflow runs (:mod:`posttrain.plan.steps`), lowered and compiled by libtpu
for the slice's devices (:mod:`posttrain.plan.topology`) on this CPU -> per-device
memory by kind, FLOPs, a roofline floor and a verdict (:mod:`posttrain.plan.report`).

Modules: ``topology`` (slices and chips), ``options`` (:class:`PlanOptions`),
``abstract`` (the abstract model and its bytes), ``steps`` (SFT's step, generation),
``workflows`` (DPO's and GRPO's programs), ``report``
(figures, verdict, table, JSON), ``compile`` (one compile), ``depth`` (figures extrapolated
in depth from two shallow compiles: the fast route), ``cli`` (the subcommand).
"""

from __future__ import annotations

import dataclasses

from posttrain.plan import compile as plan_compile
from posttrain.plan import depth, report, sizes, topology
from posttrain.plan.compile import DoesNotFit
from posttrain.plan.options import PlanOptions, planned_config
from posttrain.plan.report import Figures, Verdict
from posttrain.plan.topology import get as get_topology

__all__ = ["DoesNotFit", "PlanOptions", "Plan", "get_topology", "plan"]


@dataclasses.dataclass(frozen=True)
class Plan:
    """One compiled plan.

    Attributes:
      what: a one-line description (model, workflow, mesh, batch).
      options: the :class:`PlanOptions`.
      figures: :class:`~posttrain.plan.report.Figures` of the main program (the train
        step; ``generate``'s decode loop).
      verdict: :class:`~posttrain.plan.report.Verdict` of the whole workflow
        (:func:`~posttrain.plan.report.judge_stages`).
      stages: every program's figures by name (DPO: ``reference forward``, ``train
        step``; GRPO: ``rollout``, ``reference forward``, ``train step``).
    """

    what: str
    options: PlanOptions
    figures: Figures
    verdict: Verdict
    stages: dict = dataclasses.field(default_factory=dict)

    def table(self) -> str:
        topo = topology.get(self.options.topology)
        if len(self.stages) > 1:
            return report.stages_table(self.what, topo, self.stages, self.verdict)
        return report.table(self.what, topo, self.figures, self.verdict)

    def record(self) -> dict:
        topo = topology.get(self.options.topology)
        stages = {
            name: {**dataclasses.asdict(f), "peak_bytes": f.peak} for name, f in self.stages.items()
        }
        return report.record(
            self.what,
            topo,
            self.figures,
            self.verdict,
            options=dataclasses.asdict(self.options),
            stages=stages,
        )


def plan(options: PlanOptions) -> Plan:
    """Compiles ``options``' workflow for its topology and judges the result.

    A scanned decoder is one XLA while loop, whose body ``cost_analysis()`` counts once
    (qwen3-0.6b LoRA, 1 -> 2 scanned layers: +2% FLOPs; unscanned: +14%). Its FLOPs and
    bytes accessed therefore come from two shallow unscanned compiles extrapolated in depth
    (:func:`posttrain.plan.depth.with_unscanned_costs`); its memory from the real compile.

    Raises:
      NotImplementedError: a GPU topology.
      ValueError: an option out of range (:meth:`PlanOptions.check`), or a mesh, batch or
        model the others do not divide (one line).
      DoesNotFit: the compiler itself rejected the program for lack of memory.
    """
    options.check()
    sizes.check(options, planned_config(options), plan_compile.planned_batch(options))
    if options.extrapolate:
        what, stages = depth.extrapolated_figures(options)
    else:
        what, stages = plan_compile.compile_stages(options)
    if options.scan_layers and not options.extrapolate:
        stages = depth.with_unscanned_costs(options, stages)
    verdict = report.judge_stages(stages, topology.get(options.topology))
    return Plan(what, options, stages[plan_compile.main_stage(stages)], verdict, stages)
