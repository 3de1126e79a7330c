"""``--model``'s default is resolved by the options, once: "not given" is told apart from
"given the default's name" (issue #39: ``posttrain sft --vision --model qwen3-tiny`` was
silently trained as ``gemma4-vision-tiny``)."""

from __future__ import annotations

import dataclasses

import pytest

from posttrain import cli
from posttrain.sft.options import VISION_MODEL, SFTConfig
from posttrain.training.options import DEFAULT_MODEL

pytestmark = pytest.mark.host


@pytest.mark.parametrize(
    ("argv", "model"),
    [
        ([], DEFAULT_MODEL),
        (["--vision"], VISION_MODEL),
        (["--vision", "--model", DEFAULT_MODEL], DEFAULT_MODEL),
        (["--vision", "--model", "some/dir"], "some/dir"),
        (["--model", VISION_MODEL], VISION_MODEL),
    ],
    ids=["nothing", "vision", "vision-given-the-text-default", "vision-given-a-dir", "given"],
)
def test_a_given_model_is_kept_and_only_an_absent_one_defaults(argv, model):
    """The command line and the Python API agree: ``--vision`` alone trains the vision
    preset; a given ``--model`` is used as given, even when it is the text default's name."""
    assert cli.parse_options(["sft", *argv]).model == model
    vision = "--vision" in argv
    given = argv[argv.index("--model") + 1] if "--model" in argv else None
    api = SFTConfig(vision=vision) if given is None else SFTConfig(vision=vision, model=given)
    assert api.model == model


def test_the_resolved_model_is_a_plain_value_that_survives_replace():
    """After construction ``model`` is a plain ``str`` (what run.json records); a copy of
    a resolved config keeps its model, whatever else changes."""
    text = SFTConfig()
    assert type(text.model) is str and text.model == DEFAULT_MODEL
    assert dataclasses.replace(text, vision=True).model == DEFAULT_MODEL  # given by then
    vision = SFTConfig(vision=True)
    assert type(vision.model) is str
    assert dataclasses.replace(vision, steps=3).model == VISION_MODEL


def test_help_still_shows_the_text_default(capsys):
    """``posttrain sft --help`` shows ``--model``'s default as before."""
    with pytest.raises(SystemExit):
        cli.main(["sft", "--help"])
    printed = " ".join(capsys.readouterr().out.split())
    assert f"(default {DEFAULT_MODEL})" in printed


def test_vision_with_a_given_text_model_is_one_line_and_exit_2(tmp_path, capsys):
    """``--vision --model qwen3-tiny`` (a text-only preset, the text default's name) is
    refused naming it, exit 2, nothing written; it is not replaced by the vision preset.
    (``--max-target-length 8``: were it replaced, the drawings' image tokens would not fit
    a row, and the run would fail at once with another message.)"""
    pytest.importorskip("tunix.sft.peft_trainer", reason="google-tunix is not installed")
    out = tmp_path / "out"
    argv = ["sft", "--vision", "--model", DEFAULT_MODEL, "--max-target-length", "8"]
    assert cli.main([*argv, "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, err
    assert f"--model {DEFAULT_MODEL!r} has no vision tower" in err, err
    assert not out.exists()
