"""Figures extrapolated in depth from shallow compiles (the fast route, and the costs of a
scanned decoder).

A decoder's per-device figures grow by the same amount with each layer period
(``ModelConfig.layer_period`` layers: 1 for a uniform model, the sliding/full pattern's
length otherwise), so two depths give the line (:func:`linear`). Two uses:

- costs: XLA's ``cost_analysis()`` counts a while loop's body once, so a scanned decoder's
  FLOPs and bytes accessed are those of one layer period. The same model compiled
  unscanned at ``p`` and ``2p`` layers counts every layer; their line gives the full
  depth's (:func:`with_unscanned_costs`).
- memory (:func:`extrapolated_figures`): two scanned compiles at ``2p`` and ``4p`` layers
  instead of the full depth. Not ``p``: a scan of one iteration is simplified away by XLA,
  and its temporaries belong to another program (qwen3_moe-30b-a3b LoRA: 1 -> 2 layers
  lowered the temporaries, and the line through them reached -14 GiB at 48). Arguments and
  outputs are linear in depth by construction (stacked weights and their optimizer state);
  temporaries are what the compiler chose, and only a full compile says whether they are
  (docs/scale.md records what held).
"""

from __future__ import annotations

import dataclasses

from posttrain.plan.compile import compile_stages
from posttrain.plan.options import PlanOptions, planned_config
from posttrain.plan.report import Figures

_MEMORY_FIELDS = (
    "arguments",
    "outputs",
    "aliased",
    "temporaries",
    "code",
    "resident",
    "live_peak",
)


def linear(first: tuple[int, float], second: tuple[int, float], layers: int) -> float:
    """``f(layers)`` on the line through ``first = (n1, f(n1))`` and ``second = (n2, f(n2))``.

    Raises:
      ValueError: ``n1 >= n2``, or ``n1 < 1``.
    """
    (n1, f1), (n2, f2) = first, second
    if not 1 <= n1 < n2:
        raise ValueError(f"depths {n1} and {n2} must satisfy 1 <= n1 < n2")
    return f1 + (layers - n1) * (f2 - f1) / (n2 - n1)


def extrapolated_source(period: int, layers: int, shallow_source: str) -> str:
    """The ``cost_source`` of costs extrapolated from unscanned compiles of ``period`` and
    ``2 * period`` layers whose own ``cost_source`` is ``shallow_source``: what that source
    adds after its first clause (``splash's kernels analytic``, ``later steps analytic``)
    is still in the figures, so it stays in the label. (Before 2026-12-06 it was dropped:
    the v5e records of splash steps said only ``unscanned 1 and 2 layers, extrapolated to
    28`` while their FLOPs held the kernels'.)
    """
    _, _, added = shallow_source.partition(", ")
    base = f"unscanned {period} and {2 * period} layers, extrapolated to {layers}"
    return f"{base}, {added}" if added else base


def _shallow(options: PlanOptions, layers: int, scan: bool) -> dict[str, Figures]:
    shallow = dataclasses.replace(
        options, num_layers=layers, scan_layers=scan, extrapolate=False, json_path=None
    )
    return compile_stages(shallow)[1]


def with_unscanned_costs(options: PlanOptions, stages: dict[str, Figures]) -> dict[str, Figures]:
    """``stages`` (each program's figures, from a scanned compile) with FLOPs and bytes
    accessed of the full depth, from unscanned compiles of one and two layer periods;
    unchanged when the model has a single period (its one loop iteration is counted
    right)."""
    cfg = planned_config(options)
    period, layers = cfg.layer_period, cfg.num_layers
    if layers <= period:
        return stages
    ones, twos = _shallow(options, period, False), _shallow(options, 2 * period, False)

    def full(name: str) -> Figures:
        figures, one, two = stages[name], ones[name], twos[name]
        return dataclasses.replace(
            figures,
            flops=linear((period, one.flops), (2 * period, two.flops), layers),
            bytes_accessed=linear(
                (period, one.bytes_accessed), (2 * period, two.bytes_accessed), layers
            ),
            compile_seconds=figures.compile_seconds + one.compile_seconds + two.compile_seconds,
            cost_source=extrapolated_source(period, layers, one.cost_source),
        )

    return {name: full(name) for name in stages}


def extrapolated_figures(options: PlanOptions) -> tuple[str, dict[str, Figures]]:
    """The fast route: ``(description, {program: figures})`` of the full depth from scanned
    compiles of two and four layer periods (memory) and unscanned ones of one and two
    (costs), never compiling the whole model. Kinds (parameters, optimizer state ...) are
    exact: sharded bytes of stacked weights are linear in depth.

    Raises:
      ValueError: the model has fewer than four layer periods (compile it whole).
    """
    cfg = planned_config(options)
    period, layers = cfg.layer_period, cfg.num_layers
    if layers < 4 * period:
        raise ValueError(f"extrapolate needs >= {4 * period} layers, the model has {layers}")
    n1, n2 = 2 * period, 4 * period
    shallow = _shallow(options, n1, True), _shallow(options, n2, True)

    def line(x: float, y: float) -> int:
        return int(linear((n1, x), (n2, y), layers))

    def deep(a: Figures, b: Figures) -> Figures:
        return dataclasses.replace(
            a,
            **{f: line(getattr(a, f), getattr(b, f)) for f in _MEMORY_FIELDS},
            kinds={k: line(a.kinds[k], b.kinds[k]) for k in a.kinds},
            model_flops=float(line(a.model_flops, b.model_flops)),
            attention_flops=float(line(a.attention_flops, b.attention_flops)),
            compile_seconds=a.compile_seconds + b.compile_seconds,
        )

    stages = {name: deep(shallow[0][name], shallow[1][name]) for name in shallow[0]}
    what = f"{options.model} {options.workflow}, {layers} layers extrapolated from {n1} and {n2}"
    return what, with_unscanned_costs(options, stages)
