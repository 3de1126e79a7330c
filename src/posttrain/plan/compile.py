"""One compile: options -> abstract model -> program -> libtpu executable -> figures."""

from __future__ import annotations

import time

from posttrain.plan.options import PLANNED, PlanOptions
from posttrain.plan.report import Figures


class DoesNotFit(Exception):
    """The compiler refused the program for lack of HBM (libtpu checks at compile time);
    the message is one line with the overflow and the knobs that help."""


def compile_figures(options: PlanOptions) -> tuple[str, Figures]:
    """``(description, figures)`` of ``options``' program compiled for its topology, as the
    compiler reports them (a scanned decoder's costs count its layer body once).

    Raises:
      NotImplementedError: a workflow not planned yet, or a GPU topology.
      ValueError: a mesh, batch or model the others do not divide (one line).
      DoesNotFit: the compiler refused the program for lack of memory.
    """
    from posttrain import sharding
    from posttrain.plan import abstract, report, steps, topology
    from posttrain.plan.options import check_output, planned_config

    if options.workflow not in PLANNED:
        raise NotImplementedError(
            f"workflow {options.workflow!r} is not planned yet; planned: {', '.join(PLANNED)}"
        )
    check_output(options.json_path)
    topo = topology.get(options.topology)
    cfg = planned_config(options)
    mesh = sharding.make_mesh(options.mesh, devices=topology.devices(topo))
    rules = sharding.DEFAULT_RULES
    cfg.check_mesh(dict(mesh.shape), rules)
    batch = options.batch or options.per_device_batch_size * sharding.data_parallel_size(mesh)
    model = abstract.abstract_model(cfg)
    if options.lora_rank:
        from posttrain.lora import LoraConfig
        from posttrain.lora.abstract import abstract_lora

        lora = LoraConfig(
            rank=options.lora_rank, alpha=options.lora_rank, weight_qtype=options.qlora
        )
        model = abstract_lora(model, mesh, lora, rules)
    if options.workflow == "sft":
        program = steps.sft_program(
            model,
            mesh,
            optimizer=options.optimizer,
            batch=batch,
            seq=options.seq,
            grad_accum=options.grad_accum,
            rules=rules,
        )
    else:
        program = steps.generate_program(
            model, mesh, batch=batch, prompt=options.seq, new_tokens=options.new_tokens, rules=rules
        )
    what = describe(options, cfg, mesh, batch)
    start = time.perf_counter()
    try:
        from posttrain import _compat

        # a deviceless compiler cannot load cached executables: the cache stays out
        with (
            sharding.use_mesh(mesh, rules, jax_context=False),
            _compat.no_persistent_compilation_cache(),
        ):
            compiled = program.jitted.lower(*program.args, **program.kwargs).compile()
    except Exception as e:  # XlaRuntimeError: RESOURCE_EXHAUSTED at compile time
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        first = next((ln for ln in str(e).splitlines() if ln.strip()), "")
        raise DoesNotFit(
            f"{what} does not fit {topo.name}: the compiler refused it ({first.strip()[:240]}); "
            f"try {report.KNOBS}"
        ) from None
    seconds = time.perf_counter() - start
    return what, report.figures_of(compiled, program.kinds, program.model_flops, seconds)


def describe(options: PlanOptions, cfg, mesh, batch: int) -> str:
    """``qwen3_moe-30b-a3b sft lora r16, 48 layers, mesh tensor=4,fsdp=2,expert=2,
    batch 16 x 2048, remat full, bfloat16 params``."""
    axes = ",".join(f"{a}={n}" for a, n in mesh.shape.items() if n > 1) or "1 device"
    tuning = f"lora r{options.lora_rank}" if options.lora_rank else "full"
    if options.qlora:
        tuning = f"qlora {options.qlora} r{options.lora_rank}"
    if options.workflow == "generate":
        tuning = f"{options.new_tokens} new tokens"
    accum = f", grad_accum {options.grad_accum}" if options.grad_accum > 1 else ""
    return (
        f"{options.model} {options.workflow} {tuning}, {cfg.num_layers} layers, mesh {axes}, "
        f"batch {batch} x {options.seq}{accum}, remat {cfg.remat}, {cfg.param_dtype} params"
    )
