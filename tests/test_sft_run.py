"""End-to-end SFT runs: the CLI's embedded run, resume, determinism, LoRA-only checkpoints."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest

pytest.importorskip("tunix.sft.peft_trainer", reason="google-tunix is not installed")

from posttrain import _compat, cli  # noqa: E402
from posttrain.conversion import load_native  # noqa: E402
from posttrain.sft.run import SFTConfig, run_sft  # noqa: E402
from posttrain.training.metrics import LearningRate  # noqa: E402
from tests.meshes import fitted  # noqa: E402


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_cli_embedded_run_trains_and_writes_checkpoint_and_metrics(tmp_path, capsys):
    out = tmp_path / "run"
    # 20 steps of 128-token rows (defaults: 60 x 256): loss 5.5 -> 3.6 here.
    argv = ["sft", "--steps", "20", "--max-target-length", "128", "--output", str(out)]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "steps 1-20: loss" in printed and "Tunix convention" in printed
    history = records(out / "metrics.jsonl")
    assert [r["step"] for r in history] == list(range(1, 21))
    losses = np.array([r["loss"] for r in history])
    assert losses[-5:].mean() < losses[:5].mean() - 1.0, losses  # it learns the text
    assert losses[0] == pytest.approx(np.log(264), abs=0.3)  # starts near uniform
    assert all(r["target_tokens"] > 0 and r["tokens"] >= r["target_tokens"] for r in history)
    assert all(r["tokens_per_s"] > 0 for r in history[1:])
    assert history[0]["learning_rate"] == 0.0 and history[5]["learning_rate"] == pytest.approx(3e-3)
    # Every --save-every steps (50) and the last: no first-step save (Orbax's default).
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["20"]
    assert any(p.name.startswith("events.out.tfevents") for p in (out / "tensorboard").iterdir())
    model = load_native(out / "model-step20")
    assert model.config.vocab_size == 264


@pytest.mark.parametrize(
    ("schedule", "want", "jitted"),
    [
        (optax.linear_schedule(0.0, 1.0, 4), [0.0, 0.25, 0.5, 0.75, 1.0], True),
        (lambda step: 1e-3 if step < 2 else 2e-3, [1e-3, 1e-3, 2e-3, 2e-3, 2e-3], False),
        (lambda step: [0.5, 0.4, 0.3, 0.2, 0.1][step], [0.5, 0.4, 0.3, 0.2, 0.1], False),
        (lambda step: {0: 0.5}.get(step, 0.25), [0.5, 0.25, 0.25, 0.25, 0.25], False),
    ],
    ids=["optax", "python-if", "python-index", "python-hash"],
)
def test_logged_learning_rate_is_jitted_when_the_schedule_traces(schedule, want, jitted):
    """The logged learning rate: a traceable schedule through one jit, any other eagerly;
    a schedule that raises a TypeError of its own is not hidden by the eager retry."""
    learning_rate = LearningRate(schedule)
    assert [learning_rate(step) for step in range(5)] == pytest.approx(want)
    assert (learning_rate._jitted is not None) is jitted
    assert LearningRate(lambda step: 0.125)(3) == 0.125
    assert LearningRate(None)(3) is None
    with pytest.raises(TypeError, match=r"can only concatenate str \(not \"int\"\)"):
        LearningRate(lambda step: "not a schedule" + step)(0)


def test_resume_repeats_the_uninterrupted_losses_and_runs_are_deterministic(
    tmp_path, monkeypatch, capsys
):
    import orbax.checkpoint as ocp

    # Count Orbax's replica-parallel slices: replica_parallel_saves="auto" is off in one
    # CPU process, so train() saves each replicated array (data=2 from 2 devices on) from
    # one replica (the contract test shows the default slices).
    handler = ocp.type_handlers.get_type_handler(jax.Array)
    replica_parallel = handler._use_replica_parallel
    slices, slice_in_dim = [], jax.lax.slice_in_dim
    monkeypatch.setattr(
        jax.lax, "slice_in_dim", lambda *a, **k: slices.append(a[0].shape) or slice_in_dim(*a, **k)
    )
    mesh = fitted({"data": 2, "fsdp": 2, "tensor": 2})
    common = {
        "steps": 3,
        "grad_accum": 2,
        "max_target_length": 64,
        "save_every": 2,
        "per_device_batch_size": 1,
        "mesh": mesh,
    }
    listening = _compat.scalar_listeners()
    # The check before each save (finite weights, the step's record): at the interval
    # save (step 2) and at Tunix's final save (step 3, off the interval: forced).
    from posttrain.training.trainer import SFTTrainerMixin

    checked, check = [], SFTTrainerMixin._check_before_save
    monkeypatch.setattr(
        SFTTrainerMixin,
        "_check_before_save",
        lambda self, step: checked.append(step) or check(self, step),
    )
    full = run_sft(SFTConfig(**common, output=str(tmp_path / "full")))
    assert checked == [2, 3]
    assert sorted(p.name for p in (tmp_path / "full" / "checkpoints").iterdir()) == ["2", "3"]
    options = []  # the Orbax options the run hands Tunix
    first = run_sft(
        SFTConfig(**common, stop_after=2, sync_saves=True, output=str(tmp_path / "cut")),
        on_built=lambda t: options.append(t.config.checkpointing_options),
    )
    assert options[0].enable_async_checkpointing is False  # --sync-saves
    # A kill after step 3 was logged but before it was checkpointed, in the middle of
    # writing step 4's line: the resume drops the torn line (one notice) and replays step
    # 3, and metrics.jsonl must hold it once.
    with open(tmp_path / "cut" / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 3, "loss": 99.0}) + '\n{"step": 4, "lo')
    capsys.readouterr()
    resumed = run_sft(SFTConfig(**common, output=str(tmp_path / "cut")))
    assert "metrics.jsonl, line 4: a torn record" in capsys.readouterr().err
    # Each finished run unregistered its TensorBoard listener (Tunix leaves it registered:
    # later runs' metrics were written to the earlier runs' logs).
    assert _compat.scalar_listeners() == listening
    assert slices == []
    assert handler._use_replica_parallel is replica_parallel  # Orbax's own setting restored
    assert json.loads((tmp_path / "cut" / "run.json").read_text())[
        "replica_parallel_saves_resolved"
    ] is (jax.default_backend() != "cpu")
    loss = lambda result: [r["loss"] for r in result.history]  # noqa: E731
    # Two fresh runs with the same seed (the cut one stops early): identical, bit for bit.
    assert loss(first) == loss(full)[:2]
    assert [r["step"] for r in first.history] == [1, 2]
    assert [r["step"] for r in resumed.history] == [3]
    # Resumed at step 2: params, optimizer state and data position restored, so the
    # uninterrupted run's losses come back (Adam: a restarted optimizer would differ).
    np.testing.assert_allclose(loss(resumed), loss(full)[2:], rtol=1e-6, atol=0)
    logged = records(tmp_path / "cut" / "metrics.jsonl")
    assert [r["step"] for r in logged] == [1, 2, 3]
    assert 99.0 not in [r["loss"] for r in logged]
    run = json.loads((tmp_path / "cut" / "run.json").read_text())
    assert [s["resumed_from_step"] for s in run["segments"]] == [0, 2]
    assert [s["stop_after"] for s in run["segments"]] == [2, None]


@pytest.mark.wiring
def test_lora_run_checkpoints_only_the_adapters(tmp_path):
    """The gate's LoRA run through run_sft (the 2-process SFT test, which checks the same,
    is in the slow tier)."""
    result = run_sft(
        SFTConfig(
            model="llama3-tiny",
            lora_rank=4,
            steps=2,
            max_target_length=64,
            output=str(tmp_path / "lora"),
        )
    )
    assert 0 < result.trainable < result.params / 5
    meta = json.loads(
        (tmp_path / "lora" / "checkpoints" / "2" / "model_params" / "_METADATA").read_text()
    )
    keys = list(meta["tree_metadata"])
    assert keys and all("_lora_a" in k or "_lora_b" in k for k in keys), keys[:4]
    assert (tmp_path / "lora" / "adapter-step2").is_dir()
    assert (tmp_path / "lora" / "model-step2").is_dir()  # merged weights


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--per-device-batch-size", "0"],
            "per_device_batch_size=0 (--per-device-batch-size): expected >= 1",
        ),
        (
            ["--replica-parallel-saves", "maybe"],
            "replica_parallel_saves='maybe' (--replica-parallel-saves): expected auto, on or off",
        ),
        (["--seed", "-1"], "seed=-1 (--seed): expected a non-negative integer"),
        (["--warmup-steps", "-5"], "warmup_steps=-5 (--warmup-steps): expected >= 0"),
        (["--learning-rate", "inf"], "learning_rate=inf (--learning-rate): expected a finite"),
        (["--learning-rate", "nan"], "learning_rate=nan (--learning-rate): expected a finite"),
        (["--lora-alpha", "-1"], "lora_alpha=-1.0 (--lora-alpha): expected a finite value > 0"),
        (["--output", ""], "output=''; expected a run directory path"),
        (["--output", "{file}"], "exists and is not a directory"),
        (["--output", "{file}/run"], "is not a directory"),
        (["--output", "/proc/self/run"], "is under a kernel file system"),
        (["--devices", "0"], "--devices '0': expected a positive integer or 'real'"),
        (["--devices", "-2"], "--devices '-2': expected a positive integer or 'real'"),
        (["--devices", "abc"], "--devices 'abc': expected a positive integer or 'real'"),
        (["--devices", "1.5"], "--devices '1.5': expected a positive integer or 'real'"),
        (["--lora-rank", "100000"], "lora rank=100000 exceeds min(d_in, d_out)="),
        (["--tokenizer", "{tok3}"], "no chat template and no <|im_start|> token"),
        (
            ["--tokenizer", "{tok3}", "--chat-template", "{plain}"],
            "tokens are its unknown token (id 2); expected at most 5%",
        ),
        (["--chat-template", "{jinja}"], "chat template does not parse"),
        (["--chat-template", "{file}/x"], "(--chat-template): expected a Jinja chat template"),
        (["--mesh", "fsdp=\u00b2"], "mesh entry 'fsdp=\u00b2' must look like axis=INT"),
        (["--data", "{nested}"], "{nested}, line 1: not valid JSON"),
        (["--data", "{latin1}"], "{latin1}, line 1: not UTF-8"),
        (["--data", "{surrogate}"], "{surrogate}, line 1: "),
        (["--mesh", "fsdp=3"], f"mesh {{fsdp=3}} has 3 devices but {jax.device_count()} devices"),
        (["--model", "no-such-model"], "neither a preset"),
        (["--data", "{bad}"], ", line 1: not valid JSON"),
        (
            ["--data", "{long}", "--overflow", "reject", "--max-target-length", "32"],
            "more than max_target_length=32",
        ),
    ],
)
@pytest.mark.wiring
def test_cli_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    long = tmp_path / "long.jsonl"
    long.write_text(
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": "a" * 100},
                ]
            }
        )
        + "\n"
    )
    file = tmp_path / "a-file"
    file.write_text("not a directory\n")
    nested = tmp_path / "nested.jsonl"
    nested.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(
        '{"messages": [{"role": "user", "content": "caf\u00e9"}]}\n'.encode("latin-1")
    )
    surrogate = tmp_path / "surrogate.jsonl"
    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "\\ud800"}]
    surrogate.write_text(json.dumps({"messages": chat}).replace("\\\\", "\\") + "\n")
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok3 = Tokenizer(models.WordLevel(vocab={"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok3.pre_tokenizer = pre_tokenizers.Whitespace()
    tok3.save(str(tmp_path / "tok3.json"))
    tok3 = tmp_path / "tok3.json"
    plain = tmp_path / "plain.jinja"  # every message's content, the assistant's trained
    plain.write_text(
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
        "{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}"
    )
    paths = dict(
        bad=bad,
        long=long,
        file=file,
        nested=nested,
        latin1=latin1,
        surrogate=surrogate,
        tok3=tok3,
        plain=plain,
        jinja=tmp_path / "bad.jinja",
    )
    paths["jinja"].write_text("{% for %}")
    for name, path in paths.items():
        argv = [a.replace("{" + name + "}", str(path)) for a in argv]
        message = message.replace("{" + name + "}", str(path))
    assert cli.main(["sft", "--output", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("posttrain: error: ") and "\n" not in err and message in err, err
    assert not (tmp_path / "out").exists()  # nothing written
    assert file.read_text() == "not a directory\n"


@pytest.mark.wiring
def test_a_non_finite_loss_stops_the_run_naming_the_step(tmp_path, capsys):
    """A diverging run (learning rate 1e30) stops with one line naming the step, exit 2;
    metrics.jsonl holds only the finite steps, in strict JSON; nothing is exported, and
    no checkpoint holds non-finite weights (a rerun would resume from it): the weights
    after each update, and the step's loss and gradient norm, are checked before its
    checkpoint is written."""
    out = tmp_path / "run"
    argv = ["sft", "--steps", "6", "--warmup-steps", "0", "--learning-rate", "1e30"]
    argv += ["--max-target-length", "64", "--save-every", "1", "--output", str(out)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("posttrain: error: step ") and "\n" not in err, err
    assert "not finite" in err or ("grad_norm" in err and ("nan" in err or "inf" in err)), err
    failed = int(err.split("step ")[1].split(":")[0])
    saved = sorted(int(p.name) for p in (out / "checkpoints").glob("*") if p.name.isdigit())
    assert saved == list(range(1, failed)), (saved, failed)  # the failed step is not saved

    def strict(value):
        raise ValueError(f"non-JSON constant {value}")

    lines = (
        (out / "metrics.jsonl").read_text().splitlines() if (out / "metrics.jsonl").exists() else []
    )
    records = [json.loads(line, parse_constant=strict) for line in lines]
    assert all(np.isfinite(r["loss"]) and np.isfinite(r["grad_norm"]) for r in records)
    assert not list(out.glob("model-step*"))


@pytest.mark.wiring
def test_sft_accepts_a_native_checkpoint_directory(tmp_path, capsys):
    """--model may name a native directory (as `posttrain convert --to native` writes);
    a killed run's temporaries are swept by the next run."""
    from posttrain.conversion import save_native
    from posttrain.models import build_model, flat_params, get_config

    cfg = get_config("qwen3-tiny")
    native = save_native(flat_params(build_model(cfg, seed=5)), cfg, tmp_path / "native")
    out = tmp_path / "run"
    # a killed earlier run's leftovers: its on-the-fly conversion and a half export
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    stale = [tmp_path / f".run.convert-{child.pid}-a1", out / f".model-step9.tmp-{child.pid}-b2"]
    for directory in stale:
        directory.mkdir(parents=True)
    argv = ["sft", "--model", str(native), "--steps", "2", "--max-target-length", "64"]
    assert cli.main([*argv, "--output", str(out)]) == 0, capsys.readouterr().err
    assert [r["step"] for r in records(out / "metrics.jsonl")] == [1, 2]
    assert not any(d.exists() for d in stale)  # swept: their writer is dead


def test_a_resume_with_other_training_settings_is_refused_before_any_write(tmp_path, capsys):
    """run.json names the run's settings: a rerun that changes a training-relevant one
    (learning rate, seed, model ...) is refused, naming each; others may change."""
    from posttrain.training import record as run_record

    out = tmp_path / "run"
    out.mkdir()
    run_record.record_segment(out, SFTConfig(output=str(out)), {"rows": 1}, 0)
    before = sorted(p.name for p in out.iterdir())
    argv = ["sft", "--output", str(out), "--learning-rate", "0.01", "--seed", "3"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "refusing to resume" in err, err
    assert "learning_rate 0.003 -> 0.01" in err and "seed 0 -> 3" in err
    assert sorted(p.name for p in out.iterdir()) == before
    run_record.check_resumable(SFTConfig(output=str(out), save_every=7, remat="full"), out)


def test_non_finite_weights_are_never_checkpointed(tmp_path):
    """A save that is due checks the trained weights first: a NaN in them stops training
    with NonFiniteLossError naming the step, and the checkpoint is not written."""
    import jax.numpy as jnp
    from flax import nnx
    from tunix.sft import peft_trainer

    from posttrain import sharding
    from posttrain.models import build_model, get_config
    from posttrain.training.metrics import all_finite as _all_finite
    from posttrain.training.trainer import NonFiniteLossError, SFTOptions, SFTTrainer

    mesh = sharding.make_mesh()  # every device on fsdp
    model = build_model(get_config("qwen3-tiny"), mesh, seed=0)
    config = peft_trainer.TrainingConfig(
        eval_every_n_steps=1000, max_steps=4, checkpoint_root_directory=str(tmp_path / "ckpt")
    )
    trainer = SFTTrainer(model, optax.sgd(0.1), config, options=SFTOptions(mesh=mesh))
    trainer._check_before_save(1)  # finite weights pass
    assert bool(_all_finite({})) and bool(_all_finite({"w": jnp.ones(3)}))  # nothing to fault
    assert not bool(_all_finite({"w": jnp.ones(3), "v": jnp.array([1.0, jnp.inf])}))
    _, variable = nnx.to_flat_state(nnx.state(model, nnx.Param))[0]
    _compat.set_variable_value(variable, _compat.variable_value(variable) * jnp.nan)
    with pytest.raises(NonFiniteLossError, match="step 3: the updated weights are not finite"):
        trainer.checkpoint_manager.save(3, trainer.model, trainer.optimizer, force=True)
    trainer.abandon()
    assert not (tmp_path / "ckpt" / "3").exists()
