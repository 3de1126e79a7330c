"""Figures extrapolated in depth from shallow compiles (the fast route, and the costs of a
scanned decoder).

A decoder's per-device figures grow by the same amount with each layer period
(``ModelConfig.layer_period`` layers: 1 for a uniform model, the sliding/full pattern's
length otherwise): ``f(L) = f(p) + (L / p - 1) * (f(2p) - f(p))``. Two uses:

- costs: XLA's ``cost_analysis()`` counts a while loop's body once, so a scanned decoder's
  FLOPs and bytes accessed are those of one layer period. The same model compiled
  unscanned at ``p`` and ``2p`` layers counts every layer; their line gives the full
  depth's (:func:`with_unscanned_costs`).
- memory (``extrapolated_figures``): two scanned compiles at ``p`` and ``2p`` layers
  instead of the full depth. Arguments and outputs are linear in depth by construction
  (one more period of stacked weights); temporaries are what the compiler chose, and only
  a full compile says whether they are (docs/scale.md records what held).
"""

from __future__ import annotations

import dataclasses

from posttrain.plan.compile import compile_figures
from posttrain.plan.options import PlanOptions, planned_config
from posttrain.plan.report import Figures

_MEMORY_FIELDS = ("arguments", "outputs", "aliased", "temporaries", "code")


def linear(at_p: float, at_2p: float, layers: int, period: int) -> float:
    """``f(L)`` on the line through ``(p, f(p))`` and ``(2p, f(2p))``.

    Raises:
      ValueError: ``layers`` is not a positive multiple of ``period``.
    """
    if period < 1 or layers < period or layers % period:
        raise ValueError(f"layers={layers} must be a positive multiple of period={period}")
    return at_p + (layers // period - 1) * (at_2p - at_p)


def _shallow(options: PlanOptions, layers: int, scan: bool) -> Figures:
    shallow = dataclasses.replace(
        options, num_layers=layers, scan_layers=scan, extrapolate=False, json_path=None
    )
    return compile_figures(shallow)[1]


def with_unscanned_costs(options: PlanOptions, figures: Figures) -> Figures:
    """``figures`` (a scanned compile) with FLOPs and bytes accessed of the full depth,
    from unscanned compiles of one and two layer periods; unchanged when the model has a
    single period (its one loop iteration is counted right)."""
    cfg = planned_config(options)
    period, layers = cfg.layer_period, cfg.num_layers
    if layers <= period:
        return figures
    one, two = _shallow(options, period, False), _shallow(options, 2 * period, False)
    return dataclasses.replace(
        figures,
        flops=linear(one.flops, two.flops, layers, period),
        bytes_accessed=linear(one.bytes_accessed, two.bytes_accessed, layers, period),
        compile_seconds=figures.compile_seconds + one.compile_seconds + two.compile_seconds,
        cost_source=f"unscanned {period} and {2 * period} layers, extrapolated to {layers}",
    )


def extrapolated_figures(options: PlanOptions) -> tuple[str, Figures]:
    """The fast route: ``(description, figures)`` of the full depth from scanned compiles of
    one and two layer periods (memory) and unscanned ones (costs), never compiling the whole
    model. Kinds (parameters, optimizer state ...) are exact: sharded bytes of stacked
    weights are linear in depth."""
    cfg = planned_config(options)
    period, layers = cfg.layer_period, cfg.num_layers
    one, two = _shallow(options, period, True), _shallow(options, 2 * period, True)
    fields = {
        f: int(linear(getattr(one, f), getattr(two, f), layers, period)) for f in _MEMORY_FIELDS
    }
    kinds = {k: int(linear(one.kinds[k], two.kinds[k], layers, period)) for k in one.kinds}
    figures = dataclasses.replace(
        one,
        **fields,
        kinds=kinds,
        model_flops=linear(one.model_flops, two.model_flops, layers, period),
        compile_seconds=one.compile_seconds + two.compile_seconds,
    )
    what = (
        f"{options.model} {options.workflow}, {layers} layers extrapolated from {period} "
        f"and {2 * period}"
    )
    return what, with_unscanned_costs(options, figures)
