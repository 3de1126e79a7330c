"""The ``posttrain`` command.

Subcommands:
  sft           supervised fine-tuning (SFTTrainer on Tunix); no arguments: the embedded run.
  generate      sample from a model with its KV cache (default: the newest sft export).
  grpo          RL with GRPO / DAPO / DrGRPO through Tunix's learners; no arguments: the
                embedded addition task after a short warm-up SFT.
  dpo           preference tuning (DPO, ORPO) through Tunix's DPOTrainer; no arguments:
                the embedded preference pairs.
  distill       distillation (logit) through Tunix's DistillationTrainer; no arguments: a
                tiny teacher into a smaller student, the held-out KL printed.
  forward       build a preset on a mesh, run a jitted forward, print shardings and figures.
  convert       HF checkpoint directory <-> native checkpoint directory (streamed, atomic).
  check-logits  run an HF checkpoint (transformers, fp32 CPU) and a native one on the same
                tokens; print max |delta logit|, mean KL(HF || native), top-1 agreement.
  plan          compile a workflow's step for a TPU slice on this CPU (libtpu, the tpu
                extra): per-device memory, FLOPs, roofline floor; exit 1 when it does not fit.

Each subcommand is a row of :data:`COMMANDS`: its options dataclass, whose fields are
its flags (:mod:`posttrain.flags`), and its function in :mod:`posttrain.commands`.
Errors in the arguments or inputs print one line and exit with status 2; an internal
error prints one line and exits with 1 (``--debug`` or ``POSTTRAIN_DEBUG=1``: the
traceback); check-logits exits with 1 past its thresholds; SIGINT / SIGTERM clean up,
print one line and exit with 130 / 143.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
import warnings
from typing import NoReturn

from posttrain import distributed, flags, signals
from posttrain.cli_options import (
    CheckLogitsOptions,
    ConvertOptions,
    ForwardOptions,
    GenerateOptions,
)
from posttrain.distill.options import DistillRunConfig
from posttrain.plan.options import PlanOptions
from posttrain.preference.options import DPORunConfig
from posttrain.rl.options import GRPORunConfig
from posttrain.sft.options import SFTConfig
from posttrain.xla_flags import jaxlib_version, with_collective_timeout


def _set_devices(count: str) -> None:
    """Fake CPU devices before JAX is imported (this is a program entry point).

    Nothing when JAX is imported already (``main`` called in a process that runs JAX, as
    the tests do): the flags could no longer take effect, and left in ``os.environ`` they
    told that process's later JAX users (pytest's in-process sessions) another count.
    """
    if count == "real" or "jax" in sys.modules:
        return
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    xla_flags = [
        f
        for f in os.environ.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    xla_flags.append(f"--xla_force_host_platform_device_count={int(count)}")
    os.environ["XLA_FLAGS"] = with_collective_timeout(" ".join(xla_flags), jaxlib_version())


@dataclasses.dataclass(frozen=True)
class Command:
    """One subcommand: its options dataclass (the flags, :mod:`posttrain.flags`) and the
    function of :mod:`posttrain.commands` that runs them (named, imported when run).

    Attributes:
      devices: takes ``--devices`` (fake CPU devices or ``real``, set before JAX starts)
        and joins the processes of a launch; else it runs on the CPU backend.
      multi_process: runs correctly across processes (``posttrain-harness launch``); the
        others refuse to start there rather than write from every process or hang (#20).
    """

    name: str
    options: type
    run: str
    help: str
    description: str | None = None
    devices: bool = True
    multi_process: bool = True


#: Every subcommand: a new one is an options dataclass, a function and a row here.
COMMANDS = (
    Command(
        "sft",
        SFTConfig,
        "sft",
        "supervised fine-tuning; no arguments: the embedded run",
        "SFT with SFTTrainer (a Tunix PeftTrainer). Defaults: qwen3-tiny on the embedded "
        "pydoc_data Q/A set, byte tokenizer, every device on fsdp.",
    ),
    Command(
        "forward", ForwardOptions, "forward", "build a preset on a mesh and run a forward pass"
    ),
    Command(
        "convert",
        ConvertOptions,
        "convert",
        "convert a checkpoint between HF and native formats",
        devices=False,
    ),
    Command(
        "check-logits",
        CheckLogitsOptions,
        "check_logits",
        "compare HF and native logits (fp32, CPU)",
        devices=False,
        multi_process=False,
    ),
    Command(
        "generate",
        GenerateOptions,
        "generate",
        "sample from a preset, a native or an HF directory (KV cache)",
    ),
    Command(
        "grpo",
        GRPORunConfig,
        "grpo",
        "GRPO (DAPO, DrGRPO) through Tunix; no arguments: the embedded addition task",
        "RL with Tunix's GRPO learners over our model, rollouts on Tunix's vanilla sampler "
        "with our KV cache. Defaults: qwen3-tiny, a 100-step warm-up SFT on the embedded "
        "single-digit addition task, then GRPO with an exact-answer and a format reward, "
        "every device on fsdp.",
    ),
    Command(
        "dpo",
        DPORunConfig,
        "dpo",
        "preference tuning (DPO, ORPO) through Tunix; no arguments: the embedded pairs",
        "DPO or ORPO with Tunix's DPOTrainer over our model. Defaults: qwen3-tiny on the "
        "embedded pydoc_data preference pairs (the true answer chosen, another topic's "
        "answer with its words reversed rejected; 1 in 8 held out), every device on fsdp. "
        "After posttrain sft: --model runs/sft/model-step60.",
    ),
    Command(
        "distill",
        DistillRunConfig,
        "distill",
        "distillation through Tunix; no arguments: a tiny teacher into a smaller student",
        "Logit distillation with Tunix's DistillationTrainer and LogitStrategy, our step in "
        "front (prompt and padding out of the objective). Defaults: the student qwen3-tiny "
        "one layer deep, the teacher runs/sft/model-step60 if present, else llama3-tiny "
        "trained on the fly; the embedded pydoc_data set, 1 in 8 held out for the KL.",
        multi_process=True,
    ),
    Command(
        "plan",
        PlanOptions,
        "plan",
        "compile a workflow's step for a TPU slice on this CPU; say whether it fits",
        "Compile the step a workflow runs for a TPU slice without the chips (libtpu, the "
        "tpu extra) and report per-device memory, FLOPs, a roofline floor and whether it "
        "fits. Exit 1 when it does not.",
        devices=False,  # JAX runs on the CPU; libtpu gives the slice's devices
        multi_process=False,
    ),
)

#: Subcommands that run correctly across processes (``posttrain-harness launch``).
MULTI_PROCESS = tuple(c.name for c in COMMANDS if c.multi_process)


def build_parser() -> argparse.ArgumentParser:
    """``posttrain``'s parser: one subparser per :data:`COMMANDS` row, its flags generated
    from the row's options (:func:`posttrain.flags.add_options`)."""
    parser = flags.Parser(prog="posttrain", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--debug",
        action="store_true",
        help="show the traceback of an error (also POSTTRAIN_DEBUG=1)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        parsed = sub.add_parser(command.name, help=command.help, description=command.description)
        flags.add_options(parsed, command.options)
        if command.devices:
            parsed.add_argument(
                "--devices",
                default=os.environ.get("POSTTRAIN_DEVICES", "8"),
                help="fake CPU devices, or 'real' (default %(default)s)",
            )
    return parser


def parse_options(argv: list[str]):
    """The options (unchecked) of the command line ``argv``: ``parse_options(["sft",
    "--steps", "3"])`` is ``SFTConfig(steps=3)``.

    Raises:
      ValueError: a flag whose value its field's ``parse`` refuses (e.g. ``--mesh``).
    """
    args = build_parser().parse_args(argv)
    return flags.options_from(_command(args.command).options, args)


def _command(name: str) -> Command:
    (command,) = (c for c in COMMANDS if c.name == name)
    return command


def parse_devices(value: str) -> str:
    """``--devices``: ``real`` or a positive integer (as a string).

    Raises:
      ValueError: anything else, naming the value.
    """
    if value == "real":
        return value
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1 or str(count) != value.strip():
        raise ValueError(f"--devices {value!r}: expected a positive integer or 'real'")
    return str(count)


# Bad input: one line, exit 2. OSError covers unreadable or unwritable paths.
_INPUT_ERRORS = (ValueError, OSError, NotImplementedError)


def _one_line(error: BaseException) -> str:
    if isinstance(error, OSError) and error.filename is not None and error.strerror:
        return f"{error.strerror}: {error.filename}"
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


#: the start of JAX's platform advice that a command does not print (:func:`main`)
PLATFORM_ADVICE = "Transparent hugepages are not enabled"


def main(argv: list[str] | None = None) -> int:
    """Runs ``posttrain`` with ``argv``; returns the exit status.

    Bad input (a ``ValueError``, an ``OSError`` on a path, an unsupported option) prints
    one line ``posttrain: error: ...`` and returns 2. Another process's failure
    (``distributed.OtherProcessFailed``) prints one line and returns 1. Anything else is
    a bug: one line ``posttrain: internal error: ...`` and 1, the traceback only with ``--debug`` or
    ``POSTTRAIN_DEBUG=1``. Ctrl-C and SIGTERM: one line, 130 / 143.

    JAX's advice at import on a TPU VM without transparent hugepages (a ``UserWarning``
    from ``jax/_src/cloud_tpu_init.py``, 0.10.2) is not printed: it names the machine,
    not the run, and stood before the one line a failing command prints (issue 54).
    """
    warnings.filterwarnings("ignore", message=PLATFORM_ADVICE, category=UserWarning)
    args = build_parser().parse_args(argv)
    debug = args.debug or os.environ.get("POSTTRAIN_DEBUG", "") not in ("", "0")
    try:
        # generate writes only through atomic renames: it may exit at once on a signal
        with signals.interrupts(immediate=args.command == "generate"):
            return _dispatch(args)
    except KeyboardInterrupt as interrupt:
        signal_name, status = signals.exit_status(interrupt)
        print(signals.line(signal_name), file=sys.stderr)
        return status
    except _INPUT_ERRORS as e:
        if debug:
            raise
        print(f"posttrain: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except distributed.OtherProcessFailed as e:  # not this process's bug: the other's error
        print(f"posttrain: {_one_line(e)}", file=sys.stderr)
        return 1
    except Exception as e:
        if debug:
            raise
        print(
            f"posttrain: internal error: {type(e).__name__}: {_one_line(e)} "
            "(rerun with --debug for the traceback)",
            file=sys.stderr,
        )
        return 1


def run() -> NoReturn:
    """The ``posttrain`` console script: :func:`main` on the command line. An interrupted
    command (status 130 or 143, which :func:`main` returns for nothing else) ends through
    :func:`signals.leave`, without the interpreter's shutdown, which waits for (on a TPU:
    crashed on) an XLA compile the interrupt abandoned."""
    status = main()
    if status in signals.EXIT_CODES.values():
        signals.leave(status)
    sys.exit(status)


def _dispatch(args: argparse.Namespace) -> int:
    command = _command(args.command)
    if distributed.launched() and not command.multi_process:
        raise ValueError(
            f"posttrain {args.command} does not run across processes yet (it would read its "
            f"data and write its outputs in every process); across processes: "
            f"{', '.join(MULTI_PROCESS)}"
        )
    if command.devices:
        _set_devices(parse_devices(args.devices))
        distributed.initialize()  # a no-op outside the launcher and POSTTRAIN_DISTRIBUTED
    elif not (args.command == "plan" and args.run_steps):  # --run-steps: on the chips
        os.environ.setdefault("JAX_PLATFORMS", "cpu")  # conversion, parity, plans: CPU work
    options = flags.options_from(command.options, args)
    options.check()
    return getattr(importlib.import_module("posttrain.commands"), command.run)(options)


if __name__ == "__main__":
    sys.exit(main())
