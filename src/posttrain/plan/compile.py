"""One compile: options -> abstract model -> program -> libtpu executable -> figures."""

from __future__ import annotations

import contextlib
import dataclasses
import time

from posttrain.plan import report, topology
from posttrain.plan.options import PlanOptions, check_output, planned_config
from posttrain.plan.report import Figures


class DoesNotFit(Exception):
    """The compiler refused the program for lack of HBM (libtpu checks at compile time);
    the message is one line with the overflow and the knobs that help."""


def compile_figures(options: PlanOptions) -> tuple[str, Figures]:
    """``(description, figures)`` of ``options``' main program (the train step; for
    ``generate`` the decode loop) compiled for its topology (:func:`compile_stages`)."""
    what, stages = compile_stages(options)
    return what, stages[main_stage(stages)]


def main_stage(stages: dict) -> str:
    """The program a plan's single figures describe: the train step when there is one."""
    return "train step" if "train step" in stages else next(iter(stages))


def compile_stages(options: PlanOptions) -> tuple[str, dict[str, Figures]]:
    """``(description, {program: figures})`` of ``options``' workflow compiled for its
    topology, as the compiler reports them (a scanned decoder's costs count its layer
    body once; a decode loop's its first step, the rest added analytically).

    Raises:
      NotImplementedError: a GPU topology.
      ValueError: a mesh, batch or model the others do not divide (one line).
      DoesNotFit: the compiler refused a program for lack of memory.
    """
    check_output(options.json_path)
    topo = topology.get(options.topology)
    what, programs, mesh = build_programs(options, topo)
    stages = {}
    advice = report.knobs(options, topo)
    for name, program in programs.items():
        stages[name] = _compile(
            program,
            mesh,
            f"{what}: {name}" if len(programs) > 1 else what,
            topo,
            advice,
            deviceless=not options.run_steps,
        )
    return what, stages


def build_programs(options: PlanOptions, topo) -> tuple[str, dict, object]:
    """``(description, {program name: Program}, trainer mesh)`` of ``options``' workflow on
    the abstract model."""
    from posttrain import sharding
    from posttrain.plan import abstract, steps, workflows

    cfg = planned_config(options)
    devices = plan_devices(options, topo)
    mesh = sharding.make_mesh(options.mesh, devices=devices)
    rules = sharding.DEFAULT_RULES
    cfg.check_mesh(dict(mesh.shape), rules)
    batch = planned_batch(options)
    # built for the mesh's platform: splash attention checks it (the slice's TPUs)
    with sharding.use_mesh(mesh, rules, jax_context=False):
        model = abstract.abstract_model(cfg)
    if options.lora_rank:
        from posttrain.lora import LoraConfig
        from posttrain.lora.abstract import abstract_lora

        lora = LoraConfig(
            rank=options.lora_rank, alpha=options.lora_rank, weight_qtype=options.qlora
        )
        model = abstract_lora(model, mesh, lora, rules)
    common = {"optimizer": options.optimizer, "rules": rules}
    if options.workflow == "sft":
        programs = {
            "train step": steps.sft_program(
                model, mesh, batch=batch, seq=options.seq, grad_accum=options.grad_accum, **common
            )
        }
    elif options.workflow == "dpo":
        programs = workflows.dpo_programs(
            model, mesh, pairs=batch, prompt=options.seq, response=options.new_tokens, **common
        )
    elif options.workflow == "grpo":
        rollout_mesh = mesh
        if options.rollout_mesh is not None:
            rollout_mesh = sharding.make_mesh(options.rollout_mesh, devices=devices)
            cfg.check_mesh(dict(rollout_mesh.shape), rules)
        programs = workflows.grpo_programs(
            model,
            mesh,
            rollout_mesh,
            rows=batch,
            prompt=options.seq,
            completion=options.new_tokens,
            num_iterations=options.num_iterations,
            **common,
        )
    else:
        programs = {
            "generate": steps.generate_program(
                model,
                mesh,
                batch=batch,
                prompt=options.seq,
                new_tokens=options.new_tokens,
                rules=rules,
            )
        }
    return describe(options, cfg, mesh, batch), programs, mesh


def planned_batch(options: PlanOptions) -> int:
    """The global batch of a plan: ``--batch``, else ``--per-device-batch-size`` x the
    mesh's data-parallel size (every chip on ``fsdp`` without ``--mesh``), known before
    any device is made."""
    from posttrain import sharding

    mesh = options.mesh or {"fsdp": topology.get(options.topology).chips}
    return options.batch or options.per_device_batch_size * sharding.data_parallel_size(mesh)


def plan_devices(options: PlanOptions, topo) -> list:
    """The devices a plan compiles for: libtpu's deviceless ones, or with ``run_steps`` this
    process's chips, which the program will run on (:mod:`posttrain.plan.chips`)."""
    from posttrain.plan import chips

    return chips.chip_devices(topo) if options.run_steps else topology.devices(topo)


def _compile(program, mesh, what: str, topo, advice: str, *, deviceless: bool = True) -> Figures:
    """One program lowered and compiled for ``topo``'s devices; its figures.

    A deviceless compile runs with JAX's persistent compilation cache off (libtpu's
    compile-only client cannot load a cached executable); one for this host's chips
    (``deviceless`` false: ``--run-steps``) uses it where it is on
    (``JAX_COMPILATION_CACHE_DIR``): the same plan run again on the chip compiles nothing.

    Raises:
      DoesNotFit: the compiler refused it for lack of memory (``what`` names it, and
        ``advice`` what to try).
    """
    from posttrain import _compat, sharding

    start = time.perf_counter()
    try:
        with (
            sharding.use_mesh(mesh, sharding.DEFAULT_RULES, jax_context=False),
            _compat.no_persistent_compilation_cache() if deviceless else contextlib.nullcontext(),
        ):
            compiled = program.jitted.lower(*program.args, **program.kwargs).compile()
    except Exception as e:  # XlaRuntimeError: RESOURCE_EXHAUSTED at compile time
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        first = next((ln for ln in str(e).splitlines() if ln.strip()), "")
        raise DoesNotFit(
            f"{what} does not fit {topo.name}: the compiler refused it ({first.strip()[:240]}); "
            f"try {advice}"
        ) from None
    seconds = time.perf_counter() - start
    figures = report.figures_of(
        compiled,
        program.kinds,
        program.model_flops,
        seconds,
        program.resident,
        program.attention_flops,
    )
    flops, moved = program.uncounted
    if flops or moved:
        figures = dataclasses.replace(
            figures,
            flops=figures.flops + flops,
            bytes_accessed=figures.bytes_accessed + moved,
            cost_source=program.cost_source,
        )
    return figures


def describe(options: PlanOptions, cfg, mesh, batch: int) -> str:
    """``qwen3_moe-30b-a3b sft lora r16, 48 layers, mesh tensor=4,fsdp=2,expert=2,
    batch 16 x 2048, remat full, bfloat16 params`` (``remat full, splash attention``
    with ``--attention-kernel splash``)."""
    axes = ",".join(f"{a}={n}" for a, n in mesh.shape.items() if n > 1) or "1 device"
    tuning = f"lora r{options.lora_rank}" if options.lora_rank else "full"
    if options.qlora:
        tuning = f"qlora {options.qlora} r{options.lora_rank}"
    rows = f"batch {batch} x {options.seq}"
    if options.workflow == "generate":
        tuning = f"{options.new_tokens} new tokens"
    elif options.workflow == "dpo":
        rows = f"{batch} pairs x {options.seq} prompt + {options.new_tokens} response"
    elif options.workflow == "grpo":
        rows = f"{batch} rows x {options.seq} prompt + {options.new_tokens} completion"
        if options.rollout_mesh:
            rollout = ",".join(f"{a}={n}" for a, n in options.rollout_mesh.items() if n > 1)
            axes += f", rollout mesh {rollout or '1 device'}"
        if options.num_iterations > 1:
            rows += f", {options.num_iterations} iterations"
    accum = f", grad_accum {options.grad_accum}" if options.grad_accum > 1 else ""
    kernel = "" if cfg.attention_kernel == "xla" else f", {cfg.attention_kernel} attention"
    return (
        f"{options.model} {options.workflow} {tuning}, {cfg.num_layers} layers, mesh {axes}, "
        f"{rows}{accum}, remat {cfg.remat}{kernel}, {cfg.param_dtype} params"
    )
