"""``posttrain plan``: the run of its options (:class:`~posttrain.plan.options.PlanOptions`,
whose fields are its flags; a row of :data:`posttrain.cli.COMMANDS`).

Compiles, prints the table, writes the JSON and returns 0 when the program fits, 1 with
one line on stderr when it does not (bad input was refused before: one line, exit 2).
"""

from __future__ import annotations

import dataclasses
import sys

from posttrain.plan import DoesNotFit, plan, report, search, topology
from posttrain.plan.options import PlanOptions


def run(options: PlanOptions) -> int:
    """Runs ``posttrain plan``; returns the exit status (0 fits, 1 does not)."""
    if options.search:
        return run_search(options)
    try:
        result = plan(options)
    except DoesNotFit as e:
        print(f"posttrain plan: {e}", file=sys.stderr)
        return 1
    print(result.table())
    record = result.record()
    if options.run_steps:
        from posttrain.plan import measure

        measured = measure.measure(options)
        topo = topology.get(options.topology)
        print(report.against_the_chip(result.figures, result.verdict, measured, topo))
        record["measured"] = dataclasses.asdict(measured)
        if options.profile_dir is not None and measured.fits:
            from posttrain.plan import profile

            found = profile.read(options.profile_dir, measured.steps - 1)
            print(profile.table(found, measured.step_seconds))
            record["profile"] = profile.record(found)
    if options.json_path is not None:
        report.write_json(options.json_path, [record])
    if not result.verdict.fits:
        topo = topology.get(options.topology)
        print(
            "posttrain plan: "
            + report.overflow_line(
                result.figures.peak, topo, result.what, report.knobs(options, topo)
            ),
            file=sys.stderr,
        )
        return 1
    return 0


def run_search(options: PlanOptions) -> int:
    """``posttrain plan --search``: the table of candidates and the fastest that fits
    (:mod:`posttrain.plan.search`); with ``--run-steps`` every candidate that fits is run
    on the chip, the fastest chosen by its step, and then planned and run once more for
    its table beside the chip's (and ``--json``). Returns 0 when one fits, 1 (one line on
    stderr) when none does."""
    options.check()
    found = search.search(options)
    print(search.table(found, search.tokens_per_row(options)))
    best = search.fastest(found)
    if best is None:
        print(f"posttrain plan: {search.advice(found)}", file=sys.stderr)
        return 1
    print(search.advice(found))
    if options.run_steps:
        chosen = dataclasses.replace(
            options,
            search=False,
            remat=best.remat,
            per_device_batch_size=best.per_device_batch_size,
        )
        return run(chosen)
    return 0
