"""``posttrain plan``: the run of its options (:class:`~posttrain.plan.options.PlanOptions`,
whose fields are its flags; a row of :data:`posttrain.cli.COMMANDS`).

Compiles, prints the table, writes the JSON and returns 0 when the program fits, 1 with
one line on stderr when it does not (bad input was refused before: one line, exit 2).
"""

from __future__ import annotations

import sys

from posttrain.plan.options import PlanOptions


def run(options: PlanOptions) -> int:
    """Runs ``posttrain plan``; returns the exit status (0 fits, 1 does not)."""
    from posttrain.plan import DoesNotFit, plan, report, topology

    try:
        result = plan(options)
    except DoesNotFit as e:
        print(f"posttrain plan: {e}", file=sys.stderr)
        return 1
    print(result.table())
    if options.json_path:
        report.write_json(options.json_path, [result.record()])
    if not result.verdict.fits:
        topo = topology.get(options.topology)
        print(
            f"posttrain plan: {report.overflow_line(result.figures.peak, topo, result.what)}",
            file=sys.stderr,
        )
        return 1
    return 0
