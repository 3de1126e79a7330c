"""``posttrain plan``: the subcommand's arguments and its run.

``add_parser(subparsers)`` declares the arguments (choices from the ``Literal`` types
of :class:`~posttrain.plan.options.PlanOptions`); ``run(args)`` builds the options (bad
input: ``ValueError``, one line, exit 2 from ``posttrain``), compiles, prints the table,
writes the JSON and returns 0 when the program fits, 1 with one line on stderr when it
does not.
"""

from __future__ import annotations

import argparse
import os
import sys

from posttrain.config import RematPolicy, choices
from posttrain.plan.options import DType, Optimizer, PlanOptions, Workflow


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Adds ``plan`` to ``subparsers`` (an ``add_subparsers()`` result)."""
    p = subparsers.add_parser(
        "plan",
        help="compile a workflow's step for a TPU slice on this CPU; say whether it fits",
        description="Compile the step a workflow runs for a TPU slice without the chips "
        "(libtpu, the tpu extra) and report per-device memory, FLOPs, a roofline floor "
        "and whether it fits. Exit 1 when it does not.",
    )
    p.add_argument("--model", required=True, help="preset name or HF config directory")
    p.add_argument("--topology", required=True, help="slice, e.g. v5p-8, v5p-32, v5e-16, v6e-16")
    p.add_argument(
        "--mesh",
        default=None,
        help="axis sizes, e.g. tensor=4,fsdp=2,expert=2 (default: every device on fsdp)",
    )
    p.add_argument(
        "--rollout-mesh",
        default=None,
        help="grpo: the rollout's axis sizes (default: the trainer's mesh, model shared)",
    )
    p.add_argument("--workflow", default="sft", choices=choices(Workflow))
    p.add_argument("--lora-rank", type=int, default=0, help="0: full fine-tuning")
    p.add_argument(
        "--qlora",
        default=None,
        metavar="QTYPE",
        help="QLoRA base-weight type (int8, int4, nf4, float8_e4m3fn)",
    )
    p.add_argument("--remat", default="full", choices=choices(RematPolicy))
    p.add_argument("--per-device-batch-size", type=int, default=1)
    p.add_argument("--batch", type=int, default=None, help="global batch (overrides the above)")
    p.add_argument("--seq", type=int, default=2048, help="tokens per row (generate: prompt)")
    p.add_argument("--new-tokens", type=int, default=128, help="generate: tokens sampled")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--optimizer", default="adamw", choices=choices(Optimizer))
    p.add_argument("--dtype", default="bfloat16", choices=choices(DType))
    p.add_argument("--param-dtype", default="bfloat16", choices=choices(DType))
    p.add_argument("--no-scan", action="store_true", help="unroll the decoder's layers")
    p.add_argument(
        "--num-layers",
        type=int,
        default=None,
        help="compile this many layers (the fast route; default: the model's)",
    )
    p.add_argument(
        "--extrapolate",
        action="store_true",
        help="compile 2 and 4 layer periods and extrapolate to the full depth: arguments "
        "exact, temporaries underestimated (docs/scale.md)",
    )
    p.add_argument("--json", default=None, help="write the JSON record to this file")
    return p


def options_of(args: argparse.Namespace) -> PlanOptions:
    """The :class:`PlanOptions` of parsed arguments.

    Raises:
      ValueError: a bad value (one line, naming it).
    """
    from posttrain import sharding

    return PlanOptions(
        model=args.model,
        topology=args.topology,
        mesh=sharding.parse_mesh_spec(args.mesh) if args.mesh else None,
        rollout_mesh=sharding.parse_mesh_spec(args.rollout_mesh) if args.rollout_mesh else None,
        workflow=args.workflow,
        lora_rank=args.lora_rank,
        qlora=args.qlora,
        remat=args.remat,
        per_device_batch_size=args.per_device_batch_size,
        batch=args.batch,
        seq=args.seq,
        new_tokens=args.new_tokens,
        grad_accum=args.grad_accum,
        optimizer=args.optimizer,
        dtype=args.dtype,
        param_dtype=args.param_dtype,
        scan_layers=not args.no_scan,
        num_layers=args.num_layers,
        extrapolate=args.extrapolate,
        json_path=args.json,
    )


def run(args: argparse.Namespace) -> int:
    """Runs ``posttrain plan``; returns the exit status (0 fits, 1 does not)."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # libtpu compiles; JAX itself runs on CPU
    options = options_of(args)
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
