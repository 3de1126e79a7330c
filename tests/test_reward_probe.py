"""``posttrain grpo --reward module:function`` (#40): the module is imported and the
function called once on a probe batch before anything is written; whatever is wrong (a
syntax error, an exception, ``sys.exit``, the wrong shape, NaN, strings) is one line
naming the module, the function and what was wrong, exit 2, and no run directory. During
training the same faults stop the run with one line too (:func:`rewards.recorded`)."""

from __future__ import annotations

import re
import textwrap

import pytest

from posttrain import cli
from posttrain.rl import rewards

pytestmark = pytest.mark.host

MODULE = textwrap.dedent(
    """
    import sys

    def fine(prompts, completions, **kwargs):
        return [0.5] * len(completions)

    def raises(prompts, completions, **kwargs):
        return 1 / 0

    def exits(prompts, completions, **kwargs):
        sys.exit(3)

    def short(prompts, completions, **kwargs):
        return [1.0]

    def nan(prompts, completions, **kwargs):
        return [float("nan")] * len(completions)

    def strings(prompts, completions, **kwargs):
        return ["1.0"] * len(completions)

    def scalar(prompts, completions, **kwargs):
        return 1.0

    def no_kwargs(prompts, completions):
        return [0.0] * len(completions)
    """
)

CASES = {
    "syntax-error": (
        "rp_broken:f",
        r"reward 'rp_broken:f': module 'rp_broken' has a syntax error \(.*rp_broken.py line 2\)",
    ),
    "import-raises": (
        "rp_import_raises:f",
        r"reward 'rp_import_raises:f': importing module 'rp_import_raises' raised "
        r"RuntimeError: no GPU here",
    ),
    "import-exits": (
        "rp_import_exits:f",
        r"importing module 'rp_import_exits' called sys.exit\(1\)",
    ),
    "raises": (
        "rp_mod:raises",
        r"reward 'rp_mod:raises' on a probe batch raised ZeroDivisionError: division by zero",
    ),
    "sys-exit": ("rp_mod:exits", r"reward 'rp_mod:exits' on a probe batch called sys.exit\(3\)"),
    "wrong-shape": (
        "rp_mod:short",
        r"reward 'rp_mod:short' on a probe batch of 2 completions: reward short returned 1 "
        r"values for 2 completions",
    ),
    "nan": ("rp_mod:nan", r"'rp_mod:nan' .*: reward nan returned nan \(expected finite values\)"),
    "strings": ("rp_mod:strings", r"'rp_mod:strings' .*: reward strings returned str values"),
    "scalar": ("rp_mod:scalar", r"'rp_mod:scalar' .*: reward scalar returned float; expected a"),
    "no-kwargs": ("rp_mod:no_kwargs", r"'rp_mod:no_kwargs' on a probe batch raised TypeError"),
}


@pytest.fixture
def user_modules(tmp_path, monkeypatch):
    (tmp_path / "rp_mod.py").write_text(MODULE)
    (tmp_path / "rp_broken.py").write_text("\ndef f(:\n    pass\n")
    (tmp_path / "rp_import_raises.py").write_text("raise RuntimeError('no GPU here')\n")
    (tmp_path / "rp_import_exits.py").write_text("import sys\nsys.exit(1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    import sys

    for name in [n for n in sys.modules if n.startswith("rp_")]:
        del sys.modules[name]


@pytest.mark.parametrize(("spec", "message"), CASES.values(), ids=CASES.keys())
def test_a_bad_reward_is_one_line_exit_2_and_no_run_directory(user_modules, capsys, spec, message):
    out = user_modules / "run"
    assert cli.main(["grpo", "--output", str(out), "--reward", spec]) == 2
    std, err = capsys.readouterr()
    assert std == "" and err.startswith("posttrain: error: ") and err.count("\n") == 1, err
    assert re.search(message, err), err
    assert not out.exists()


def test_a_good_reward_passes_the_probe(user_modules):
    rewards.probe("rp_mod:fine", rewards.resolve("rp_mod:fine"))
    for name in rewards.BUILTIN:
        rewards.probe(name, rewards.resolve(name))


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("raises", "reward raises raised ZeroDivisionError"),
        ("exits", r"reward exits called sys.exit\(3\)"),
        ("strings", "reward strings returned str values"),
    ],
)
def test_a_reward_failing_during_training_stops_with_one_line(user_modules, name, message):
    """The probe passed but a later batch fails: a RewardError (a ValueError: exit 2),
    never a SystemExit that ends the run without a word."""
    import importlib

    fn = getattr(importlib.import_module("rp_mod"), name)
    with pytest.raises(rewards.RewardError, match=message):
        rewards.recorded(fn, lambda n, v: None)(prompts=["a"], completions=["1"], mode="train")
