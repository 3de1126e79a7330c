"""The options dataclasses and the flags generated from them (:mod:`posttrain.flags`,
:mod:`posttrain.training.options`): every field reaches its options from the command line,
and the shared checks name the field and its flag."""

from __future__ import annotations

import dataclasses
import json
import typing

import pytest

from posttrain import cli, flags
from posttrain.distill.options import DistillRunConfig
from posttrain.preference.options import DPORunConfig
from posttrain.rl.options import GRPORunConfig
from posttrain.sft.options import SFTConfig
from posttrain.training.options import RunOptions

pytestmark = pytest.mark.host


def _other_value(field: dataclasses.Field, hint) -> tuple[list[str], object]:
    """``(command-line words, the value they give)`` for a value other than the field's
    default (explicit zeros where the default is not zero)."""
    base = flags._base_type(hint)
    default = None if field.default is dataclasses.MISSING else field.default
    if field.metadata["parse"] is not None:  # a mesh
        return ["fsdp=2,tensor=4"], {"fsdp": 2, "tensor": 4}
    if typing.get_origin(base) is typing.Literal:
        other = next(v for v in typing.get_args(base) if v != default)
        return [other], other
    if base is int:
        value = 0 if default not in (0, None) else 3
        return [str(value)], value
    if base is float:
        value = 0.0 if default not in (0.0, None) else 0.25
        return [str(value)], value
    if typing.get_origin(base) is tuple:
        return ["a:b", "--" + field.name.replace("_", "-"), "c:d"], ("a:b", "c:d")
    if base is str:
        return ["some/where"], "some/where"
    raise AssertionError(f"{field.name}: no other value for {hint}")


@pytest.mark.parametrize("command", [c for c in cli.COMMANDS], ids=lambda c: c.name)
def test_every_field_reaches_its_options_from_the_command_line(command):
    """For each field of each subcommand's options, a command line giving another value
    (explicit zeros included; a flag switches a bool) parses to options holding exactly
    that value, every other field at its default (positionals and required flags given)."""
    required = []
    for field, hint in flags._fields(command.options):
        if field.metadata["positional"]:
            required.append("x")
        elif field.metadata["required"]:
            choices = typing.get_args(hint)  # a Literal's first value, else any string
            required += [flags.flag_of(command.options, field.name), (*choices, "x")[0]]
    baseline = cli.parse_options([command.name, *required])
    for field, hint in flags._fields(command.options):
        if field.metadata["positional"] or field.metadata["required"]:
            continue
        flag = flags.flag_of(command.options, field.name)
        if hint is bool:
            words, value = [flag], not field.default
        else:
            words, value = _other_value(field, hint)
            words = [flag, *words]
        parsed = cli.parse_options([command.name, *required, *words])
        assert getattr(parsed, field.name) == value, (flag, words)
        if field.name == "vision" and hasattr(baseline, "model"):  # sft: its model too (#39)
            parsed = dataclasses.replace(parsed, model=baseline.model)
        assert dataclasses.replace(parsed, **{field.name: getattr(baseline, field.name)}) == (
            baseline
        ), flag


WORKFLOWS = [SFTConfig, DPORunConfig, GRPORunConfig, DistillRunConfig]


@pytest.mark.parametrize("cls", WORKFLOWS, ids=lambda c: c.__name__)
def test_the_defaults_are_a_valid_run(cls, tmp_path):
    """Each workflow's defaults (the embedded run) pass its checks."""
    cls(output=str(tmp_path / "run")).check()


@pytest.mark.parametrize("cls", WORKFLOWS, ids=lambda c: c.__name__)
@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("steps", 0, "steps=0 (--steps): expected >= 1"),
        ("per_device_batch_size", 0, "(--per-device-batch-size): expected >= 1"),
        ("grad_accum", 0, "grad_accum=0 (--grad-accum): expected >= 1"),
        ("mesh", {"fsdp": 0}, "mesh={'fsdp': 0} (--mesh): expected axis sizes >= 1"),
        ("save_every", 0, "save_every=0 (--save-every): expected >= 1"),
        ("stop_after", 0, "stop_after=0 (--stop-after): expected >= 1"),
        ("lora_rank", -1, "lora_rank=-1 (--lora-rank): expected >= 0 (0 = full fine-tuning)"),
        ("lora_alpha", 0.0, "lora_alpha=0.0 (--lora-alpha): expected a finite value > 0"),
        ("learning_rate", float("nan"), "(--learning-rate): expected a finite value > 0"),
        (
            "max_grad_norm",
            -1.0,
            "max_grad_norm=-1.0 (--max-grad-norm): expected a finite value >= 0",
        ),
        ("max_grad_norm", float("inf"), "max_grad_norm=inf (--max-grad-norm): expected a finite"),
        ("seed", -1, "seed=-1 (--seed): expected a non-negative integer"),
        ("output", "", "output=''; expected a run directory path"),
    ],
)
def test_each_workflow_refuses_a_bad_shared_option_in_one_line(cls, field, value, message):
    """The options every run shares (:class:`RunOptions`) are checked the same way in every
    workflow, one line naming the field, its value and its flag."""
    assert field in {f.name for f in dataclasses.fields(RunOptions)}
    with pytest.raises(ValueError) as error:
        cls(**{field: value}).check()
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("cls", WORKFLOWS, ids=lambda c: c.__name__)
def test_max_grad_norm_is_one_field_that_every_workflow_resumes_only_unchanged(cls, tmp_path):
    """``--max-grad-norm`` is :class:`RunOptions`' field in every workflow (an explicit 0
    is accepted: no clipping); a resume with another value is refused naming it, and a
    ``run.json`` written before the option resumes only at the workflow's default (its
    clipping then: 1 for ``sft``, ``dpo`` and ``distill``, none for GRPO)."""
    from posttrain.training import record

    assert "max_grad_norm" in cls.TRAINING_FIELDS
    (field,) = (f for f in dataclasses.fields(cls) if f.name == "max_grad_norm")
    assert field.default == (0.0 if cls is GRPORunConfig else 1.0)
    out = tmp_path / "run"
    out.mkdir()
    cls(output=str(out), max_grad_norm=0.0).check_fields()
    record.record_segment(out, cls(output=str(out)), {}, 0)
    with pytest.raises(ValueError, match=f"max_grad_norm {field.default} -> 0.5"):
        record.check_resumable(cls(output=str(out), max_grad_norm=0.5), out)
    record.check_resumable(cls(output=str(out)), out)
    body = record.read(out)
    del body["settings"]["max_grad_norm"]  # a run recorded before the option
    (out / record.RUN_FILE).write_text(json.dumps(body))
    record.check_resumable(cls(output=str(out)), out)
    with pytest.raises(ValueError, match="refusing to resume"):
        record.check_resumable(cls(output=str(out), max_grad_norm=0.25), out)


def test_a_flag_other_than_the_field_name_is_named_in_the_message():
    """``scan_layers`` is ``--scan``; ``packing`` (default on) is ``--no-packing``."""
    assert flags.flag_of(SFTConfig, "scan_layers") == "--scan"
    assert flags.flag_of(SFTConfig, "packing") == "--no-packing"
    assert flags.flag_of(SFTConfig, "grad_accum") == "--grad-accum"


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Toy:
    """Options of each kind the generator knows, with multi-word names."""

    max_new_tokens: int = flags.option(3, "tokens")
    quiet_steps: int = flags.option(4, "steps", show_default=False)
    keep_going_on: bool = flags.option(True, "stop instead")
    dry_run_first: bool = flags.option(False, "dry run")
    name_or_number: int | str | None = flags.option(None, "either")
    kind: typing.Literal["a", "b"] = flags.option("a", "a kind")
    checked_kind: typing.Literal["x", "y"] = flags.option("x", "checked", checked=True)
    where: str = flags.option(help="where", positional=True)


def test_the_generator_names_helps_and_types_each_kind_of_field():
    """Flag names from multi-word fields (``--no-`` for a bool on by default), the
    default in the help unless ``show_default=False``, ``choices`` or a metavar from a
    ``Literal``, a positional, and a union of two types left untyped."""
    import argparse

    parser = argparse.ArgumentParser(prog="toy")
    flags.add_options(parser, _Toy)
    actions = {a.dest: a for a in parser._actions}
    assert actions["keep_going_on"].option_strings == ["--no-keep-going-on"]
    assert actions["dry_run_first"].option_strings == ["--dry-run-first"]
    assert actions["max_new_tokens"].option_strings == ["--max-new-tokens"]
    assert actions["name_or_number"].type is None
    assert actions["kind"].choices == ("a", "b") and actions["kind"].metavar is None
    assert actions["checked_kind"].choices is None
    assert actions["checked_kind"].metavar == "{x,y}"
    assert actions["where"].option_strings == [] and actions["where"].required
    text = " ".join(parser.format_help().split())
    assert "tokens (default 3)" in text and "steps (default" not in text
    assert "--no-keep-going-on stop instead" in text
    toy = flags.options_from(_Toy, parser.parse_args(["here", "--no-keep-going-on"]))
    assert toy == _Toy(where="here", keep_going_on=False)
