"""Every run option reaches Tunix (#41 class 2): for each option of ``posttrain sft``,
``posttrain dpo`` and ``posttrain grpo``, a value other than its default (explicit zeros
included) changes what the run hands Tunix (the trainer's ``TrainingConfig``, optimizer,
mesh, save mode and model, and the first batch it trains on; GRPO's cluster, rollout and
algorithm configs, rewards and actor), what it records before training (the held-out
evaluation), or stops the run with a one-line error. A filter such as ``if value:`` that
drops an explicit 0, or a field the run never reads, leaves the handed-over objects
equal and fails here. Options that cannot have an effect are listed in
:data:`NO_EFFECT` with the reason.

The runs are real (the run functions, the model loaded on the 8-device mesh, Tunix's
trainer or learner built); each stops at the first ``train`` call. An option read in
several places passes when any of them changes (a filter in one of them can hide behind
another's use: the seed reaches the model init and the data order)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json

import jax
import numpy as np
import pytest

pytest.importorskip("tunix.sft.peft_trainer", reason="google-tunix is not installed")

from flax import nnx  # noqa: E402

from posttrain.distill.options import DistillRunConfig  # noqa: E402
from posttrain.preference.options import DPORunConfig  # noqa: E402
from posttrain.rl.options import GRPORunConfig  # noqa: E402
from posttrain.sft.options import SFTConfig  # noqa: E402


class _Stop(Exception):
    """Raised at the first ``train`` call, once what Tunix receives is recorded."""


def _digest(value) -> str:
    return hashlib.sha256(repr(value).encode()).hexdigest()[:16]


def _plain(value, depth: int = 0):
    """A comparable picture of ``value``: dataclasses and objects by their fields, arrays
    by shape, dtype and a digest of their bytes, callables by name."""
    if depth > 6:
        return type(value).__name__
    if isinstance(value, (str, int, float, bool, type(None))):
        return value
    if isinstance(value, (jax.Array, np.ndarray)):
        host = np.asarray(value)
        return (host.shape, str(host.dtype), hashlib.sha256(host.tobytes()).hexdigest()[:16])
    if isinstance(value, dict):
        return {str(k): _plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, depth + 1) for v in value]
    if isinstance(value, jax.sharding.Mesh):
        return dict(value.shape)
    if dataclasses.is_dataclass(value):
        fields = dataclasses.fields(value)
        return {f.name: _plain(getattr(value, f.name), depth + 1) for f in fields}
    if callable(value):
        return getattr(value, "__qualname__", type(value).__name__)
    if hasattr(value, "__dict__"):
        return {k: _plain(v, depth + 1) for k, v in vars(value).items() if not k.startswith("_")}
    return repr(value)


def _model_picture(model) -> dict:
    """The model's config, its LoRA config (rank, alpha: the scale Qwix applies) and a
    digest of every variable (LoRA included) by path."""
    from posttrain.lora import lora_params
    from posttrain.lora.config import lora_config_of

    flat = nnx.to_flat_state(nnx.state(model))
    values = {"/".join(map(str, path)): _plain(v.get_value()) for path, v in flat}
    return {
        "config": _plain(model.config),
        "lora": _plain(lora_config_of(model)) if lora_params(model) else None,
        "variables": _digest(sorted(values.items())),
    }


def _recorded_facts(cfg) -> dict:
    """What the run recorded of this start in ``run.json`` before training (global batch,
    rows or pairs, data shards, the held-out evaluation before), without the settings."""
    from posttrain.training import record

    body = record.read(cfg.output) or {}
    fields = {f.name for f in dataclasses.fields(cfg)}
    return {k: v for k, v in body.items() if k not in fields | {"settings", "segments", "started"}}


#: the scale of the optimizer picture's gradient at each step (cycled): its global norm
#: (0.79 x this) on both sides of every clipping norm a table here gives, so a clip shows
#: (Adam's update of a constant gradient is the same whatever norm it is clipped to)
GRADIENT_SCALES = (0.2, 8.0, 1.0, 3.0)


def _optimizer_picture(tx, steps: int) -> str:
    """The optimizer's updates of a fixed parameter under gradients of one direction and
    the norms :data:`GRADIENT_SCALES` at every step: its schedule (peak, warm-up, length),
    its clipping and its transformation, as optax applies them."""
    import jax.numpy as jnp

    params = {"w": jnp.linspace(-1.0, 1.0, 5)}
    state = tx.init(params)
    updates = []
    for step in range(steps + 1):
        scale = GRADIENT_SCALES[step % len(GRADIENT_SCALES)]
        grads = {"w": jnp.linspace(0.5, -0.5, 5) * scale}
        update, state = tx.update(grads, state, params)
        updates.append(np.asarray(update["w"]).round(9).tolist())
    return _digest(updates)


def _received(trainer, batches, steps: int) -> dict:
    """What Tunix receives from our run: its ``TrainingConfig``, the optimizer, the
    model, our trainer's mesh and save mode, the first batch."""
    from posttrain.training.policy import TunixPolicy

    model = trainer.model.model if isinstance(trainer.model, TunixPolicy) else trainer.model
    return {
        "config": _plain(trainer.config),
        "optimizer": _optimizer_picture(trainer.optimizer.tx, steps),
        "model": _model_picture(model),
        "mesh": dict(trainer.mesh.shape),
        "single_replica_saves": trainer.single_replica_saves,
        "first_batch": _digest(_plain(next(iter(batches)))),
    }


def _stopped(start, cfg, seen: dict) -> dict:
    """Runs ``start()`` to its ``_Stop`` and returns ``seen`` (the output path taken out:
    each capture writes to a fresh directory), or ``{"error": one line}`` when the run
    refuses the options."""
    try:
        start()
    except _Stop:
        return json.loads(json.dumps(seen, default=str).replace(cfg.output, "<output>"))
    except ValueError as error:
        return {"error": str(error).splitlines()[0]}
    raise AssertionError("the run trained instead of stopping at train()")


def _capture(run, cfg) -> dict:
    """Runs ``cfg`` up to its trainer's first ``train`` call and returns what Tunix
    receives, or ``{"error": one line}`` when the run refuses the options."""
    seen = {}

    def on_built(trainer):
        def train(batches, *args, **kwargs):
            seen.update(_received(trainer, batches, cfg.steps), recorded=_recorded_facts(cfg))
            trainer.abandon()
            raise _Stop

        trainer.train = train

    return _stopped(lambda: run(cfg, on_built=on_built), cfg, seen)


def _grpo_received(learner, policies, data, steps: int) -> dict:
    """What Tunix's GRPO learner receives: its cluster's training and rollout configs and
    meshes, its algorithm config, its reward functions, the actor, the first batch."""
    from posttrain.rl import tunix_rl

    names = set(vars(learner))
    cluster = learner.rl_engine if "rl_engine" in names else learner.rl_cluster
    config = cluster.cluster_config
    algo = learner.algo_config if "algo_config" in names else learner.grpo_config
    training = config.training_config
    return {
        "training": _plain(training),
        "optimizer": _optimizer_picture(training.actor_optimizer, steps),
        "rollout": _plain(config.rollout_config),
        "meshes": {str(role): dict(mesh.shape) for role, mesh in config.role_to_mesh.items()},
        "algorithm": [type(learner).__name__, _plain(algo)],
        "rewards": [getattr(fn, "__name__", repr(fn)) for fn in _reward_fns(learner)],
        "actor": _model_picture(policies[0].model),
        "first_batch": _digest(_plain(next(iter(data)))),
        "tunix": tunix_rl.surface(),
    }


def _reward_fns(learner) -> list:
    """The learner's reward functions: its own (google-tunix <= 0.1.5) or its reward
    manager's (0.1.6+)."""
    owner = vars(learner).get("reward_manager", learner)
    return list(owner.reward_fns)


def _capture_grpo(cfg) -> dict:
    """``_capture`` for ``posttrain grpo``: stops at the learner's ``train``."""
    from posttrain.rl.run import run_grpo

    seen = {}

    def on_built(learner, policies):
        def train(data, *args, **kwargs):
            seen.update(_grpo_received(learner, policies, data, cfg.steps))
            raise _Stop

        learner.train = train

    return _stopped(lambda: run_grpo(cfg, on_built=on_built), cfg, seen)


def _run_sft(cfg, on_built):
    from posttrain.sft.run import run_sft

    return run_sft(cfg, on_built=on_built)


def _run_dpo(cfg, on_built):
    from posttrain.preference.run import run_dpo

    return run_dpo(cfg, on_built=on_built)


def _capture_distill(cfg) -> dict:
    """``_capture`` for ``posttrain distill``: what the SFT trainer's Tunix receives, and
    the distillation trainer's strategy (temperature, alpha, top-k) and teacher."""
    from posttrain.distill.run import run_distill

    seen = {}

    def on_built(trainer):
        def train(batches, *args, **kwargs):
            seen.update(_received(trainer, batches, cfg.steps))
            seen.update(
                strategy=_plain(trainer._strategy), teacher=_model_picture(trainer._teacher)
            )
            trainer.abandon()
            raise _Stop

        trainer.train = train

    return _stopped(lambda: run_distill(cfg, on_built=on_built), cfg, seen)


def _files(tmp_path) -> dict:
    """Inputs an option can name: a chat JSONL, a preference JSONL, another tokenizer, a
    chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    chat = tmp_path / "chat.jsonl"
    pairs = tmp_path / "pairs.jsonl"
    turn = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    chat.write_text("".join(json.dumps({"messages": turn}) + "\n" for _ in range(16)))
    pair = {"prompt": "2+2?", "chosen": "4", "rejected": "5"}
    pairs.write_text("".join(json.dumps(pair) + "\n" for _ in range(16)))
    words = Tokenizer(models.WordLevel(vocab={"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.save(str(tmp_path / "words.json"))
    template = tmp_path / "chat_template.jinja"  # ChatML's markers, another layout
    template.write_text(
        "{% for m in messages %}{{ m.role + ': ' }}{% if m.role == 'assistant' %}"
        "{% generation %}{{ m.content + '<|im_end|>' }}{% endgeneration %}"
        "{% else %}{{ m.content + '\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    return {
        "chat": str(chat),
        "pairs": str(pairs),
        "tokenizer": str(tmp_path / "words.json"),
        "template": str(template),
    }


#: option -> (its other value, base overrides it needs to have an effect); "{chat}" etc.
#: name a file of :func:`_files`.
SFT_VALUES: dict[str, tuple] = {
    "model": ("llama3-tiny", {}),
    "tokenizer": ("{tokenizer}", {}),
    "chat_template": ("{template}", {}),
    "mesh": ({"data": 2, "fsdp": 4}, {}),
    "per_device_batch_size": (2, {}),
    "steps": (4, {}),
    "learning_rate": (1e-2, {}),
    "max_grad_norm": (0.0, {}),  # an explicit zero: no clipping
    "lora_rank": (4, {}),
    "lora_alpha": (3.0, {"lora_rank": 4}),  # alpha scales the adapters only
    "seed": (0, {"seed": 1}),  # an explicit 0 against another base seed
    "save_every": (1, {}),
    "stop_after": (1, {}),
    "data": ("{chat}", {}),
    "data_shards": (2, {}),
    "grad_accum": (2, {}),
    "overflow": ("reject", {}),  # the embedded set has conversations over 64 tokens
    "warmup_steps": (0, {}),  # an explicit zero: no warm-up
    "remat": ("full", {}),
    # the CLI's splash needs a TPU; Pallas' interpreter runs the same kernel here
    "attention_kernel": ("splash_interpret", {}),
    "scan_layers": (True, {}),
    "max_target_length": (128, {}),
    "packing": (False, {"max_target_length": 256}),  # rows that hold several conversations
    "sync_saves": (True, {}),
    "replica_parallel_saves": ("on", {}),
    # #39: images through TrainingInput.images (the drawings' rows need 192 tokens)
    "vision": (True, {"max_target_length": 192}),
}
DPO_VALUES: dict[str, tuple] = {
    **{k: SFT_VALUES[k] for k in ("model", "tokenizer", "mesh", "steps", "learning_rate")},
    "max_grad_norm": (0.5, {}),
    "chat_template": SFT_VALUES["chat_template"],
    **{k: SFT_VALUES[k] for k in ("lora_rank", "lora_alpha", "seed", "save_every")},
    **{k: SFT_VALUES[k] for k in ("stop_after", "grad_accum", "warmup_steps")},
    **{k: SFT_VALUES[k] for k in ("remat", "attention_kernel", "scan_layers", "data_shards")},
    "per_device_batch_size": (2, {}),
    "data": ("{pairs}", {}),
    "eval_data": ("{pairs}", {}),
    "overflow": ("reject", {"max_prompt_length": 8}),
    "max_prompt_length": (32, {}),
    "max_response_length": (32, {}),
    "algorithm": ("orpo", {}),
    "beta": (0.5, {}),
    "label_smoothing": (0.0, {"label_smoothing": 0.2}),  # an explicit zero
    "lambda_orpo": (0.5, {"algorithm": "orpo"}),  # ORPO's weight only
}
GRPO_VALUES: dict[str, tuple] = {
    **{k: SFT_VALUES[k] for k in ("model", "tokenizer", "mesh", "lora_rank", "lora_alpha")},
    "chat_template": SFT_VALUES["chat_template"],
    **{k: SFT_VALUES[k] for k in ("seed", "save_every", "stop_after")},
    "per_device_batch_size": (3, {}),
    "steps": (4, {}),
    "grad_accum": (2, {}),  # Tunix's train micro-batch: 4 of the 8 prompts
    "learning_rate": (1e-3, {}),
    "max_grad_norm": (0.5, {}),  # GRPO's default: none
    "rollout_mesh": ({"data": 8}, {}),
    "rollout_dtype": ("bfloat16", {"rollout_mesh": {"data": 8}}),
    "num_generations": (3, {}),
    "algorithm": ("dapo", {}),
    "beta": (0.0, {}),  # an explicit zero: no KL term, not the algorithm's default
    "epsilon": (0.3, {}),
    "temperature": (0.7, {}),
    "max_prompt_length": (40, {}),
    "max_new_tokens": (4, {}),
    "reward": (("exact_answer",), {}),
    "warmup_steps": (1, {}),
    "warmup_data_shards": (2, {"warmup_steps": 1}),  # the warm-up's data order
}
DISTILL_VALUES: dict[str, tuple] = {
    **{
        k: v
        for k, v in SFT_VALUES.items()
        if k not in ("model", "steps", "max_target_length", "vision")
    },
    "model": ("llama3-tiny", {}),  # the student
    "steps": (4, {}),
    "max_target_length": (64, {}),
    "teacher": ("llama3-tiny", {}),
    "student_layers": (0, {}),  # an explicit zero: every layer of the preset
    "strategy": ("feature-pooling", {}),  # Tunix's FeaturePoolingStrategy on the taps
    "temperature": (2.0, {}),
    "alpha": (0.0, {}),  # an explicit zero: the task loss alone
    "distill_top_k": (5, {}),
    "teacher_dtype": ("bfloat16", {}),  # the teacher's parameters Tunix receives
    "teacher_steps": (2, {"teacher": None}),  # the on-the-fly teacher's training
}
#: Options with no effect on what Tunix receives, and why.
NO_EFFECT: dict[str, str] = {
    "vision": "distill's is a plain field (no flag), always False; sft's has its row",
    "train_vision_tower": "which variables the step differentiates (SFTOptions.frozen), "
    "not what Tunix receives; tests/test_vision_sft.py checks the tower's gradient both ways",
    "image_root": "which image files may be read, not what is read (the same files, or a "
    "one-line refusal); tests/test_vision_data.py checks it reaches the loader",
    "eval_samples": "the evaluation before and after training only (``posttrain grpo``'s "
    "run.json, written at the end; tests/test_rl checks it); Tunix never sees it",
    "output": "where the run writes: each capture writes to a fresh directory, whose path "
    "is taken out of the picture (the checkpoint and TensorBoard paths name it)",
}

SMALL_SFT = {"steps": 3, "max_target_length": 64}
SMALL_DPO = {"steps": 3, "max_prompt_length": 16, "max_response_length": 16}
SMALL_DISTILL = {"steps": 3, "max_target_length": 128, "teacher": "qwen3-tiny", "teacher_steps": 1}
SMALL_GRPO = {
    "steps": 2,
    "warmup_steps": 0,
    "per_device_batch_size": 1,
    "num_generations": 2,
    "max_new_tokens": 3,
    "eval_samples": 0,
}


def _resolve(value, files: dict):
    if isinstance(value, str) and value.startswith("{"):
        return files[value.strip("{}")]
    return value


def _sensitivity(cls, run, values, small, name, tmp_path) -> None:
    value, needs = values[name]
    files = _files(tmp_path)
    base = cls(**{**small, **needs, "output": str(tmp_path / "base")})
    value = _resolve(value, files)
    other = dataclasses.replace(base, **{name: value, "output": str(tmp_path / "other")})
    assert value != getattr(cls(), name) or needs, (name, "is the default")
    before, after = run(base), run(other)
    assert "error" not in before, before
    assert after != before, f"{name}={value!r}: Tunix receives the same as with {base}"


def test_the_tables_name_every_option():
    """Every field of the options is a row of its table or of :data:`NO_EFFECT`."""
    tables = (
        (SFTConfig, SFT_VALUES),
        (DPORunConfig, DPO_VALUES),
        (GRPORunConfig, GRPO_VALUES),
        (DistillRunConfig, DISTILL_VALUES),
    )
    for cls, values in tables:
        names = {f.name for f in dataclasses.fields(cls)}
        assert names == set(values) | (set(NO_EFFECT) & names), cls.__name__


# The slow tier sweeps every option (GRPO's beta=0.0 and distill's alpha=0.0, seen failing
# on `cfg.alpha or 0.5`, are the explicit zeros). The gate's explicit zeros are
# tests/test_options_land.py's sft-model scenario (warmup_steps=0 and max_grad_norm=0.0,
# each checked where it lands: the rate at step 0 is the peak, no clipping), which a
# truthiness filter fails as it failed SFT's warmup_steps here (3 s of the gate).
GATE_SFT: tuple[str, ...] = ()
GATE_GRPO: tuple[str, ...] = ()
GATE_DISTILL: tuple[str, ...] = ()


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=() if n in GATE_SFT else pytest.mark.slow) for n in SFT_VALUES]
)
def test_each_sft_option_changes_what_tunix_receives(name, tmp_path):
    """A non-default value of the SFT option changes what Tunix receives (or is
    refused in one line)."""
    run = functools.partial(_capture, _run_sft)
    _sensitivity(SFTConfig, run, SFT_VALUES, SMALL_SFT, name, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DPO_VALUES))
def test_each_dpo_option_changes_what_tunix_receives(name, tmp_path):
    """A non-default value of the DPO option changes what Tunix receives (or is
    refused in one line)."""
    run = functools.partial(_capture, _run_dpo)
    _sensitivity(DPORunConfig, run, DPO_VALUES, SMALL_DPO, name, tmp_path)


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=() if n in GATE_GRPO else pytest.mark.slow) for n in GRPO_VALUES]
)
def test_each_grpo_option_changes_what_tunix_receives(name, tmp_path):
    """A non-default value of the GRPO option changes what Tunix's learner receives (or
    is refused in one line)."""
    _sensitivity(GRPORunConfig, _capture_grpo, GRPO_VALUES, SMALL_GRPO, name, tmp_path)


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=() if n in GATE_DISTILL else pytest.mark.slow) for n in DISTILL_VALUES],
)
def test_each_distill_option_changes_what_tunix_receives(name, tmp_path):
    """A non-default value of the distillation option changes what Tunix's
    ``DistillationTrainer`` receives, its strategy or its teacher included (or is
    refused in one line)."""
    _sensitivity(DistillRunConfig, _capture_distill, DISTILL_VALUES, SMALL_DISTILL, name, tmp_path)
