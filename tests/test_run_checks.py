"""What a run leaves when it stops before its first checkpoint, and what it refuses to
resume (:mod:`posttrain.training.checks`, #40)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from posttrain import cli
from posttrain.training import checks

pytestmark = pytest.mark.host  # host code only: left out of the TPU/GPU tier


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


# --- resume ---------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["sft", "dpo", "grpo"])
@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"settings": []}, "'settings' is a list, expected an object"),
        ({"settings": {}, "segments": {}}, "'segments' is an object, expected a list"),
        ({"settings": {}, "global_batch": "8"}, "'global_batch' is a string, expected an integer"),
    ],
    ids=["settings-list", "segments-object", "global-batch-string"],
)
def test_a_damaged_run_json_is_one_line_exit_2(tmp_path, capsys, command, body, message):
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.json").write_text(json.dumps(body))
    assert cli.main([command, "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("posttrain: error: "), err
    assert f"{out / 'run.json'}: {message}" in err, err
    assert sorted(p.name for p in out.iterdir()) == ["run.json"]


def _recorded(out, cfg, **facts):
    """``out`` as a run of ``cfg`` started with ``facts`` had left it."""
    from posttrain.training import record

    out.mkdir(exist_ok=True)
    record.record_segment(out, cfg, {"global_batch": 8, "devices": 8, "data_shards": 1, **facts}, 0)


@pytest.mark.devices(8)
def test_a_resume_whose_devices_change_the_global_batch_is_refused_naming_both(tmp_path, capsys):
    """The run was recorded on 4 devices (global batch 4); this process has 8."""
    from posttrain.sft.options import SFTConfig

    out = tmp_path / "run"
    _recorded(out, SFTConfig(output=str(out)), global_batch=4, devices=4)
    before = (out / "run.json").read_text()
    assert cli.main(["sft", "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"{out} holds a run with global batch 4 on 4 devices; this one has 8 on 8" in err
    assert (out / "run.json").read_text() == before


@pytest.mark.devices(8)
def test_a_grpo_resume_whose_devices_change_the_global_batch_is_refused(tmp_path, capsys):
    """GRPO's run.json (recorded as every run's, ``training.record``) with the global batch of
    a run on 4 devices (2 prompts per shard); this process has 8: refused before any
    work."""
    from posttrain.rl.options import GRPORunConfig

    out = tmp_path / "run"
    out.mkdir()
    cfg = GRPORunConfig(output=str(out))
    body = {"settings": json.loads(json.dumps(dataclasses.asdict(cfg))), "global_batch": 8}
    (out / "run.json").write_text(json.dumps({**body, "devices": 4}))
    before = (out / "run.json").read_text()
    assert cli.main(["grpo", "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"{out} holds a run with global batch 8 on 4 devices; this one has 16 on 8" in err
    assert sorted(p.name for p in out.iterdir()) == ["run.json"]
    assert (out / "run.json").read_text() == before


@pytest.mark.devices(8)
@pytest.mark.parametrize("command", ["sft", "dpo"])
def test_a_resume_whose_data_content_changed_is_refused_naming_both_hashes(
    tmp_path, capsys, command
):
    from posttrain.preference.options import DPORunConfig
    from posttrain.sft.options import SFTConfig

    data = tmp_path / "data.jsonl"
    data.write_text("old\n")
    old = checks.data_digest(str(data))
    out = tmp_path / "run"
    options = {"sft": SFTConfig, "dpo": DPORunConfig}[command]
    _recorded(out, options(output=str(out), data=str(data)), data_sha256=old)
    data.write_text("new\n")
    new = checks.data_digest(str(data))
    assert cli.main([command, "--output", str(out), "--data", str(data)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"--data {data}: its content changed since the run in {out} recorded it" in err
    assert f"sha256 {old[:16]}... then, {new[:16]}... now" in err, err
    assert err.rstrip().endswith("refusing to resume it: use a new --output, or the recorded data")


@pytest.mark.devices(8)
def test_a_resume_with_the_same_facts_or_a_run_json_without_a_digest_goes_on(tmp_path):
    """The facts recorded for the next resume, and the checks a resume passes: the same
    data, or a run recorded before digests were (no ``data_sha256``: nothing to compare);
    a stray ``model-step<N>`` that is no export is still refused (:func:`check_exports`)."""
    import jax

    from posttrain.sft.options import SFTConfig

    data = tmp_path / "data.jsonl"
    data.write_text("rows\n")
    digest = checks.data_digest(str(data))
    out = tmp_path / "run"
    cfg = SFTConfig(output=str(out), data=str(data))
    want = {"devices": jax.device_count(), "data_sha256": digest}
    assert checks.check_same_run(cfg, 8) == want  # a new run: nothing recorded
    _recorded(out, cfg, data_sha256=digest)
    assert checks.check_same_run(cfg, 8) == want
    _recorded(out, cfg)  # recorded without a digest
    assert json.loads((out / "run.json").read_text()).get("data_sha256") is None
    assert checks.check_same_run(cfg, 8) == want
    (out / "model-step2").mkdir()
    (out / "model-step2" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="model-step2"):
        checks.check_same_run(cfg, 8)


def test_the_data_digest_is_the_files_sha256():
    import hashlib
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".jsonl") as f:
        f.write(b"x" * 3_000_000)
        f.flush()
        assert checks.data_digest(f.name) == hashlib.sha256(b"x" * 3_000_000).hexdigest()
    assert checks.data_digest(None) is None


def test_a_torn_last_metrics_line_is_removed_with_a_notice(tmp_path, capsys):
    from posttrain.training import record

    lines = [json.dumps({"step": s, "loss": 1.0}) for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 4, "lo')
    assert record.truncate_metrics(tmp_path, 2) == 2
    assert (tmp_path / "metrics.jsonl").read_text() == lines[0] + "\n" + lines[1] + "\n"
    err = capsys.readouterr().err
    assert err == (
        f"posttrain: notice: {tmp_path / 'metrics.jsonl'}, line 4: a torn record (a kill "
        "mid-write?); removed it (15 bytes)\n"
    )


def test_a_bad_metrics_line_before_the_last_is_named(tmp_path):
    from posttrain.training import record

    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n[1, 2]\n{"step": 3}\n')
    with pytest.raises(
        ValueError, match=r"metrics.jsonl, line 2: not a step record \('\[1, 2\]'\)"
    ):
        record.truncate_metrics(tmp_path, 3)


def test_an_empty_export_directory_is_written_and_a_foreign_one_refused(tmp_path):
    """A pre-existing empty ``model-step2/`` gets the export (it was skipped without a
    word); one holding something else is refused, naming it; a whole export is kept."""
    from posttrain.conversion.native import is_native_dir
    from posttrain.models import build_model, get_config
    from posttrain.training.export import export_final

    model = build_model(get_config("qwen3-tiny"), seed=0)
    (tmp_path / "model-step2").mkdir()
    assert export_final(model, tmp_path, 2) == [tmp_path / "model-step2"]
    assert is_native_dir(tmp_path / "model-step2")
    assert export_final(model, tmp_path, 2) == []  # a whole export is kept
    (tmp_path / "model-step3").mkdir()
    (tmp_path / "model-step3" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"model-step3 exists and is not an export \(no a"):
        export_final(model, tmp_path, 3)
    assert [p.name for p in (tmp_path / "model-step3").iterdir()] == ["notes.txt"]


def test_the_summary_line_spans_the_trained_steps_with_the_median_speed():
    """SFT's and DPO's summaries: first and last loss of the records that trained (an
    evaluation record has none), the last record's details, the median tokens/s; a
    resume with nothing left says where it stands."""
    from posttrain.training import record

    history = [
        {"step": 3, "loss": 2.5, "tokens_per_s": 100.0, "perplexity": 12.0},
        {"step": 4, "eval_loss": 9.0},
        {"step": 4, "loss": 1.25, "tokens_per_s": 400.0, "perplexity": 3.5},
        {"step": 5, "loss": 1.0, "tokens_per_s": 300.0, "perplexity": 2.75},
        {"step": 6, "loss": 0.5, "perplexity": 1.5},  # no speed measured
    ]
    line = record.steps_line(history, 2, lambda r: f" (perplexity {r['perplexity']})")
    assert line == "steps 3-6: loss 2.500 -> 0.500 (perplexity 1.5), 300 tokens/s"
    two = record.steps_line(history[:3], 2, lambda r: "")
    assert two == "steps 3-4: loss 2.500 -> 1.250, 250 tokens/s"  # the median of two
    assert record.steps_line([{"step": 7, "eval_loss": 1.0}], 7, str) == (
        "no steps run (already at step 7)"
    )
