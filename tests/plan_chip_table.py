"""The plan's step estimate against the steps a v5e ran: ``python -m tests.plan_chip_table``
prints docs/scale.md's table ("The estimate calibrated on five steps") from the records
of ``tests/plan_chip_v5e.json`` and ``tests/plan_chip_v5e_donated.json`` (the five the
v5e's efficiencies were fitted to) and ``tests/plan_chip_v5e_heldout.json`` (run after the
fit), each judged by today's :func:`posttrain.plan.report.judge` as
``tests/test_plan_chip.py`` judges them."""

from __future__ import annotations

import re

from posttrain.plan import report, topology
from tests.test_plan_chip import DONATED, HELD_OUT, RECORDS, _figures


def rows() -> list[tuple[str, float, float, float, float, str, bool]]:
    """``(options, estimate s, measured s, estimated MFU, measured MFU, bound, fitted)`` a
    record; ``fitted``: one of the five the efficiencies were fitted to."""
    out = []
    fitted = len(RECORDS + DONATED)
    for i, record in enumerate(RECORDS + DONATED + HELD_OUT):
        v5e = topology.get(record["topology"])
        figures, step = _figures(record), record["measured"]["step_seconds"]
        verdict = report.judge(figures, v5e)
        measured = figures.model_flops / (step * v5e.chip.peak_flops * v5e.chips)
        options = re.split(r"--run-steps \d+ ", record["command"])[1]
        options = re.sub(r" --(profile \S+|probe-headroom)", "", options)
        out.append(
            (
                options,
                verdict.estimate_seconds,
                step,
                verdict.mfu,
                measured,
                verdict.bound,
                i < fitted,
            )
        )
    return out


def main() -> None:
    print("| options | estimate | measured step | MFU est. / measured | error | bound | fit |")
    print("|---|---|---|---|---|---|---|")
    for options, estimate, step, mfu, measured, bound, fitted in rows():
        print(
            f"| {options} | {estimate * 1e3:.1f} ms | {step * 1e3:.1f} ms | "
            f"{mfu:.1%} / {measured:.1%} | {mfu / measured - 1:+.1%} | {bound} | "
            f"{'fitted' if fitted else 'held out'} |"
        )


if __name__ == "__main__":
    main()
