"""The ``posttrain`` subcommands' option sets: every flag name, kind, default, choice and
type users had before the CLI was generated from the options dataclasses (#37), so that
generating it changed none of them. Derived once from the hand-written parser (commit
3216db4) and reviewed; a deliberate change edits this table and says why.

Changes since: ``--chat-template`` on ``sft``, ``dpo`` and ``grpo`` (#36: the model's own
template drives training; a file or ``chatml`` overrides it); ``--vision`` and
``--train-vision-tower`` on ``sft`` and ``--image`` on ``generate`` (#39: vision SFT
and generation); ``--image-root`` on ``sft`` (#56: the directory a vision JSONL's images
are confined to); ``--max-grad-norm`` on ``sft``, ``dpo``, ``grpo`` and ``distill`` (#58:
the gradient clipping that was hard-coded, at its value then: 1.0, none for GRPO);
``--attention-kernel`` on ``sft``, ``dpo``, ``distill`` and ``plan`` (#55: JAX's Pallas
splash attention on a TPU, ``ModelConfig.attention_kernel``)."""

from __future__ import annotations

import argparse

import pytest

from posttrain import cli

pytestmark = pytest.mark.host

# flag (or positional name) -> (kind, default, choices, type name, required).
# kind: "value", "flag" (present: switches a bool; its default is not shown), "append".
# choices: argparse's choices=, or those the help shows as a metavar ({a,b}) when the
# options' check() gives the one-line error instead.
DEVICES = ("value", "8", None, None, False)
EXPECTED: dict[str, dict[str, tuple]] = {
    "sft": {
        "--model": ("value", "qwen3-tiny", None, None, False),
        "--data": ("value", None, None, None, False),
        "--tokenizer": ("value", None, None, None, False),
        "--chat-template": ("value", None, None, None, False),
        "--mesh": ("value", None, None, None, False),
        "--devices": DEVICES,
        "--per-device-batch-size": ("value", 1, None, "int", False),
        "--grad-accum": ("value", 1, None, "int", False),
        "--steps": ("value", 60, None, "int", False),
        "--max-target-length": ("value", 256, None, "int", False),
        "--no-packing": ("flag", None, None, None, False),
        "--data-shards": ("value", None, None, "int", False),
        "--overflow": ("value", "truncate", ("truncate", "reject"), None, False),
        "--learning-rate": ("value", 0.003, None, "float", False),
        "--max-grad-norm": ("value", 1.0, None, "float", False),
        "--warmup-steps": ("value", 5, None, "int", False),
        "--lora-rank": ("value", 0, None, "int", False),
        "--lora-alpha": ("value", None, None, "float", False),
        "--remat": ("value", "none", ("none", "full", "save_dots"), None, False),
        "--scan": ("flag", None, None, None, False),
        "--attention-kernel": ("value", "xla", ("xla", "splash"), None, False),  # #55
        "--seed": ("value", 0, None, "int", False),
        "--save-every": ("value", 50, None, "int", False),
        "--sync-saves": ("flag", None, None, None, False),
        "--replica-parallel-saves": ("value", "auto", ("auto", "on", "off"), None, False),
        "--stop-after": ("value", None, None, "int", False),
        "--output": ("value", "runs/sft", None, None, False),
        "--vision": ("flag", None, None, None, False),  # #39
        "--train-vision-tower": ("flag", None, None, None, False),  # #39
        "--image-root": ("value", None, None, None, False),  # #56: images' confinement
    },
    "forward": {
        "--model": ("value", "qwen3_moe-tiny", None, None, False),
        "--mesh": ("value", "fsdp=4,tensor=2", None, None, False),
        "--devices": DEVICES,
        "--per-device-batch-size": ("value", 1, None, "int", False),
        "--seq": ("value", 64, None, "int", False),
        "--scan": ("flag", None, None, None, False),
        "--remat": ("value", "none", ("none", "full", "save_dots"), None, False),
        "--repeats": ("value", 5, None, "int", False),
        "--seed": ("value", 0, None, "int", False),
    },
    "convert": {
        "--from": ("value", None, ("hf", "native"), None, True),
        "--to": ("value", None, ("hf", "native"), None, True),
        "src": ("value", None, None, None, True),
        "dst": ("value", None, None, None, True),
        "--scan": ("flag", None, None, None, False),
        "--vision": ("flag", None, None, None, False),
        "--layout": ("value", None, ("hub", "fused"), None, False),
        "--prefix": ("value", None, None, None, False),
        "--max-shard-size": ("value", 4 << 30, None, "_byte_size", False),
        "--no-fsync": ("flag", None, None, None, False),
    },
    "check-logits": {
        "hf_dir": ("value", None, None, None, True),
        "native_dir": ("value", None, None, None, True),
        "--max-kl": ("value", 1e-06, None, "float", False),
        "--atol": ("value", None, None, "float", False),
        "--seq": ("value", 16, None, "int", False),
        "--seed": ("value", 7, None, "int", False),
    },
    "generate": {
        "--model": ("value", None, None, None, False),
        "--adapter": ("value", None, None, None, False),
        "--tokenizer": ("value", None, None, None, False),
        "--chat-template": ("value", None, None, None, False),
        "--prompt": ("append", None, None, None, False),
        "--prompts": ("value", None, None, None, False),
        "--chat": ("flag", None, None, None, False),
        "--image": ("value", None, None, None, False),  # #39
        "--max-new-tokens": ("value", 64, None, "int", False),
        "--temperature": ("value", None, None, "float", False),
        "--top-k": ("value", None, None, "int", False),
        "--top-p": ("value", None, None, "float", False),
        "--seed": ("value", 0, None, "int", False),
        "--cache-size": ("value", None, None, "int", False),
        "--output": ("value", None, None, None, False),
        "--mesh": ("value", None, None, None, False),
        "--devices": DEVICES,
    },
    "grpo": {
        "--model": ("value", "qwen3-tiny", None, None, False),
        "--tokenizer": ("value", None, None, None, False),
        "--chat-template": ("value", None, None, None, False),
        "--mesh": ("value", None, None, None, False),
        "--rollout-mesh": ("value", None, None, None, False),
        "--rollout-dtype": ("value", None, None, None, False),
        "--devices": DEVICES,
        "--per-device-batch-size": ("value", 2, None, "int", False),
        "--num-generations": ("value", 8, None, "int", False),
        "--steps": ("value", 150, None, "int", False),
        "--grad-accum": ("value", 1, None, "int", False),  # added with GRPO's accumulation
        "--learning-rate": ("value", 0.0005, None, "float", False),
        "--max-grad-norm": ("value", 0.0, None, "float", False),
        "--lora-rank": ("value", 0, None, "int", False),
        "--lora-alpha": ("value", None, None, "float", False),
        "--algorithm": ("value", "grpo", ("grpo", "dapo", "drgrpo"), None, False),
        "--beta": ("value", None, None, "float", False),
        "--epsilon": ("value", 0.2, None, "float", False),
        "--temperature": ("value", 1.0, None, "float", False),
        "--max-prompt-length": ("value", 32, None, "int", False),
        "--max-new-tokens": ("value", 6, None, "int", False),
        "--reward": ("append", None, None, None, False),
        "--warmup-steps": ("value", 100, None, "int", False),
        "--warmup-data-shards": ("value", None, None, "int", False),
        "--eval-samples": ("value", 4, None, "int", False),
        "--seed": ("value", 0, None, "int", False),
        "--save-every": ("value", 10, None, "int", False),
        "--stop-after": ("value", None, None, "int", False),
        "--output": ("value", "runs/grpo", None, None, False),
    },
    "dpo": {
        "--model": ("value", "qwen3-tiny", None, None, False),
        "--data": ("value", None, None, None, False),
        "--eval-data": ("value", None, None, None, False),
        "--tokenizer": ("value", None, None, None, False),
        "--chat-template": ("value", None, None, None, False),
        "--mesh": ("value", None, None, None, False),
        "--devices": DEVICES,
        "--per-device-batch-size": ("value", 1, None, "int", False),
        "--data-shards": ("value", None, None, "int", False),
        "--grad-accum": ("value", 1, None, "int", False),
        "--steps": ("value", 40, None, "int", False),
        "--max-prompt-length": ("value", 96, None, "int", False),
        "--max-response-length": ("value", 160, None, "int", False),
        "--overflow": ("value", "truncate", ("truncate", "reject"), None, False),
        "--algorithm": ("value", "dpo", ("dpo", "orpo"), None, False),
        "--beta": ("value", 0.1, None, "float", False),
        "--label-smoothing": ("value", 0.0, None, "float", False),
        "--lambda-orpo": ("value", 0.1, None, "float", False),
        "--learning-rate": ("value", 0.001, None, "float", False),
        "--max-grad-norm": ("value", 1.0, None, "float", False),
        "--warmup-steps": ("value", 5, None, "int", False),
        "--lora-rank": ("value", 0, None, "int", False),
        "--lora-alpha": ("value", None, None, "float", False),
        "--remat": ("value", "none", ("none", "full", "save_dots"), None, False),
        "--scan": ("flag", None, None, None, False),
        "--attention-kernel": ("value", "xla", ("xla", "splash"), None, False),  # #55
        "--seed": ("value", 0, None, "int", False),
        "--save-every": ("value", 50, None, "int", False),
        "--stop-after": ("value", None, None, "int", False),
        "--output": ("value", "runs/dpo", None, None, False),
    },
    # added with posttrain distill (#38): SFT's options (its own defaults for the student,
    # the steps and the row length) and the distillation's
    "distill": {
        "--model": ("value", "qwen3-tiny", None, None, False),
        "--teacher": ("value", None, None, None, False),
        "--student-layers": ("value", 1, None, "int", False),
        "--strategy": ("value", "logit", None, None, False),
        "--temperature": ("value", 1.0, None, "float", False),
        "--alpha": ("value", 0.5, None, "float", False),
        "--distill-top-k": ("value", 0, None, "int", False),
        "--teacher-dtype": ("value", "float32", ("float32", "bfloat16"), None, False),
        "--teacher-steps": ("value", 60, None, "int", False),
        "--chat-template": ("value", None, None, None, False),  # every run's (#36)
        "--data": ("value", None, None, None, False),
        "--tokenizer": ("value", None, None, None, False),
        "--mesh": ("value", None, None, None, False),
        "--devices": DEVICES,
        "--per-device-batch-size": ("value", 1, None, "int", False),
        "--grad-accum": ("value", 1, None, "int", False),
        "--steps": ("value", 40, None, "int", False),
        "--max-target-length": ("value", 128, None, "int", False),
        "--no-packing": ("flag", None, None, None, False),
        "--data-shards": ("value", None, None, "int", False),
        "--overflow": ("value", "truncate", ("truncate", "reject"), None, False),
        "--learning-rate": ("value", 0.003, None, "float", False),
        "--max-grad-norm": ("value", 1.0, None, "float", False),
        "--warmup-steps": ("value", 5, None, "int", False),
        "--lora-rank": ("value", 0, None, "int", False),
        "--lora-alpha": ("value", None, None, "float", False),
        "--remat": ("value", "none", ("none", "full", "save_dots"), None, False),
        "--scan": ("flag", None, None, None, False),
        "--attention-kernel": ("value", "xla", ("xla", "splash"), None, False),  # #55
        "--seed": ("value", 0, None, "int", False),
        "--save-every": ("value", 50, None, "int", False),
        "--sync-saves": ("flag", None, None, None, False),
        "--replica-parallel-saves": ("value", "auto", ("auto", "on", "off"), None, False),
        "--stop-after": ("value", None, None, "int", False),
        "--output": ("value", "runs/distill", None, None, False),
    },
    # posttrain plan (#34): the slice, the mesh and the workload it compiles; a COMMANDS
    # row since, every flag kept; --rollout-mesh added with the grpo plan, --num-iterations
    # with GRPO's old-policy forward
    "plan": {
        "--model": ("value", None, None, None, True),
        "--topology": ("value", None, None, None, True),
        "--mesh": ("value", None, None, None, False),
        "--rollout-mesh": ("value", None, None, None, False),
        "--workflow": ("value", "sft", ("sft", "dpo", "grpo", "generate"), None, False),
        "--lora-rank": ("value", 0, None, "int", False),
        "--qlora": ("value", None, None, None, False),
        "--remat": ("value", "full", ("none", "full", "save_dots"), None, False),
        "--attention-kernel": ("value", "xla", ("xla", "splash"), None, False),  # #55
        "--per-device-batch-size": ("value", 1, None, "int", False),
        "--batch": ("value", None, None, "int", False),
        "--seq": ("value", 2048, None, "int", False),
        "--new-tokens": ("value", 128, None, "int", False),
        "--grad-accum": ("value", 1, None, "int", False),
        "--num-iterations": ("value", 1, None, "int", False),
        "--optimizer": ("value", "adamw", ("adamw", "sgd", "adafactor"), None, False),
        "--dtype": ("value", "bfloat16", ("bfloat16", "float32"), None, False),
        "--param-dtype": ("value", "bfloat16", ("bfloat16", "float32"), None, False),
        "--no-scan": ("flag", None, None, None, False),
        "--num-layers": ("value", None, None, "int", False),
        "--extrapolate": ("flag", None, None, None, False),
        "--json": ("value", None, None, None, False),
        "--run-steps": ("value", 0, None, "int", False),
        "--profile": ("value", None, None, None, False),
        "--probe-headroom": ("flag", None, None, None, False),
        "--search": ("flag", None, None, None, False),
        "--search-max-batch": ("value", 64, None, "int", False),
    },
}


def _subparsers(monkeypatch) -> dict[str, argparse.ArgumentParser]:
    monkeypatch.delenv("POSTTRAIN_DEVICES", raising=False)
    parser = cli.build_parser()
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


def _row(action: argparse.Action) -> tuple:
    kinds = {
        argparse._StoreTrueAction: "flag",
        argparse._StoreFalseAction: "flag",
        argparse._AppendAction: "append",
        argparse._StoreAction: "value",
    }
    kind = kinds[type(action)]
    choices = tuple(action.choices) if action.choices else None
    metavar = action.metavar if isinstance(action.metavar, str) else ""
    if choices is None and metavar.startswith("{"):
        choices = tuple(metavar.strip("{}").split(","))
    default = None if kind == "flag" else action.default
    return (kind, default, choices, getattr(action.type, "__name__", None), action.required)


@pytest.mark.parametrize("command", list(EXPECTED))
def test_each_subcommand_keeps_its_flags_defaults_and_choices(command, monkeypatch):
    """The subcommand's options (flag, kind, default, choices, type, required) are exactly
    the recorded ones: none renamed, dropped, added or given another default."""
    parser = _subparsers(monkeypatch)[command]
    found = {
        "/".join(a.option_strings) or a.dest: _row(a)
        for a in parser._actions
        if not isinstance(a, argparse._HelpAction)
    }
    assert found == EXPECTED[command]


def test_every_subcommand_is_recorded(monkeypatch):
    """The recorded subcommands are exactly the CLI's: a new one gets its row here (and
    the review of its flags that comes with it)."""
    assert set(_subparsers(monkeypatch)) == set(EXPECTED)


@pytest.mark.parametrize("command", list(EXPECTED))
def test_each_subcommand_prints_its_help(command, capsys, monkeypatch):
    """``posttrain COMMAND --help`` prints every flag and exits 0 (a stray ``%`` in a help
    text would raise instead)."""
    monkeypatch.delenv("POSTTRAIN_DEVICES", raising=False)
    with pytest.raises(SystemExit) as exit_:
        cli.main([command, "--help"])
    assert exit_.value.code == 0
    printed = capsys.readouterr().out
    assert all(flag.split("/")[0] in printed for flag in EXPECTED[command])


@pytest.mark.parametrize(
    ("program", "argv", "words"),
    [
        (
            "posttrain",
            ["plan", "--model", "x", "--topology", "v5e-1", "--seq", "1e12"],
            "argument --seq: invalid int value: '1e12'",
        ),
        (
            "posttrain",
            ["plan", "--model", "x", "--topology", "v5e-1", "--nope"],
            "unrecognized arguments: --nope",
        ),
        ("posttrain", ["plan", "--topology", "v5e-1"], "required: --model"),
        ("posttrain", ["nope"], "invalid choice: 'nope'"),
        ("posttrain-harness", ["bisect", "--contract", "sft"], "required: --source"),
        ("posttrain-harness", ["gate", "--jobs", "x"], "argument --jobs"),
    ],
    ids=[
        "bad-int",
        "unknown-flag",
        "missing-flag",
        "unknown-command",
        "harness-missing",
        "harness-bad-value",
    ],
)
def test_a_usage_error_is_one_line_naming_the_option_and_pointing_to_help(
    program, argv, words, capsys, monkeypatch
):
    """argparse's errors (an unknown flag, a bad value, a missing flag): one line naming
    the option and a hint to ``--help``, exit 2; not the whole usage (#56 12)."""
    from harness import cli as harness_cli

    monkeypatch.delenv("POSTTRAIN_DEVICES", raising=False)
    main = {"posttrain": cli.main, "posttrain-harness": harness_cli.main}[program]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(f"{program}") and words in err[0], err
    assert err[0].endswith("--help`"), err
