"""``posttrain plan``: the trainer's real step compiled for a TPU slice that is not there.

Model config + topology + workflow -> abstract model with shardings (never
materialised; LoRA / QLoRA through :func:`posttrain.lora.abstract.abstract_lora`) -> the
program the workflow runs (:mod:`posttrain.plan.steps`), lowered and compiled by libtpu
for the slice's devices (:mod:`posttrain.plan.topology`) on this CPU -> per-device
memory by kind, FLOPs, a roofline floor and a verdict (:mod:`posttrain.plan.report`).

Modules: ``topology`` (slices and chips), ``options`` (:class:`PlanOptions`),
``abstract`` (the abstract model and its bytes), ``steps`` (the programs), ``report``
(figures, verdict, table, JSON), ``compile`` (one compile), ``depth`` (figures extrapolated
in depth from two shallow compiles: the fast route), ``cli`` (the subcommand).
"""

from __future__ import annotations

import dataclasses

from posttrain.plan.compile import DoesNotFit
from posttrain.plan.options import PlanOptions
from posttrain.plan.report import Figures, Verdict

__all__ = ["DoesNotFit", "PlanOptions", "Plan", "plan"]


@dataclasses.dataclass(frozen=True)
class Plan:
    """One compiled plan.

    Attributes:
      what: a one-line description (model, workflow, mesh, batch).
      options: the :class:`PlanOptions`.
      figures: :class:`~posttrain.plan.report.Figures`.
      verdict: :class:`~posttrain.plan.report.Verdict`.
    """

    what: str
    options: PlanOptions
    figures: Figures
    verdict: Verdict

    def table(self) -> str:
        from posttrain.plan import report, topology

        return report.table(
            self.what, topology.get(self.options.topology), self.figures, self.verdict
        )

    def record(self) -> dict:
        from posttrain.plan import report, topology

        topo = topology.get(self.options.topology)
        return report.record(
            self.what, topo, self.figures, self.verdict, options=dataclasses.asdict(self.options)
        )


def plan(options: PlanOptions) -> Plan:
    """Compiles ``options``' workflow for its topology and judges the result.

    A scanned decoder is one XLA while loop, whose body ``cost_analysis()`` counts once
    (qwen3-0.6b LoRA, 1 -> 2 scanned layers: +2% FLOPs; unscanned: +14%). Its FLOPs and
    bytes accessed therefore come from two shallow unscanned compiles extrapolated in depth
    (:func:`posttrain.plan.depth.with_unscanned_costs`); its memory from the real compile.

    Raises:
      NotImplementedError: a workflow not planned yet, or a GPU topology.
      ValueError: a mesh, batch or model the others do not divide (one line).
      DoesNotFit: the compiler itself rejected the program for lack of memory.
    """
    from posttrain.plan import depth, report, topology
    from posttrain.plan.compile import compile_figures

    if options.extrapolate:
        what, figures = depth.extrapolated_figures(options)
    else:
        what, figures = compile_figures(options)
    if options.scan_layers and not options.extrapolate:
        figures = depth.with_unscanned_costs(options, figures)
    return Plan(what, options, figures, report.judge(figures, topology.get(options.topology)))
