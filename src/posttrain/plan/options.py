"""``PlanOptions``: everything ``posttrain plan`` takes (its flags), and their check."""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Literal

from posttrain.atomic import check_output_file
from posttrain.config import AttentionKernelChoice, ModelConfig, RematPolicy, choices
from posttrain.conversion.errors import read_json_object
from posttrain.flags import option

Workflow = Literal["sft", "dpo", "grpo", "generate"]
Optimizer = Literal["adamw", "sgd", "adafactor"]
DType = Literal["bfloat16", "float32"]


def _mesh_spec(text: str) -> dict[str, int]:
    """``--mesh tensor=4,fsdp=2`` -> ``{"tensor": 4, "fsdp": 2}``.

    Raises:
      ValueError: not ``axis=size`` pairs of known axes.
    """
    from posttrain import sharding

    return sharding.parse_mesh_spec(text)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """One plan.

    Attributes:
      model: a preset name or an HF checkpoint / config directory (``config.json``).
      topology: a :data:`posttrain.plan.topology.TOPOLOGIES` name (``v5p-32``).
      mesh: axis sizes (``{"tensor": 4, "fsdp": 2, "expert": 2}``); ``None`` puts every
        device on ``fsdp`` (the trainer's default).
      workflow: ``sft``, ``dpo`` (the train step and the reference forward), ``grpo``
        (the rollout, the reference forward and the train step) or ``generate``.
      rollout_mesh: GRPO's rollout mesh (``None``: the trainer's, whose model it shares).
      lora_rank: LoRA rank; 0 trains every parameter.
      qlora: QLoRA's base-weight type (``int8`` ...), or ``None``; needs ``lora_rank``.
      remat: the decoder's rematerialisation policy.
      attention_kernel: ``ModelConfig.attention_kernel``: ``splash`` compiles JAX's Pallas
        splash attention (Mosaic, for the topology's TPUs) where training runs it.
      per_device_batch_size: rows per data-parallel shard; the global batch is this x
        the data-parallel size. Ignored when ``batch`` is given.
      batch: the global batch (rows per micro-step; DPO: pairs, GRPO: completions, i.e.
        prompts x generations), or ``None``.
      seq: tokens per row (the prompt length for ``generate``, ``dpo`` and ``grpo``).
      new_tokens: tokens ``generate`` samples after the prompt; the completion length of
        ``dpo`` and ``grpo``.
      grad_accum: micro-batches per optimizer step.
      num_iterations: GRPO's ``num_iterations`` (μ, Tunix's ``GRPOConfig``): steps per
        rollout batch; above 1 Tunix runs the old-policy forward before them, a program
        the plan then compiles too (``posttrain grpo`` keeps Tunix's 1).
      optimizer: the optax transformation.
      dtype, param_dtype: activation and parameter dtypes.
      scan_layers: scan the decoder's layers (one compiled layer body).
      num_layers: compile this many layers instead of the model's.
      extrapolate: the fast route: compile one and two layer periods and extrapolate the
        figures to the full depth (:mod:`posttrain.plan.depth`) instead of compiling it.
      json_path: write the JSON record here.
      run_steps: after planning, build the program on this process's TPU chips (which must
        be the topology's), run it this many times and print the measured peak HBM, step
        time and MFU beside the predicted ones (:mod:`posttrain.plan.measure`); 0: plan
        only.
      search: plan every rematerialisation policy x per-device batch (1, 2, 4, ... up to
        ``search_max_batch``) and print the fastest that fits
        (:mod:`posttrain.plan.search`); ``remat`` and ``per_device_batch_size`` are then
        the search's, and ``run_steps`` runs each candidate that fits on the chip, picks
        the fastest by its steps and runs it once more for the chip's table.
      search_max_batch: the largest per-device batch ``search`` tries.

    Each field is also a flag of ``posttrain plan`` (:mod:`posttrain.flags`); the values
    are checked by :meth:`check`, as every subcommand's options are.
    """

    model: str = option(help="preset name or HF config directory", required=True)
    topology: str = option(help="slice, e.g. v5p-8, v5p-32, v5e-16, v6e-16", required=True)
    mesh: dict[str, int] | None = option(
        None,
        "axis sizes, e.g. tensor=4,fsdp=2,expert=2 (default: every device on fsdp)",
        parse=_mesh_spec,
    )
    rollout_mesh: dict[str, int] | None = option(
        None,
        "grpo: the rollout's axis sizes (default: the trainer's mesh, model shared)",
        parse=_mesh_spec,
    )
    workflow: Workflow = option("sft", "the workflow whose step is compiled")
    lora_rank: int = option(0, "0: full fine-tuning", show_default=False)
    qlora: str | None = option(None, "QLoRA base-weight type (int8, int4, nf4, float8_e4m3fn)")
    remat: RematPolicy = option("full", "rematerialisation of the decoder layers")
    attention_kernel: AttentionKernelChoice = option(
        "xla", "splash: compile JAX's Pallas splash attention (as --attention-kernel trains)"
    )
    per_device_batch_size: int = option(1, "rows per data-parallel shard")
    batch: int | None = option(None, "global batch (overrides the above)")
    seq: int = option(2048, "tokens per row (generate, dpo, grpo: the prompt)")
    new_tokens: int = option(128, "generate: tokens sampled; dpo, grpo: the completion")
    grad_accum: int = option(1, "micro-batches per optimizer step")
    num_iterations: int = option(
        1, "grpo: steps per rollout batch (Tunix's; > 1 adds the old-policy forward)"
    )
    optimizer: Optimizer = option("adamw", "the optax transformation")
    dtype: DType = option("bfloat16", "activation dtype")
    param_dtype: DType = option("bfloat16", "parameter dtype")
    scan_layers: bool = option(True, "unroll the decoder's layers", flag="--no-scan")
    num_layers: int | None = option(
        None, "compile this many layers (the fast route; default: the model's)"
    )
    extrapolate: bool = option(
        False,
        "compile 2 and 4 layer periods and extrapolate to the full depth: arguments exact, "
        "temporaries underestimated (docs/scale.md)",
    )
    json_path: str | None = option(None, "write the JSON record to this file", flag="--json")
    run_steps: int = option(
        0,
        "run the planned step N times on this host's chips (the topology's) and print "
        "measured beside predicted",
        show_default=False,
    )
    profile_dir: str | None = option(
        None,
        "with --run-steps N >= 2: trace the steps after the first into this directory and "
        "print the ops that took the chip's time",
        flag="--profile",
    )
    probe_headroom: bool = option(
        False,
        "with --run-steps: then run the step beside ballast to find the HBM it really "
        "leaves free, and print it beside the plan's headroom",
    )
    search: bool = option(
        False,
        "plan each remat policy x per-device batch (1, 2, 4, ...) and print the fastest "
        "that fits (--remat and --per-device-batch-size are the search's); with "
        "--run-steps N, run each that fits on this host's chips and pick by their steps",
    )
    search_max_batch: int = option(64, "--search: the largest per-device batch tried")

    def check(self) -> None:
        """Refuses values outside their ranges and a JSON path whose directory does not
        exist, before any compile (:func:`posttrain.plan.plan` calls it; the CLI too).

        Raises:
          ValueError: one line naming the value and what was expected.
        """
        for name, literal in (
            ("workflow", Workflow),
            ("remat", RematPolicy),
            ("attention_kernel", AttentionKernelChoice),
            ("optimizer", Optimizer),
            ("dtype", DType),
            ("param_dtype", DType),
        ):
            value = getattr(self, name)
            if value not in choices(literal):
                raise ValueError(f"{name}={value!r} must be one of {', '.join(choices(literal))}")
        if self.qlora is not None:
            from posttrain.lora.config import WEIGHT_QTYPES  # imports Qwix (train extra)

            if self.qlora not in WEIGHT_QTYPES:
                raise ValueError(f"qlora={self.qlora!r} must be one of {', '.join(WEIGHT_QTYPES)}")
        for name in ("per_device_batch_size", "seq", "new_tokens", "grad_accum", "num_iterations"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.search_max_batch < 1:
            raise ValueError(f"search_max_batch={self.search_max_batch} must be >= 1")
        if self.search and self.batch is not None:
            raise ValueError(
                f"search varies the per-device batch; batch={self.batch} fixes it: drop --batch"
            )
        self.check_run_steps()
        if self.lora_rank < 0:
            raise ValueError(f"lora_rank={self.lora_rank} must be >= 0")
        if self.qlora and not self.lora_rank:
            raise ValueError(f"qlora={self.qlora!r} needs lora_rank >= 1")
        if self.batch is not None and self.batch < 1:
            raise ValueError(f"batch={self.batch} must be >= 1")
        if self.num_layers is not None and self.num_layers < 1:
            raise ValueError(f"num_layers={self.num_layers} must be >= 1")
        if self.extrapolate and not self.scan_layers:
            raise ValueError("extrapolate=True compiles scanned layer periods; drop --no-scan")
        if self.workflow == "generate" and (self.lora_rank or self.grad_accum > 1):
            raise ValueError("generate plans the base model: drop --lora-rank and --grad-accum")
        if self.workflow in ("dpo", "grpo") and (self.extrapolate or self.grad_accum > 1):
            raise ValueError(
                f"workflow={self.workflow!r} plans one micro-step of whole compiles: drop "
                "--extrapolate and --grad-accum"
            )
        if self.rollout_mesh is not None and self.workflow != "grpo":
            raise ValueError(f"rollout_mesh is GRPO's; workflow={self.workflow!r}")
        if self.num_iterations > 1 and self.workflow != "grpo":
            raise ValueError(f"num_iterations is GRPO's; workflow={self.workflow!r}")
        check_output(self.json_path)

    def check_run_steps(self) -> None:
        """Refuses ``run_steps`` (and ``profile_dir``, ``probe_headroom``) where they cannot
        run: negative, on a workflow other than SFT, with ``extrapolate``, a profile
        without a step after the first, a probe without a step.

        Raises:
          ValueError: one line naming the value and what was expected.
        """
        if self.run_steps < 0:
            raise ValueError(f"run_steps={self.run_steps} must be >= 0")
        if self.run_steps and self.workflow != "sft":
            raise ValueError(
                f"run_steps measures the sft step; workflow={self.workflow!r} is planned only"
            )
        if self.profile_dir is not None and self.run_steps < 2:
            raise ValueError(
                f"profile_dir={self.profile_dir!r} traces the steps after the first: it needs "
                f"run_steps >= 2, got {self.run_steps}"
            )
        if self.probe_headroom and self.run_steps < 1:
            raise ValueError(
                f"probe_headroom runs the step beside ballast: it needs run_steps >= 1, "
                f"got {self.run_steps}"
            )
        if self.run_steps and self.extrapolate:
            raise ValueError("run_steps runs the full depth: drop --extrapolate")


def load_config(spec: str) -> ModelConfig:
    """The ``ModelConfig`` of a preset name or of an HF directory's ``config.json``.

    Raises:
      ValueError: neither a preset nor a directory with a readable ``config.json``.
    """
    from posttrain.conversion.hf_config import from_hf_config
    from posttrain.models import get_config
    from posttrain.models.presets import PRESETS

    if spec in PRESETS:
        return get_config(spec)
    path = pathlib.Path(spec)
    if path.is_dir() and (path / "config.json").is_file():
        return from_hf_config(read_json_object(path / "config.json"))
    raise ValueError(
        f"--model {spec!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a "
        f"directory with a config.json"
    )


def planned_config(options: PlanOptions) -> ModelConfig:
    """The model config a plan compiles: the model's, with the plan's dtypes, remat,
    attention kernel, scanning and (the fast route) depth."""
    from posttrain.plan.abstract import with_depth

    cfg = load_config(options.model)
    cfg = cfg.replace(
        remat=options.remat,
        attention_kernel=options.attention_kernel,
        dtype=options.dtype,
        param_dtype=options.param_dtype,
        scan_layers=options.scan_layers,
    )
    if options.num_layers is not None:
        cfg = with_depth(cfg, options.num_layers)
    return cfg


def check_output(path: str | None) -> None:
    """Refuses a ``--json`` path that cannot be written (empty, a directory, under a
    missing or unwritable directory) before any compile.

    Raises:
      ValueError: naming the path and what is wrong with it.
    """
    if path is not None:
        check_output_file(path, flag="--json")
