"""Contract: the installed Tunix drives the train step in one of the known conventions."""

from __future__ import annotations

import importlib.metadata
import inspect

import pytest

from posttrain.training import tunix_compat

tunix = pytest.importorskip("tunix.sft.peft_trainer", reason="google-tunix is not installed")

# Released versions -> expected convention (shared/research/tunix-conventions.md,
# confirmed by running detect_from_source on each wheel's peft_trainer.py).
EXPECTED = {
    "0.0.2": "positional3",
    "0.1.0": "positional3",
    "0.1.1": "positional3",
    "0.1.2": "positional3",
    "0.1.3": "positional3",
    "0.1.4": "positional3",
    "0.1.5": "positional3",
    "0.1.6": "bound2",
    "0.1.7": "bound2",
}


@pytest.mark.contract("tunix.sft.peft_trainer.PeftTrainer.train")
def test_installed_tunix_uses_a_known_convention():
    """detect() on the installed PeftTrainer names a known convention (else the error says why)."""
    convention = tunix_compat.detect()
    assert convention.name in tunix_compat.KNOWN.values()
    version = importlib.metadata.version("google-tunix")
    if version in EXPECTED:
        assert convention.name == EXPECTED[version], convention.describe()


@pytest.mark.contract("tunix.sft.peft_trainer.PeftTrainer._train_step")
def test_default_step_parameter_names_match_the_convention():
    """nnx.jit donates by name: Tunix's own step has the parameters the convention needs."""
    convention = tunix_compat.detect()
    params = tuple(inspect.signature(tunix.PeftTrainer._train_step).parameters)[1:]  # drop self
    assert params == convention.step_parameters
