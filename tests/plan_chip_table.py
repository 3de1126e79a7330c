"""The plan's step estimate against the steps a v5e ran: ``python -m tests.plan_chip_table``
prints docs/scale.md's table ("The estimate at the model's FLOPs") from the thirteen
records of ``tests/plan_chip_v5e*.json``, each judged by today's
:func:`posttrain.plan.report.judge` as ``tests/test_plan_chip.py`` judges them, with the
error of each when the v5e's two efficiencies are fitted to the other twelve instead
(:func:`fit`, :func:`left_out_errors`), and how the estimate before it (the compiled
FLOPs' roofline, :func:`compiled_errors`) fares fitted the same way."""

from __future__ import annotations

import dataclasses
import re

from posttrain.plan import report, topology
from tests.test_plan_chip import DONATED, HELD_OUT, RECORDS, SFT, _figures

#: every record the chip ran, in the files' order
ALL = RECORDS + DONATED + HELD_OUT + SFT
#: the grid :func:`fit` searches: flop_efficiency, then hbm_share, in steps of 0.005 / 0.01
EFFICIENCIES = [round(0.30 + 0.005 * i, 3) for i in range(61)]  # 0.30 .. 0.60
SHARES = [round(0.30 + 0.01 * i, 2) for i in range(71)]  # 0.30 .. 1.00


def options_of(record: dict) -> str:
    """The record's options after the topology (and ``--run-steps N``), less the profile
    and probe flags."""
    parts = re.split(r"--run-steps \d+ ", record["command"])
    options = parts[1] if len(parts) > 1 else record["command"].split("--topology v5e-1 ")[1]
    return re.sub(r" --(profile \S+|probe-headroom)", "", options)


def errors(records: list[dict], efficiency: float, share: float) -> list[float]:
    """Each record's estimated MFU over its measured one, less 1, with the v5e's
    ``flop_efficiency`` and ``hbm_share`` set to ``efficiency`` and ``share``."""
    v5e = topology.get("v5e-1")
    chip = dataclasses.replace(v5e.chip, flop_efficiency=efficiency, hbm_share=share)
    at = dataclasses.replace(v5e, chip=chip)
    out = []
    for figures, step in map(_judged, records):
        measured = figures.model_flops / (step * chip.peak_flops * at.chips)
        out.append(report.judge(figures, at).mfu / measured - 1)
    return out


def compiled_errors(records: list[dict], efficiency: float, share: float) -> list[float]:
    """:func:`errors` under the estimate before 2026-12-08: ``max(compiled FLOPs / (peak x
    efficiency), bytes accessed x share / bandwidth)``, the compiled FLOPs a remat policy's
    recomputation among them."""
    chip = topology.get("v5e-1").chip
    out = []
    for figures, step in map(_judged, records):
        estimate = max(
            figures.flops / (chip.peak_flops * efficiency),
            figures.bytes_accessed * share / chip.hbm_bandwidth,
        )
        out.append(step / estimate - 1)  # MFU estimated / measured: the same model FLOPs
    return out


def _judged(record: dict) -> tuple[report.Figures, float]:
    """The record's figures (:func:`tests.test_plan_chip._figures`, made once) and its
    measured step."""
    key = id(record)
    if key not in _FIGURES:
        _FIGURES[key] = _figures(record)
    return _FIGURES[key], record["measured"]["step_seconds"]


_FIGURES: dict[int, report.Figures] = {}


def fit(records: list[dict], errors_fn=errors) -> tuple[float, float]:
    """The ``(flop_efficiency, hbm_share)`` of the grid whose largest MFU error over
    ``records`` (``errors_fn``: :func:`errors` or :func:`compiled_errors`) is least (the
    first such, in grid order)."""
    grid = [(e, s) for e in EFFICIENCIES for s in SHARES]
    return min(grid, key=lambda g: max(abs(x) for x in errors_fn(records, *g)))


def left_out_errors(records: list[dict], errors_fn=errors) -> list[float]:
    """Each record's MFU error under the :func:`fit` to all the others."""
    return [
        errors_fn([record], *fit(records[:i] + records[i + 1 :], errors_fn))[0]
        for i, record in enumerate(records)
    ]


def main() -> None:
    v5e = topology.get("v5e-1")
    print(f"v5e: flop_efficiency {v5e.chip.flop_efficiency}, hbm_share {v5e.chip.hbm_share}")
    print("| options | estimate | measured step | MFU est. / measured | error | left out | bound |")
    print("|---|---|---|---|---|---|---|")
    for record, left_out in zip(ALL, left_out_errors(ALL), strict=True):
        figures, step = _figures(record), record["measured"]["step_seconds"]
        verdict = report.judge(figures, v5e)
        measured = figures.model_flops / (step * v5e.chip.peak_flops * v5e.chips)
        print(
            f"| {options_of(record)} | {verdict.estimate_seconds * 1e3:.1f} ms | "
            f"{step * 1e3:.1f} ms | {verdict.mfu:.1%} / {measured:.1%} | "
            f"{verdict.mfu / measured - 1:+.1%} | {left_out:+.1%} | {verdict.bound} |"
        )
    best = fit(ALL, compiled_errors)
    worst = max(abs(x) for x in compiled_errors(ALL, *best))
    left = max(abs(x) for x in left_out_errors(ALL, compiled_errors))
    print(
        f"the compiled FLOPs' roofline (before 2026-12-08), fitted the same way: "
        f"{best[0]} and {best[1]}, worst {worst:.1%}; each left out: worst {left:.1%}"
    )


if __name__ == "__main__":
    main()
