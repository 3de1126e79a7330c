"""The ``posttrain`` command.

Subcommands:
  sft           supervised fine-tuning (SFTTrainer on Tunix); no arguments: the embedded run.
  generate      sample from a model with its KV cache (default: the newest sft export).
  grpo          RL with GRPO / DAPO / DrGRPO through Tunix's learners; no arguments: the
                embedded addition task after a short warm-up SFT.
  dpo           preference tuning (DPO, ORPO) through Tunix's DPOTrainer; no arguments:
                the embedded preference pairs.
  forward       build a preset on a mesh, run a jitted forward, print shardings and figures.
  convert       HF checkpoint directory <-> native checkpoint directory (streamed, atomic).
  plan          compile a workflow's step for a TPU slice on this CPU (libtpu, the tpu
                extra): per-device memory, FLOPs, roofline floor; exit 1 when it does not fit.
  check-logits  run an HF checkpoint (transformers, fp32 CPU) and a native one on the same
                tokens; print max |delta logit|, mean KL(HF || native), top-1 agreement.

The subcommands' work is in :mod:`posttrain.commands`. Errors in the arguments or
inputs print one line and exit with status 2; an internal
error prints one line and exits with 1 (``--debug`` or ``POSTTRAIN_DEBUG=1``: the
traceback); check-logits exits with 1 past its thresholds; SIGINT / SIGTERM clean up,
print one line and exit with 130 / 143.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from posttrain import commands, distributed
from posttrain.config import RematPolicy, choices
from posttrain.plan import cli as plan_cli


def _set_devices(count: str) -> None:
    """Fake CPU devices before JAX is imported (this is a program entry point)."""
    if count == "real":
        return
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = [
        f
        for f in os.environ.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    flags.append(f"--xla_force_host_platform_device_count={int(count)}")
    os.environ["XLA_FLAGS"] = " ".join(flags)


def _byte_size(text: str) -> int:
    """``4GB``, ``500MB``, ``1GiB`` or a plain number of bytes."""
    units = {
        "kib": 1 << 10,
        "mib": 1 << 20,
        "gib": 1 << 30,
        "kb": 10**3,
        "mb": 10**6,
        "gb": 10**9,
        "b": 1,
    }
    lower = text.strip().lower()
    for unit, factor in units.items():
        if lower.endswith(unit) and lower[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(lower[: -len(unit)]) * factor)
    if lower.isdigit():
        return int(lower)
    raise argparse.ArgumentTypeError(f"{text!r} is not a size like 4GB, 500MB or 1GiB")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="posttrain", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--debug",
        action="store_true",
        help="show the traceback of an error (also POSTTRAIN_DEBUG=1)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sft = sub.add_parser(
        "sft",
        help="supervised fine-tuning; no arguments: the embedded run",
        description="SFT with SFTTrainer (a Tunix PeftTrainer). Defaults: "
        "qwen3-tiny on the embedded pydoc_data Q/A set, byte tokenizer, "
        "every device on fsdp.",
    )
    sft.add_argument(
        "--model",
        default="qwen3-tiny",
        help="preset name or HF checkpoint directory (default %(default)s)",
    )
    sft.add_argument("--data", default=None, help="chat JSONL file (default: embedded pydoc_data)")
    sft.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer.json (default: the HF dir's, else the byte tokenizer)",
    )
    sft.add_argument(
        "--mesh",
        default=None,
        help="axis sizes, e.g. data=2,fsdp=4 (default: every device on fsdp)",
    )
    sft.add_argument(
        "--devices",
        default=os.environ.get("POSTTRAIN_DEVICES", "8"),
        help="fake CPU devices, or 'real' (default %(default)s)",
    )
    sft.add_argument(
        "--per-device-batch-size",
        type=int,
        default=1,
        help="global batch = this x data-parallel size (default %(default)s)",
    )
    sft.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
    sft.add_argument("--steps", type=int, default=60, help="optimizer steps (default %(default)s)")
    sft.add_argument("--max-target-length", type=int, default=256, help="tokens per row")
    sft.add_argument("--no-packing", action="store_true", help="one conversation per row")
    sft.add_argument(
        "--data-shards",
        type=int,
        default=None,
        help="split the data into N shards, each packed and shuffled on its own; each "
        "process tokenises only its shards (default: one per process slice of the batch)",
    )
    sft.add_argument(
        "--overflow",
        choices=("truncate", "reject"),
        default="truncate",
        help="conversations longer than a row (default %(default)s)",
    )
    sft.add_argument("--learning-rate", type=float, default=3e-3)
    sft.add_argument("--warmup-steps", type=int, default=5)
    sft.add_argument("--lora-rank", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
    sft.add_argument("--lora-alpha", type=float, default=None, help="default 2 x rank")
    sft.add_argument("--remat", default="none", choices=choices(RematPolicy))
    sft.add_argument("--scan", action="store_true", help="scan_layers=True")
    sft.add_argument("--seed", type=int, default=0)
    sft.add_argument("--save-every", type=int, default=50, help="checkpoint interval (steps)")
    sft.add_argument(
        "--sync-saves",
        action="store_true",
        help="finish each checkpoint before the next step (default: Orbax saves in the "
        "background; a kill loses the steps since the last completed save)",
    )
    sft.add_argument(
        "--replica-parallel-saves",
        default="auto",
        metavar="{auto,on,off}",
        help="Orbax's replica-parallel writes of replicated arrays (auto: off in one CPU "
        "process, else on; default %(default)s)",
    )
    sft.add_argument(
        "--stop-after",
        type=int,
        default=None,
        help="stop at this step; rerun with the same --output to resume",
    )
    sft.add_argument(
        "--output",
        default="runs/sft",
        help="run directory; a rerun resumes from its checkpoint (default %(default)s)",
    )

    fwd = sub.add_parser("forward", help="build a preset on a mesh and run a forward pass")
    fwd.add_argument("--model", default="qwen3_moe-tiny", help="preset name (default %(default)s)")
    fwd.add_argument(
        "--mesh",
        default="fsdp=4,tensor=2",
        help="axis sizes, e.g. data=2,fsdp=2,expert=2 (default %(default)s)",
    )
    fwd.add_argument(
        "--devices",
        default=os.environ.get("POSTTRAIN_DEVICES", "8"),
        help="fake CPU devices, or 'real' (default %(default)s)",
    )
    fwd.add_argument("--per-device-batch-size", type=int, default=1)
    fwd.add_argument("--seq", type=int, default=64)
    fwd.add_argument("--scan", action="store_true", help="scan_layers=True")
    fwd.add_argument("--remat", default="none", choices=choices(RematPolicy))
    fwd.add_argument("--repeats", type=int, default=5)
    fwd.add_argument("--seed", type=int, default=0)

    conv = sub.add_parser("convert", help="convert a checkpoint between HF and native formats")
    conv.add_argument("--from", dest="source_format", choices=("hf", "native"), required=True)
    conv.add_argument("--to", dest="target_format", choices=("hf", "native"), required=True)
    conv.add_argument("src", help="source directory")
    conv.add_argument("dst", help="destination directory (must not exist)")
    conv.add_argument(
        "--scan",
        action="store_true",
        help="hf -> native: store layers stacked for scan_layers=True",
    )
    conv.add_argument(
        "--layout",
        choices=("hub", "fused"),
        default=None,
        help="native -> hf: hub (per-expert tensors, default) or fused experts",
    )
    conv.add_argument(
        "--prefix",
        default=None,
        help="native -> hf: key prefix, model. (default) or model.language_model.",
    )
    conv.add_argument(
        "--max-shard-size",
        type=_byte_size,
        default=4 << 30,
        help="largest output shard (default 4GiB)",
    )
    conv.add_argument(
        "--no-fsync",
        action="store_true",
        help="skip flushing the shards to disk before the atomic rename",
    )

    chk = sub.add_parser("check-logits", help="compare HF and native logits (fp32, CPU)")
    chk.add_argument("hf_dir")
    chk.add_argument("native_dir")
    chk.add_argument(
        "--max-kl",
        type=float,
        default=1e-6,
        help="fail above this mean KL(HF || native) (default %(default)g)",
    )
    chk.add_argument(
        "--atol",
        type=float,
        default=None,
        help="fail above this max |delta logit| (default: not checked)",
    )
    chk.add_argument("--seq", type=int, default=16)
    chk.add_argument("--seed", type=int, default=7)

    gen = sub.add_parser(
        "generate", help="sample from a preset, a native or an HF directory (KV cache)"
    )
    gen.add_argument(
        "--model",
        default=None,
        help="preset, native directory (e.g. runs/sft/model-step60) or HF directory "
        "(default: the newest runs/sft/model-step<N>)",
    )
    gen.add_argument("--adapter", default=None, help="a LoRA adapter directory to apply")
    gen.add_argument("--tokenizer", default=None, help="tokenizer.json (default: see docs)")
    gen.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    gen.add_argument(
        "--prompts", default=None, help='JSONL: {"prompt": ...} or {"messages": [...]}'
    )
    gen.add_argument("--chat", action="store_true", help="wrap --prompt in the ChatML template")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (and a preset's init)")
    gen.add_argument("--cache-size", type=int, default=None, help="default: prompt + new tokens")
    gen.add_argument("--output", default=None, help="JSONL file (default: stdout)")
    gen.add_argument("--mesh", default=None, help="axis sizes, e.g. fsdp=4,tensor=2")
    gen.add_argument(
        "--devices",
        default=os.environ.get("POSTTRAIN_DEVICES", "8"),
        help="fake CPU devices, or 'real' (default %(default)s)",
    )
    rl = sub.add_parser(
        "grpo",
        help="GRPO (DAPO, DrGRPO) through Tunix; no arguments: the embedded addition task",
        description="RL with Tunix's GRPO learners over our model, rollouts on Tunix's "
        "vanilla sampler with our KV cache. Defaults: qwen3-tiny, a 100-step warm-up SFT on "
        "the embedded single-digit addition task, then GRPO with an exact-answer and a "
        "format reward, every device on fsdp.",
    )
    rl.add_argument("--model", default="qwen3-tiny", help="preset, native or HF directory")
    rl.add_argument("--tokenizer", default=None, help="tokenizer.json (default: byte tokenizer)")
    rl.add_argument("--mesh", default=None, help="actor/reference axis sizes (default: fsdp)")
    rl.add_argument(
        "--rollout-mesh",
        default=None,
        help="rollout axis sizes on the same devices, e.g. data=8 (default: the actor's)",
    )
    rl.add_argument(
        "--rollout-dtype",
        default=None,
        help="float32 or bfloat16: the rollout copy's parameters, cast at each sync; needs "
        "--rollout-mesh and google-tunix >= 0.1.2 (default: the actor's)",
    )
    rl.add_argument(
        "--devices",
        default=os.environ.get("POSTTRAIN_DEVICES", "8"),
        help="fake CPU devices, or 'real' (default %(default)s)",
    )
    rl.add_argument(
        "--per-device-batch-size",
        type=int,
        default=2,
        help="prompts per data-parallel shard (default %(default)s)",
    )
    rl.add_argument("--num-generations", type=int, default=8, help="completions per prompt")
    rl.add_argument("--steps", type=int, default=150, help="GRPO steps (default %(default)s)")
    rl.add_argument("--learning-rate", type=float, default=5e-4)
    rl.add_argument("--lora-rank", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
    rl.add_argument("--lora-alpha", type=float, default=None, help="default 2 x rank")
    rl.add_argument("--algorithm", default="grpo", metavar="{grpo,dapo,drgrpo}")
    rl.add_argument("--beta", type=float, default=None, help="KL coefficient (default: Tunix's)")
    rl.add_argument("--epsilon", type=float, default=0.2, help="clipping range")
    rl.add_argument("--temperature", type=float, default=1.0, help="rollout temperature")
    rl.add_argument("--max-prompt-length", type=int, default=32)
    rl.add_argument("--max-new-tokens", type=int, default=6)
    rl.add_argument(
        "--reward",
        action="append",
        default=None,
        help="built-in name (exact_answer, answer_format) or module:function; repeatable "
        "(default: exact_answer and answer_format)",
    )
    rl.add_argument("--warmup-steps", type=int, default=100, help="SFT steps first (0: none)")
    rl.add_argument(
        "--warmup-data-shards",
        type=int,
        default=None,
        help="the warm-up SFT's --data-shards (default: one per process slice of the batch)",
    )
    rl.add_argument(
        "--eval-samples",
        type=int,
        default=4,
        help="completions per task problem in the evaluation before and after (0: none)",
    )
    rl.add_argument("--seed", type=int, default=0)
    rl.add_argument("--save-every", type=int, default=10, help="checkpoint interval (steps)")
    rl.add_argument(
        "--stop-after", type=int, default=None, help="stop at this step; rerun to resume"
    )
    rl.add_argument(
        "--output",
        default="runs/grpo",
        help="run directory; a rerun resumes from its checkpoint (default %(default)s)",
    )
    dpo = sub.add_parser(
        "dpo",
        help="preference tuning (DPO, ORPO) through Tunix; no arguments: the embedded pairs",
        description="DPO or ORPO with Tunix's DPOTrainer over our model. Defaults: "
        "qwen3-tiny on the embedded pydoc_data preference pairs (the true answer chosen, "
        "another topic's answer with its words reversed rejected; 1 in 8 held out), every "
        "device on fsdp. "
        "After posttrain sft: --model runs/sft/model-step60.",
    )
    dpo.add_argument(
        "--model",
        default="qwen3-tiny",
        help="preset, native directory (e.g. runs/sft/model-step60) or HF directory",
    )
    dpo.add_argument(
        "--data",
        default=None,
        help="preference JSONL: prompt, chosen, rejected (default: embedded)",
    )
    dpo.add_argument(
        "--eval-data",
        default=None,
        help="held-out preference JSONL, evaluated before and after (default: the embedded "
        "held-out pairs with the embedded data)",
    )
    dpo.add_argument("--tokenizer", default=None, help="tokenizer.json (default: see sft)")
    dpo.add_argument("--mesh", default=None, help="axis sizes (default: every device on fsdp)")
    dpo.add_argument(
        "--devices",
        default=os.environ.get("POSTTRAIN_DEVICES", "8"),
        help="fake CPU devices, or 'real' (default %(default)s)",
    )
    dpo.add_argument(
        "--per-device-batch-size",
        type=int,
        default=1,
        help="pairs per data-parallel shard (default %(default)s)",
    )
    dpo.add_argument(
        "--data-shards",
        type=int,
        default=None,
        help="split the pairs into N shards, each shuffled on its own; each process "
        "tokenises only its shards (default: one per process slice of the batch)",
    )
    dpo.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
    dpo.add_argument("--steps", type=int, default=40, help="optimizer steps (default %(default)s)")
    dpo.add_argument("--max-prompt-length", type=int, default=96)
    dpo.add_argument("--max-response-length", type=int, default=160)
    dpo.add_argument(
        "--overflow",
        choices=("truncate", "reject"),
        default="truncate",
        help="prompts / completions longer than those (default %(default)s)",
    )
    dpo.add_argument("--algorithm", default="dpo", metavar="{dpo,orpo}")
    dpo.add_argument("--beta", type=float, default=0.1, help="DPO beta (default %(default)s)")
    dpo.add_argument("--label-smoothing", type=float, default=0.0)
    dpo.add_argument(
        "--lambda-orpo",
        type=float,
        default=0.1,
        help="ORPO odds-ratio weight (default %(default)s)",
    )
    dpo.add_argument("--learning-rate", type=float, default=1e-3)
    dpo.add_argument("--warmup-steps", type=int, default=5)
    dpo.add_argument("--lora-rank", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
    dpo.add_argument("--lora-alpha", type=float, default=None, help="default 2 x rank")
    dpo.add_argument("--remat", default="none", choices=choices(RematPolicy))
    dpo.add_argument("--scan", action="store_true", help="scan_layers=True")
    dpo.add_argument("--seed", type=int, default=0)
    dpo.add_argument("--save-every", type=int, default=50, help="checkpoint interval (steps)")
    dpo.add_argument(
        "--stop-after", type=int, default=None, help="stop at this step; rerun to resume"
    )
    dpo.add_argument(
        "--output",
        default="runs/dpo",
        help="run directory; a rerun resumes from its checkpoint (default %(default)s)",
    )
    plan_cli.add_parser(sub)
    return parser


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


def main(argv: list[str] | None = None) -> int:
    """Runs ``posttrain`` with ``argv``; returns the exit status.

    Bad input (a ``ValueError``, an ``OSError`` on a path, an unsupported option) prints
    one line ``posttrain: error: ...`` and returns 2. Another process's failure
    (``distributed.OtherProcessFailed``) prints one line and returns 1. Anything else is
    a bug: one line ``posttrain: internal error: ...`` and 1, the traceback only with ``--debug`` or
    ``POSTTRAIN_DEBUG=1``. Ctrl-C and SIGTERM: one line, 130 / 143.
    """
    args = build_parser().parse_args(argv)
    debug = args.debug or os.environ.get("POSTTRAIN_DEBUG", "") not in ("", "0")
    try:
        with _terminate_as_interrupt():
            return _dispatch(args)
    except KeyboardInterrupt as interrupt:
        signal_name = interrupt.args[0] if interrupt.args else "SIGINT"
        print(f"posttrain: interrupted ({signal_name})", file=sys.stderr)
        return 143 if signal_name == "SIGTERM" else 130
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


@contextlib.contextmanager
def _terminate_as_interrupt():
    """SIGTERM raises KeyboardInterrupt("SIGTERM") in the main thread while the command
    runs, so ``finally`` blocks and context managers (temporary directories) clean up."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt("SIGTERM")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


#: Subcommands that run correctly across processes (``posttrain-harness launch``); the
#: others refuse to start there rather than write from every process or hang (#20).
MULTI_PROCESS = ("forward", "sft", "dpo", "generate", "convert", "grpo")


def _dispatch(args: argparse.Namespace) -> int:
    from posttrain import distributed

    if distributed.launched() and args.command not in MULTI_PROCESS:
        raise ValueError(
            f"posttrain {args.command} does not run across processes yet (it would read its "
            f"data and write its outputs in every process); across processes: "
            f"{', '.join(MULTI_PROCESS)}"
        )
    if args.command in ("sft", "generate", "grpo", "dpo", "forward"):
        _set_devices(parse_devices(args.devices))
        distributed.initialize()  # a no-op outside the launcher and POSTTRAIN_DISTRIBUTED
    if args.command == "sft":
        return commands.sft(args)
    if args.command == "generate":
        return commands.generate(args)
    if args.command == "grpo":
        return commands.grpo(args)
    if args.command == "dpo":
        return commands.dpo(args)
    if args.command == "forward":
        if args.per_device_batch_size < 1 or args.seq < 1 or args.repeats < 1:
            raise ValueError("--per-device-batch-size, --seq and --repeats must be >= 1")
        return commands.forward(args)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # conversion and parity are CPU work
    if args.command == "plan":
        return plan_cli.run(args)
    if args.command == "convert":
        distributed.initialize()  # rank 0 converts, the others wait (commands.convert)
        return commands.convert(args)
    if args.command == "check-logits":
        if args.seq < 8:
            raise ValueError(f"--seq {args.seq} must be >= 8 (the batch pads 7 tokens)")
        return commands.check_logits(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
