"""What a run leaves when it stops before its first checkpoint, and what it refuses to
resume (:mod:`posttrain.runs.checks`, #40)."""

from __future__ import annotations

import pytest

from posttrain import cli
from posttrain.runs import checks


def _started(out, *, checkpoint: str | None = None):
    out.mkdir()
    (out / "run.json").write_text("{}\n")
    (out / "metrics.jsonl").write_text("")
    (out / "tensorboard").mkdir()
    (out / "tensorboard" / "events.out").write_text("x")
    (out / "checkpoints").mkdir()
    if checkpoint:
        (out / "checkpoints" / checkpoint).mkdir()


def test_a_run_that_never_checkpointed_leaves_nothing(tmp_path):
    out = tmp_path / "run"
    _started(out, checkpoint="1.orbax-checkpoint-tmp-3")  # an unfinished save is none
    assert checks.discard_unstarted(out, 0)
    assert list(tmp_path.iterdir()) == []


def test_what_the_user_put_there_and_a_run_with_a_checkpoint_stay(tmp_path):
    out = tmp_path / "run"
    _started(out)
    (out / "notes.txt").write_text("mine")
    assert checks.discard_unstarted(out, 0)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    kept = tmp_path / "kept"
    _started(kept, checkpoint="2")
    assert not checks.discard_unstarted(kept, 0)
    assert not checks.discard_unstarted(kept, 2)  # a resumed run keeps its directory
    assert sorted(p.name for p in kept.iterdir()) == sorted(checks.STARTED_FILES)


@pytest.mark.slow  # a real DPO step (~15 s); the discard itself is tested above in the gate
@pytest.mark.devices(8)
def test_dpo_with_a_beta_whose_loss_is_not_finite_stops_at_step_1_leaving_nothing(tmp_path, capsys):
    """``--beta 1e30``: the gradient norm is inf at step 1; one line, exit 2, and no
    run.json (nor any other file) left behind."""
    out = tmp_path / "run"
    argv = ["dpo", "--steps", "1", "--beta", "1e30", "--output", str(out)]
    argv += ["--max-prompt-length", "48", "--max-response-length", "16"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("posttrain: error: step 1: loss "), err
    assert f"removed what the run wrote in {out}" in err, err
    assert not out.exists()
