"""Every option of every workflow lands where it acts (#59, "Options"): for each field of
each subcommand's options (the fields its flags are generated from,
:func:`posttrain.flags._fields`), a reviewed row of :data:`LANDINGS` says where the value
arrives (Tunix's config object, the loss's hyperparameters, the optax transformation,
our model or trainer, the first batch) and checks that it arrived there, with the value
the options hold, not merely that something changed.

Each workflow is started through its real run function and stopped where it hands its
objects over (:func:`tests.landing.capture`); one start per scenario of
:data:`SCENARIOS`, and every row of the workflow is checked on every start (defaults
included). The scenarios together drive each field to a value other than its default,
and to an explicit zero (``0``, ``0.0``, ``False``) wherever the field accepts one
(:func:`test_the_scenarios_drive_every_field_off_its_default_and_to_zero`): a filter such
as ``if cfg.beta:`` that drops an explicit zero, a field parsed and recorded but never
handed over, a schedule whose floor is not the one documented, fails here, naming the
field. A field added to the options without a row fails
:func:`test_every_generated_field_has_a_reviewed_landing`.

Fields whose landing is checked by another test (the converter's, the plan's) name that
test in :data:`ELSEWHERE`; the test fails when the named test does not exist.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import pathlib
from collections.abc import Callable

import jax
import pytest

pytest.importorskip("tunix.sft.peft_trainer", reason="google-tunix is not installed")

from posttrain import cli, flags  # noqa: E402
from posttrain.cli_options import GenerateOptions  # noqa: E402
from posttrain.distill.options import DistillRunConfig  # noqa: E402
from posttrain.preference.options import DPORunConfig  # noqa: E402
from posttrain.rl.options import GRPORunConfig  # noqa: E402
from posttrain.sft.options import SFTConfig  # noqa: E402
from tests import landing  # noqa: E402
from tests.landing import Seen  # noqa: E402

#: The schedule of ``posttrain sft`` / ``dpo`` / ``distill``: linear warm-up from 0 to the
#: peak, cosine to this fraction of the peak at the last step (docs/sft.md: "cosine to
#: 10%"; the floor #59 names).
END_FRACTION = 0.1


@dataclasses.dataclass(frozen=True)
class Lands:
    """One reviewed row: where a field's value arrives, and the check that it did.

    Attributes:
      where: the object (and attribute) the value must reach.
      check: ``check(seen)`` asserts the value of ``seen.cfg`` arrived there.
    """

    where: str
    check: Callable[[Seen], None]


def _eq(actual, expected, what: str) -> None:
    assert actual == expected, f"{what}: {actual!r}, expected {expected!r}"


def _close(actual: float, expected: float, what: str) -> None:
    assert abs(actual - expected) <= 1e-6 * max(abs(expected), 1e-6), (
        f"{what}: {actual!r}, expected {expected!r}"
    )


# --- the shared rows: the model, the mesh, the schedule, LoRA, the checkpoints --------


def _tok(seen: Seen):
    from posttrain.tokenizer import load_tokenizer

    return load_tokenizer(seen.cfg.tokenizer)


def _text(seen: Seen) -> str:
    """The first batch's tokens as text, through the run's tokenizer."""
    batch = seen.batch
    keys = [k for k in ("input_tokens", "prompt_ids", "chosen_ids") if k in batch]
    return "\n".join(landing.decoded(_tok(seen), landing.host(batch[k])) for k in keys)


def _tokens(seen: Seen) -> set[int]:
    batch = seen.batch
    keys = [k for k in ("input_tokens", "prompt_ids", "chosen_ids") if k in batch]
    return {int(t) for k in keys for t in landing.host(batch[k]).ravel()}


def _model_config(seen: Seen):
    """The config the trained model must have: the preset's, with the run's remat,
    scanning and attention kernel (the student cut to ``student_layers`` for
    distillation)."""
    from posttrain.distill.options import DistillRunConfig
    from posttrain.models import get_config
    from posttrain.training.options import PeftRunOptions

    cfg = seen.cfg
    expected = get_config(cfg.model)
    if isinstance(cfg, PeftRunOptions):  # GRPO loads the model as it is
        expected = expected.replace(
            remat=cfg.remat, scan_layers=cfg.scan_layers, attention_kernel=cfg.attention_kernel
        )
    if isinstance(cfg, DistillRunConfig) and cfg.student_layers:
        from posttrain.distill.trainer import shallower

        expected = shallower(expected, cfg.student_layers)
    return expected


def _check_model(seen: Seen) -> None:
    _eq(seen.model.config, _model_config(seen), "the trained model's config")


def _check_tokenizer(seen: Seen) -> None:
    """The batch holds the run's tokenizer's ids: the data's :data:`MARKER` reads back
    through it, and not through the other tokenizer (the same bytes, other ids)."""
    from posttrain.tokenizer import byte_tokenizer, load_tokenizer

    if seen.cfg.tokenizer is None:
        other = landing.shifted_byte_tokenizer(pathlib.Path(seen.cfg.output) / "other.json")
        other = load_tokenizer(other)
    else:
        other = byte_tokenizer()
    if seen.cfg.data is None:  # the embedded data: ChatML's markers (_check_template)
        return
    batch = seen.batch
    keys = [k for k in ("input_tokens", "prompt_ids", "chosen_ids") if k in batch]
    theirs = "".join(landing.decoded(other, landing.host(batch[k])) for k in keys)
    assert landing.MARKER in _text(seen), "the data does not read back through --tokenizer"
    assert landing.MARKER not in theirs, "the batch reads through the other tokenizer"


def _check_template(seen: Seen) -> None:
    """The rows are in the run's template: ``user: `` lines for the file given here,
    ChatML's ``<|im_start|>user`` by default."""
    text = _text(seen)
    if seen.cfg.chat_template is None:
        assert "<|im_start|>assistant" in text, text[:200]
    else:
        assert "assistant: " in text and "<|im_start|>" not in text, text[:200]


def _default_mesh() -> dict[str, int]:
    """The mesh a run without ``--mesh`` gets: every device on fsdp (8 on the CPU tier,
    1 on one chip)."""
    import jax

    return {"fsdp": jax.device_count()}


def _mesh(seen: Seen) -> dict[str, int]:
    return seen.cfg.mesh or _default_mesh()


def _sized(shape) -> dict[str, int]:
    return {k: v for k, v in dict(shape).items() if v > 1}


def _check_mesh(seen: Seen) -> None:
    _eq(_sized(seen.trainer.mesh.shape), _sized(_mesh(seen)), "the trainer's mesh")
    _eq(_sized(landing.leaf_sharding_mesh(seen.model)), _sized(_mesh(seen)), "the model's mesh")


def _data_parallel(mesh: dict[str, int]) -> int:
    return mesh.get("data", 1) * mesh.get("fsdp", 1)


def _check_batch_rows(seen: Seen) -> None:
    rows = seen.batch[next(iter(seen.batch))].shape[0]
    expected = seen.cfg.per_device_batch_size * _data_parallel(_mesh(seen))
    _eq(rows, expected, "rows of the first micro-batch")


def _training_config(seen: Seen):
    return seen.trainer.config


def _check_max_steps(seen: Seen) -> None:
    cfg = seen.cfg
    _eq(_training_config(seen).max_steps, min(cfg.steps, cfg.stop_after or cfg.steps), "max_steps")


def _rates(seen: Seen) -> list[float]:
    """The rate of each optimizer step (Tunix wraps the transformation in
    ``optax.MultiSteps`` under gradient accumulation: one update per ``grad_accum``)."""
    return landing.rates(seen.trainer.optimizer.tx, seen.cfg.steps, seen.trainer.grad_accum_steps)


def _check_schedule(seen: Seen) -> None:
    """The optimizer's rate: 0 rising to the peak over ``warmup_steps`` (the peak at once
    for an explicit 0), ``END_FRACTION`` of it at the last step (the floor), above the
    floor before it."""
    cfg = seen.cfg
    rates, peak = _rates(seen), cfg.learning_rate
    warmup = min(cfg.warmup_steps, cfg.steps - 1)
    _close(rates[warmup], peak, f"the rate at step {warmup} (the end of the warm-up)")
    if warmup:
        _close(rates[0], 0.0, "the rate at step 0 (the warm-up's start)")
    _close(rates[cfg.steps], END_FRACTION * peak, f"the rate at step {cfg.steps} (the floor)")
    if cfg.steps - 1 > warmup:
        assert rates[cfg.steps - 1] > END_FRACTION * peak * 1.0001, rates


def _check_clipping(seen: Seen) -> None:
    """The optimizer clips each step's (accumulated) gradient at ``max_grad_norm``, not at
    all at 0 (:func:`tests.landing.check_clipping`)."""
    tx, micro = seen.trainer.optimizer.tx, seen.trainer.grad_accum_steps
    landing.check_clipping(tx, seen.cfg.max_grad_norm, micro)


def _check_lora(seen: Seen) -> None:
    """The model's adapters: the run's rank, alpha (default 2 x rank) and seed; none at
    rank 0."""
    from posttrain.lora import lora_params
    from posttrain.lora.config import lora_config_of

    cfg, model = seen.cfg, seen.model
    if not cfg.lora_rank:
        assert not lora_params(model), "LoRA parameters at --lora-rank 0"
        return
    lora = lora_config_of(model)
    _eq(lora.rank, cfg.lora_rank, "the adapters' rank")
    _eq(lora.alpha, cfg.lora_alpha or 2.0 * cfg.lora_rank, "the adapters' alpha")
    _eq(lora.seed, cfg.seed, "the adapters' seed")


def _check_init_seed(seen: Seen) -> None:
    """A preset starts from its init with the run's seed (the embedding compared)."""
    import numpy as np
    from flax import nnx

    from posttrain.distill.options import DistillRunConfig
    from posttrain.models import PRESETS, build_model

    cfg = seen.cfg
    if cfg.model not in PRESETS or isinstance(cfg, DistillRunConfig) and cfg.student_layers:
        return  # a cut student is written from its own init (posttrain.distill.run)
    if seen.trainer is not None and seen.trainer.train_steps:
        return
    fresh = build_model(seen.model.config, seed=cfg.seed)
    ours = dict(nnx.to_flat_state(nnx.state(seen.model, nnx.Param)))
    for path, value in nnx.to_flat_state(nnx.state(fresh, nnx.Param)):
        np.testing.assert_array_equal(
            landing.host(ours[path].get_value()),
            landing.host(value.get_value()),
            err_msg=f"the model's {path} is not seed {cfg.seed}'s init",
        )


def _vision(cfg) -> bool:
    """``posttrain sft --vision`` (distillation's options have no images)."""
    from posttrain.sft.options import SFTConfig

    return isinstance(cfg, SFTConfig) and cfg.vision


def _check_first_batch_order(seen: Seen) -> None:
    """The first micro-batch is the run's rows in the order of its seed and data shards
    (:func:`posttrain.sft.data.sharded_batches` over :func:`posttrain.sft.run.build_rows`)."""
    import numpy as np

    from posttrain.distill.options import DistillRunConfig
    from posttrain.training import data
    from posttrain.training.formats import run_tokenizer_and_formats
    from posttrain.training.supervised import build_rows

    cfg = seen.cfg
    if _vision(cfg):  # the vision rows: their shards' order is the same sharded_batches
        return
    if isinstance(cfg, DistillRunConfig):  # distillation trains on its 7-in-8 split
        cfg = dataclasses.replace(cfg, data=str(pathlib.Path(cfg.output) / "data" / "train.jsonl"))
    shards = seen.record["data_shards"]
    if cfg.data_shards is not None:
        _eq(shards, cfg.data_shards, "the data shards")
    tok, formats = run_tokenizer_and_formats(cfg)
    rows = {s: build_rows(cfg, tok, (s, shards), formats.template) for s in range(shards)}
    gb = cfg.per_device_batch_size * _data_parallel(_mesh(seen))
    first = next(data.sharded_batches(rows, shards, gb, cfg.grad_accum, seed=cfg.seed))
    np.testing.assert_array_equal(
        landing.host(seen.batch["input_tokens"]), first["input_tokens"], err_msg="first batch"
    )


def _check_save_every(seen: Seen) -> None:
    options = _training_config(seen).checkpointing_options
    _eq(options.save_interval_steps, seen.cfg.save_every, "Orbax's save interval")


def _check_output(seen: Seen) -> None:
    root = pathlib.Path(seen.cfg.output).resolve() / "checkpoints"
    _eq(_training_config(seen).checkpoint_root_directory, str(root), "the checkpoint root")


def _check_data(seen: Seen) -> None:
    if seen.cfg.data is not None:
        assert landing.MARKER in _text(seen), "the first batch is not the --data file's"
    else:
        assert landing.MARKER not in _text(seen)


def _check_grad_accum(seen: Seen) -> None:
    ga = seen.cfg.grad_accum
    _eq(_training_config(seen).gradient_accumulation_steps, ga if ga > 1 else None, "Tunix's GA")
    _eq(seen.trainer.grad_accum_steps, ga, "the trainer's micro-steps per step")


def _check_overflow(seen: Seen) -> None:
    """``reject``: an example over its length is refused in one line naming the rule;
    ``truncate`` (checked where no run is refused): the run starts."""
    if seen.cfg.overflow == "reject":
        assert seen.error and "overflow" in seen.error and "reject" in seen.error, seen.error
    else:
        assert seen.error is None, seen.error


def _check_remat(seen: Seen) -> None:
    _eq(seen.model.config.remat, seen.cfg.remat, "the model's remat")


def _check_scan(seen: Seen) -> None:
    _eq(seen.model.config.scan_layers, seen.cfg.scan_layers, "the model's scan_layers")


def _check_attention_kernel(seen: Seen) -> None:
    """The model's config carries the kernel, and its attention dispatches on it: its
    forward holds the Pallas kernel exactly when the kernel is not ``xla``."""
    kernel = seen.cfg.attention_kernel
    _eq(seen.model.config.attention_kernel, kernel, "the model's attention_kernel")
    pallas = "pallas_call" in landing.forward_primitives(seen.model)
    _eq(pallas, kernel != "xla", "a pallas_call in the model's forward")


def _check_row_length(seen: Seen) -> None:
    _eq(seen.batch["input_tokens"].shape[1], seen.cfg.max_target_length, "tokens per row")


def _check_packing(seen: Seen) -> None:
    """Packed rows of the short conversations of ``--data`` hold several (segment ids past
    1); unpacked rows one (the embedded set's conversations fill a row each)."""
    segments = int(landing.host(seen.batch["segment_ids"]).max())
    if _vision(seen.cfg):  # one conversation per row, whatever --packing
        _eq(segments, 1, "conversations per row of a vision run")
    elif seen.cfg.packing and seen.cfg.data:
        assert segments > 1, "--packing: no row holds two conversations"
    elif not seen.cfg.packing:
        _eq(segments, 1, "conversations per row without packing")


def _check_sync_saves(seen: Seen) -> None:
    options = _training_config(seen).checkpointing_options
    _eq(options.enable_async_checkpointing, not seen.cfg.sync_saves, "Orbax's async saves")


def _check_replica_saves(seen: Seen) -> None:
    # auto: single-replica saves on one CPU process only (replica-parallel on an accelerator)
    one_cpu = jax.default_backend() == "cpu" and jax.process_count() == 1
    expected = {"on": False, "off": True, "auto": one_cpu}[seen.cfg.replica_parallel_saves]
    _eq(seen.trainer.single_replica_saves, expected, "single-replica saves")


def _check_vision(seen: Seen) -> None:
    """``--vision``: a model with a tower and images in the batch; none without."""
    has_images = "images" in seen.batch or "pixel_values" in seen.batch
    _eq(seen.model.config.vision is not None, seen.cfg.vision, "the model's tower")
    _eq(has_images, seen.cfg.vision, "images in the batch")


def _check_tower_trained(seen: Seen) -> None:
    """The trained variables hold the tower's exactly under ``--train-vision-tower``."""
    from flax import nnx

    if not seen.cfg.vision:
        return
    learned = nnx.to_flat_state(nnx.state(seen.model, seen.trainer.learned))
    tower = any("vision" in "/".join(map(str, path)) for path, _ in learned)
    _eq(tower, seen.cfg.train_vision_tower, "tower variables among the trained")


def _check_image_root(seen: Seen) -> None:
    """The data's images lie outside its directory: read under ``--image-root``, refused
    without it (the message names the widening flag)."""
    if not (seen.cfg.vision and seen.cfg.data):
        return
    if seen.cfg.image_root is None:
        assert seen.error and "--image-root" in seen.error, seen.error
    else:
        assert seen.error is None, seen.error


RUN = {
    "model": Lands("the trained model's config (the preset's)", _check_model),
    "tokenizer": Lands("the first batch's token ids", _check_tokenizer),
    "chat_template": Lands("the first batch's layout", _check_template),
    "mesh": Lands("the trainer's mesh and the model's placement", _check_mesh),
    "per_device_batch_size": Lands("rows of the first micro-batch", _check_batch_rows),
    "steps": Lands("TrainingConfig.max_steps; the schedule's length", _check_max_steps),
    "learning_rate": Lands("the optax transformation's rate at each step", _check_schedule),
    "max_grad_norm": Lands("the optax transformation's clipping", _check_clipping),
    "lora_rank": Lands("the model's LoRA config", _check_lora),
    "lora_alpha": Lands("the model's LoRA config", _check_lora),
    "seed": Lands(
        "the preset's init, the adapters' seed", lambda s: (_check_init_seed(s), _check_lora(s))
    ),
    "save_every": Lands("TrainingConfig.checkpointing_options", _check_save_every),
    "stop_after": Lands("TrainingConfig.max_steps", _check_max_steps),
    "output": Lands("TrainingConfig.checkpoint_root_directory", _check_output),
}
PEFT = {
    **RUN,
    "data": Lands("the first batch's text", _check_data),
    "data_shards": Lands("the first batch (shards' order)", _check_first_batch_order),
    "grad_accum": Lands("TrainingConfig.gradient_accumulation_steps", _check_grad_accum),
    "overflow": Lands("the run's refusal of a long example", _check_overflow),
    "warmup_steps": Lands("the optax transformation's rate at each step", _check_schedule),
    "remat": Lands("the model's config", _check_remat),
    "scan_layers": Lands("the model's config", _check_scan),
    "attention_kernel": Lands(
        "the model's config; its attention's kernel (a pallas_call)", _check_attention_kernel
    ),
}
SFT = {
    **PEFT,
    "seed": Lands(
        "the preset's init, the adapters, the data order",
        lambda s: (_check_init_seed(s), _check_lora(s), _check_first_batch_order(s)),
    ),
    "max_target_length": Lands("the first batch's row length", _check_row_length),
    "packing": Lands("the first batch's segments", _check_packing),
    "sync_saves": Lands("TrainingConfig.checkpointing_options", _check_sync_saves),
    "replica_parallel_saves": Lands("SFTTrainer.single_replica_saves", _check_replica_saves),
    "vision": Lands("the model's tower, the batch's images", _check_vision),
    "train_vision_tower": Lands("SFTTrainer.learned", _check_tower_trained),
    "image_root": Lands("the vision data loader's confinement", _check_image_root),
}


def _loss_inputs(seen: Seen) -> dict:
    """The hyperparameters Tunix's DPO trainer hands its loss with each batch
    (``gen_model_input_fn``, read by our step too)."""
    return seen.trainer.gen_model_input_fn(None)


def _check_algorithm(seen: Seen) -> None:
    _eq(_loss_inputs(seen)["algorithm"], seen.cfg.algorithm, "the loss's algorithm")
    orpo = seen.cfg.algorithm == "orpo"
    _eq(seen.trainer.ref_model is None, orpo, "no reference model (ORPO)")


def _check_preference_value(name: str, algorithm: str | None = None):
    def check(seen: Seen) -> None:
        if algorithm and seen.cfg.algorithm != algorithm:
            assert name not in _loss_inputs(seen), f"{name} handed to {seen.cfg.algorithm}"
            return
        _eq(_loss_inputs(seen)[name], getattr(seen.cfg, name), f"the loss's {name}")

    return check


def _check_recorded_shards(seen: Seen) -> None:
    """The pairs are split into the run's shards (``ShardedPairs.shards``, what its
    batches and ``run.json`` read)."""
    if seen.cfg.data_shards is not None:
        _eq(seen.record["data_shards"], seen.cfg.data_shards, "the pairs' data shards")


def _check_eval_data(seen: Seen) -> None:
    """The evaluation before training ran on the held-out file's pairs (whole batches):
    24 here; the embedded held-out pairs without ``--data``; none with ``--data`` alone."""
    before = seen.record["segments"][-1]["evaluation_before"]
    cfg = seen.cfg
    if cfg.eval_data is None:
        assert (before is None) == (cfg.data is not None), before
        return
    gb = cfg.per_device_batch_size * _data_parallel(_mesh(seen))
    shards = seen.record["data_shards"]
    _eq(before["pairs"], 24 // shards // (gb // shards) * gb, "held-out pairs evaluated")


def _check_width(key: str, name: str):
    def check(seen: Seen) -> None:
        _eq(seen.batch[key].shape[1], getattr(seen.cfg, name), f"{key}'s width")

    return check


DPO = {
    **PEFT,
    "data_shards": Lands("the pairs' shards", _check_recorded_shards),
    "eval_data": Lands("the evaluation before training (run.json)", _check_eval_data),
    "max_prompt_length": Lands(
        "the batch's prompt_ids width", _check_width("prompt_ids", "max_prompt_length")
    ),
    "max_response_length": Lands(
        "the batch's chosen_ids width", _check_width("chosen_ids", "max_response_length")
    ),
    "algorithm": Lands("the loss's algorithm; the reference", _check_algorithm),
    "beta": Lands("the loss's beta (DPO)", _check_preference_value("beta", "dpo")),
    "label_smoothing": Lands(
        "the loss's label_smoothing", _check_preference_value("label_smoothing")
    ),
    "lambda_orpo": Lands(
        "the loss's lambda_orpo (ORPO)", _check_preference_value("lambda_orpo", "orpo")
    ),
}

# --- GRPO: Tunix's cluster, rollout and algorithm configs ----------------------------


def _cluster(seen: Seen):
    names = set(vars(seen.learner))
    return seen.learner.rl_engine if "rl_engine" in names else seen.learner.rl_cluster


def _algo(seen: Seen):
    names = set(vars(seen.learner))
    return seen.learner.algo_config if "algo_config" in names else seen.learner.grpo_config


def _rl_training(seen: Seen):
    return _cluster(seen).cluster_config.training_config


def _rollout(seen: Seen):
    return _cluster(seen).cluster_config.rollout_config


def _role_meshes(seen: Seen) -> dict[str, dict[str, int]]:
    meshes = _cluster(seen).cluster_config.role_to_mesh
    return {str(role).split(".")[-1].lower(): _sized(m.shape) for role, m in meshes.items()}


def _grpo_batch(seen: Seen) -> int:
    return seen.cfg.per_device_batch_size * _data_parallel(_mesh(seen))


def _check_grpo_tokenizer(seen: Seen) -> None:
    """Tunix's cluster tokenises with the run's tokenizer."""
    from posttrain.tokenizer import load_tokenizer

    expected = load_tokenizer(seen.cfg.tokenizer).encode(landing.MARKER).ids
    _eq(list(_cluster(seen).tokenizer.encode(landing.MARKER)), list(expected), "the ids")


def _check_grpo_template(seen: Seen) -> None:
    prompt = str(seen.batch["prompts"][0])
    marker = "<|im_start|>assistant" if seen.cfg.chat_template is None else "assistant: "
    assert marker in prompt and prompt.endswith(
        marker.split("|>")[-1] + ("\n" * (seen.cfg.chat_template is None))
    ), prompt


def _check_grpo_mesh(seen: Seen) -> None:
    meshes = _role_meshes(seen)
    _eq(meshes["actor"], _sized(_mesh(seen)), "the actor's mesh")
    _eq(meshes["reference"], _sized(_mesh(seen)), "the reference's mesh")
    _eq(
        _sized(landing.leaf_sharding_mesh(seen.model)), _sized(_mesh(seen)), "the actor's placement"
    )


def _check_rollout_mesh(seen: Seen) -> None:
    expected = seen.cfg.rollout_mesh or _mesh(seen)
    _eq(_role_meshes(seen)["rollout"], _sized(expected), "the rollout's mesh")


def _check_grpo_batch(seen: Seen) -> None:
    _eq(len(seen.batch["prompts"]), _grpo_batch(seen), "prompts of the first step")
    _eq(_rl_training(seen).mini_batch_size, _grpo_batch(seen), "Tunix's mini-batch")


def _check_grpo_micro(seen: Seen) -> None:
    training = _rl_training(seen)
    names = {f.name for f in dataclasses.fields(training)}
    name = (
        "train_micro_batch_size"
        if "train_micro_batch_size" in names
        else "training_micro_batch_size"
    )
    _eq(getattr(training, name), _grpo_batch(seen) // seen.cfg.grad_accum, "Tunix's micro-batch")


def _check_grpo_steps(seen: Seen) -> None:
    cfg = seen.cfg
    _eq(_rl_training(seen).max_steps, min(cfg.steps, cfg.stop_after or cfg.steps), "max_steps")


def _check_grpo_rate(seen: Seen) -> None:
    """Adam at the run's rate, constant to the last step (its end value)."""
    rates = landing.rates(_rl_training(seen).actor_optimizer, seen.cfg.steps)
    for step in (0, seen.cfg.steps):
        _close(rates[step], seen.cfg.learning_rate, f"the actor's rate at step {step}")


def _check_grpo_clipping(seen: Seen) -> None:
    """The actor's optimizer clips at ``max_grad_norm`` (none at GRPO's default 0)."""
    landing.check_clipping(_rl_training(seen).actor_optimizer, seen.cfg.max_grad_norm)


def _check_grpo_seed(seen: Seen) -> None:
    if not seen.cfg.warmup_steps:  # else the actor starts from the warm-up's export
        _check_init_seed(seen)
    _check_lora(seen)
    _eq(_rollout(seen).seed, seen.cfg.seed, "the rollout's base seed")


def _check_grpo_saves(seen: Seen) -> None:
    cfg = seen.cfg
    interval = _rl_training(seen).checkpointing_options.save_interval_steps
    _eq(interval, min(cfg.save_every, cfg.stop_after or cfg.save_every), "Orbax's interval")


def _check_grpo_output(seen: Seen) -> None:
    root = pathlib.Path(seen.cfg.output).resolve() / "checkpoints"
    _eq(_rl_training(seen).checkpoint_root_directory, str(root), "the checkpoint root")


def _check_rollout_dtype(seen: Seen) -> None:
    import jax.numpy as jnp

    value = _rollout(seen).data_type if seen.cfg.rollout_dtype else None
    expected = jnp.dtype(seen.cfg.rollout_dtype) if seen.cfg.rollout_dtype else None
    _eq(value, expected, "RolloutConfig.data_type")


def _check_algo(name: str, attribute: str | None = None):
    def check(seen: Seen) -> None:
        value = getattr(seen.cfg, name)
        if value is None:  # the algorithm's own default
            from posttrain.rl import tunix_rl

            _, config = tunix_rl.learner_and_config(seen.cfg.algorithm)
            value = config().__dict__[attribute or name]
        _eq(getattr(_algo(seen), attribute or name), value, f"the algorithm config's {name}")

    return check


def _check_grpo_algorithm(seen: Seen) -> None:
    from posttrain.rl import tunix_rl

    learner, config = tunix_rl.learner_and_config(seen.cfg.algorithm)
    _eq(type(seen.learner), learner, "the learner")
    _eq(type(_algo(seen)), config, "the algorithm config")


def _check_rollout_value(name: str, attribute: str):
    def check(seen: Seen) -> None:
        _eq(
            getattr(_rollout(seen), attribute),
            getattr(seen.cfg, name),
            f"RolloutConfig.{attribute}",
        )

    return check


def _check_rewards(seen: Seen) -> None:
    owner = vars(seen.learner).get("reward_manager", seen.learner)
    names = [getattr(fn, "__name__", repr(fn)) for fn in owner.reward_fns]
    ours = [spec.split(":")[-1] for spec in seen.cfg.reward]  # DAPO appends its shaping
    _eq(names[: len(ours)], ours, "the learner's rewards")
    _eq(names[len(ours) :], ["reward_shaping"] if seen.cfg.algorithm == "dapo" else [], "Tunix's")


def _warmup_dir(seen: Seen) -> pathlib.Path:
    return pathlib.Path(seen.cfg.output) / "warmup"


def _check_warmup(seen: Seen) -> None:
    """``warmup_steps`` SFT steps first, the actor starting from their export; none at 0
    (the actor is the preset's init)."""
    from posttrain.training import record
    from posttrain.training.options import SupervisedRunOptions

    n = seen.cfg.warmup_steps
    if not n:
        assert not _warmup_dir(seen).exists(), "a warm-up at --warmup-steps 0"
        return
    settings = (record.read(_warmup_dir(seen)) or {})["settings"]
    _eq(settings["steps"], n, "the warm-up's steps")
    assert (_warmup_dir(seen) / f"model-step{n}").is_dir(), "no warm-up export"
    # a recipe of its own (docs/rl.md): posttrain sft's defaults, whatever GRPO's options
    defaults = {f.name: f.default for f in dataclasses.fields(SupervisedRunOptions)}
    assert (defaults["learning_rate"], defaults["max_grad_norm"]) == (3e-3, 1.0)  # docs/rl.md
    for name in ("learning_rate", "max_grad_norm", "lora_rank"):
        _eq(settings[name], defaults[name], f"the warm-up's {name}")


def _check_warmup_shards(seen: Seen) -> None:
    from posttrain.training import record

    if not seen.cfg.warmup_steps:
        return
    body = record.read(_warmup_dir(seen)) or {}
    expected = seen.cfg.warmup_data_shards or 1
    _eq(body["segments"][-1]["data_shards"], expected, "the warm-up's data shards")


def _check_eval_samples(seen: Seen) -> None:
    """The evaluation before training samples ``eval_samples`` completions of each task
    problem at the rollout's temperature and length; none at 0."""
    from posttrain.rl import arithmetic

    n = seen.cfg.eval_samples
    if not n:
        _eq(seen.calls, [], "evaluation calls at --eval-samples 0")
        return
    _, prompts, sampling, _ = seen.calls[0]
    _eq(len(prompts), n * len(arithmetic.problems()), "completions evaluated")
    _eq(sampling.temperature, seen.cfg.temperature, "the evaluation's temperature")
    _eq(sampling.max_new_tokens, seen.cfg.max_new_tokens, "the evaluation's length")
    _eq(sampling.seed, seen.cfg.seed, "the evaluation's seed")


GRPO = {
    "model": Lands("the actor's config (the preset's)", _check_model),
    "tokenizer": Lands("Tunix's cluster tokenizer", _check_grpo_tokenizer),
    "chat_template": Lands("the prompts Tunix's learner receives", _check_grpo_template),
    "mesh": Lands(
        "ClusterConfig.role_to_mesh (actor, reference); the actor's placement", _check_grpo_mesh
    ),
    "rollout_mesh": Lands("ClusterConfig.role_to_mesh (rollout)", _check_rollout_mesh),
    "rollout_dtype": Lands("RolloutConfig.data_type", _check_rollout_dtype),
    "per_device_batch_size": Lands(
        "the prompts of a step; RLTrainingConfig.mini_batch_size", _check_grpo_batch
    ),
    "num_generations": Lands(
        "the algorithm config's num_generations", _check_algo("num_generations")
    ),
    "steps": Lands("RLTrainingConfig.max_steps", _check_grpo_steps),
    "grad_accum": Lands("RLTrainingConfig's train micro-batch", _check_grpo_micro),
    "learning_rate": Lands("RLTrainingConfig.actor_optimizer's rate", _check_grpo_rate),
    "max_grad_norm": Lands("RLTrainingConfig.actor_optimizer's clipping", _check_grpo_clipping),
    "lora_rank": Lands("the actor's LoRA config", _check_lora),
    "lora_alpha": Lands("the actor's LoRA config", _check_lora),
    "algorithm": Lands("the learner and its config class", _check_grpo_algorithm),
    "beta": Lands("the algorithm config's beta", _check_algo("beta")),
    "epsilon": Lands("the algorithm config's epsilon", _check_algo("epsilon")),
    "temperature": Lands(
        "RolloutConfig.temperature", _check_rollout_value("temperature", "temperature")
    ),
    "max_prompt_length": Lands(
        "RolloutConfig.max_prompt_length",
        _check_rollout_value("max_prompt_length", "max_prompt_length"),
    ),
    "max_new_tokens": Lands(
        "RolloutConfig.max_tokens_to_generate",
        _check_rollout_value("max_new_tokens", "max_tokens_to_generate"),
    ),
    "reward": Lands("the learner's reward functions", _check_rewards),
    "warmup_steps": Lands("the warm-up SFT run the actor starts from", _check_warmup),
    "warmup_data_shards": Lands("the warm-up SFT run's data shards", _check_warmup_shards),
    "eval_samples": Lands("our generate's calls before training", _check_eval_samples),
    "seed": Lands("the actor's init, its adapters, RolloutConfig.seed", _check_grpo_seed),
    "save_every": Lands("RLTrainingConfig.checkpointing_options", _check_grpo_saves),
    "stop_after": Lands("RLTrainingConfig.max_steps", _check_grpo_steps),
    "output": Lands("RLTrainingConfig.checkpoint_root_directory", _check_grpo_output),
}

# --- distillation: Tunix's strategy, the teacher ----------------------------------------


def _strategy(seen: Seen):
    return seen.trainer._strategy


def _check_strategy(seen: Seen) -> None:
    from posttrain.distill import tunix_distill

    cls = tunix_distill.strategy_class(seen.cfg.strategy)
    assert isinstance(_strategy(seen), cls), (type(_strategy(seen)), cls)


def _check_strategy_value(name: str, logit_only: bool = True):
    def check(seen: Seen) -> None:
        if logit_only and seen.cfg.strategy != "logit":
            return
        _eq(getattr(_strategy(seen), name), getattr(seen.cfg, name), f"the strategy's {name}")

    return check


def _check_teacher(seen: Seen) -> None:
    from posttrain.models import PRESETS, get_config

    if seen.cfg.teacher in PRESETS:
        _eq(seen.trainer._teacher.config, get_config(seen.cfg.teacher), "the teacher's config")
    elif seen.cfg.teacher is None:
        _eq(seen.trainer._teacher.config.family, "llama3", "the on-the-fly teacher's family")


def _check_teacher_dtype(seen: Seen) -> None:
    import jax
    from flax import nnx

    dtypes = {str(x.dtype) for x in jax.tree.leaves(nnx.state(seen.trainer._teacher, nnx.Param))}
    _eq(dtypes, {seen.cfg.teacher_dtype}, "the teacher's parameter dtypes")


def _check_teacher_steps(seen: Seen) -> None:
    """Without ``--teacher`` the teacher is trained ``teacher_steps`` steps first."""
    from posttrain.training import record

    if seen.cfg.teacher is not None:
        return
    where = pathlib.Path(seen.cfg.output) / "teacher"
    _eq((record.read(where) or {})["settings"]["steps"], seen.cfg.teacher_steps, "its steps")
    assert (where / f"model-step{seen.cfg.teacher_steps}").is_dir(), "no teacher export"


DISTILL = {
    **{k: v for k, v in SFT.items() if k not in ("vision", "train_vision_tower", "image_root")},
    "model": Lands("the student's config (the preset's, cut)", _check_model),
    "student_layers": Lands("the student's config (num_layers)", _check_model),
    "teacher": Lands("DistillTrainer._teacher's config", _check_teacher),
    "strategy": Lands("Tunix's strategy class", _check_strategy),
    "temperature": Lands("LogitStrategy.temperature", _check_strategy_value("temperature")),
    "alpha": Lands("the strategy's alpha", _check_strategy_value("alpha", logit_only=False)),
    "distill_top_k": Lands("LogitStrategy.distill_top_k", _check_strategy_value("distill_top_k")),
    "teacher_dtype": Lands("the teacher's parameters", _check_teacher_dtype),
    "teacher_steps": Lands("the on-the-fly teacher's SFT run", _check_teacher_steps),
}

# --- generate: our sampler's call -------------------------------------------------------


def _call(seen: Seen):
    """``(model, prompt ids, SamplingConfig, keywords)`` of the first generate call."""
    assert seen.calls, "generate was not called"
    return seen.calls[0]


def _check_gen_model(seen: Seen) -> None:
    from posttrain.models import get_config

    _eq(_call(seen)[0].config, get_config(seen.cfg.model), "the sampled model's config")


def _check_gen_adapter(seen: Seen) -> None:
    """``--adapter``: the sampled model carries the saved adapters (rank 2 here)."""
    from posttrain.lora import lora_params
    from posttrain.lora.config import lora_config_of

    model = _call(seen)[0]
    if seen.cfg.adapter is None:
        assert not lora_params(model), "adapters without --adapter"
    else:
        _eq(lora_config_of(model).rank, 2, "the adapters' rank")


def _gen_tok(seen: Seen):
    from posttrain.tokenizer import load_tokenizer

    return load_tokenizer(seen.cfg.tokenizer)


def _prompt_texts(seen: Seen) -> list[str]:
    return [_gen_tok(seen).decode(ids, skip_special_tokens=False) for ids in _call(seen)[1]]


def _check_gen_prompts(seen: Seen) -> None:
    """The prompts sampled are ``--prompt``'s and ``--prompts``'s, in the run's
    tokenizer's ids (their text reads back through it), in order."""
    texts = _prompt_texts(seen)
    expected = list(seen.cfg.prompt) + ([landing.MARKER, "b"] if seen.cfg.prompts else [])
    _eq(len(texts), len(expected), "prompts sampled")
    for text, want in zip(texts, expected, strict=True):
        assert want in text, (text, want)


def _check_gen_chat(seen: Seen) -> None:
    """``--chat``: each prompt is a user turn of the template (``--chat-template``'s
    ``user: `` layout here, ChatML by default); without it the bare text."""
    if seen.cfg.image is not None:  # a user turn of the image and the text, always
        return
    for text in _prompt_texts(seen):
        if not seen.cfg.chat:
            assert "<|im_start|>" not in text and "user: " not in text, text
        elif seen.cfg.chat_template is None:
            assert text.startswith("<|im_start|>user"), text
        else:
            assert text.startswith("user: "), text


def _check_sampling(name: str, default):
    def check(seen: Seen) -> None:
        value = getattr(seen.cfg, name)
        _eq(
            getattr(_call(seen)[2], name),
            default if value is None else value,
            f"SamplingConfig.{name}",
        )

    return check


def _check_gen_seed(seen: Seen) -> None:
    _check_sampling("seed", None)(seen)
    from posttrain.models import build_model

    fresh = build_model(_call(seen)[0].config, seed=seen.cfg.seed)
    import numpy as np
    from flax import nnx

    ours = dict(nnx.to_flat_state(nnx.state(_call(seen)[0], nnx.Param)))
    path, value = next(iter(nnx.to_flat_state(nnx.state(fresh, nnx.Param))))
    np.testing.assert_array_equal(
        landing.host(ours[path].get_value()), landing.host(value.get_value()), err_msg="init"
    )


def _check_cache_size(seen: Seen) -> None:
    _eq(_call(seen)[3]["cache_size"], seen.cfg.cache_size, "generate's cache_size")


def _check_gen_output(seen: Seen) -> None:
    """``--output``: one JSONL record per prompt written there."""
    import json

    if seen.cfg.output is None:
        return
    records = [json.loads(line) for line in pathlib.Path(seen.cfg.output).read_text().splitlines()]
    _eq(len(records), len(_call(seen)[1]), "records written")


def _check_gen_mesh(seen: Seen) -> None:
    from posttrain import sharding

    expected = sharding.parse_mesh_spec(seen.cfg.mesh) if seen.cfg.mesh else _default_mesh()
    _eq(_sized(landing.leaf_sharding_mesh(_call(seen)[0])), _sized(expected), "the model's mesh")


def _check_gen_image(seen: Seen) -> None:
    """``--image``: the picture reaches generate as the prompt's images."""
    images = _call(seen)[3].get("images")
    _eq(images is not None, seen.cfg.image is not None, "images handed to generate")


GENERATE = {
    "model": Lands("the sampled model's config", _check_gen_model),
    "adapter": Lands("the sampled model's LoRA", _check_gen_adapter),
    "tokenizer": Lands("the prompt ids", _check_gen_prompts),
    "chat_template": Lands("the prompt ids' layout", _check_gen_chat),
    "prompt": Lands("the prompt ids", _check_gen_prompts),
    "prompts": Lands("the prompt ids", _check_gen_prompts),
    "chat": Lands("the prompt ids' layout", _check_gen_chat),
    "image": Lands("generate's images", _check_gen_image),
    "max_new_tokens": Lands(
        "SamplingConfig.max_new_tokens", _check_sampling("max_new_tokens", None)
    ),
    "temperature": Lands(
        "SamplingConfig.temperature (default greedy)", _check_sampling("temperature", 0.0)
    ),
    "top_k": Lands("SamplingConfig.top_k", _check_sampling("top_k", None)),
    "top_p": Lands("SamplingConfig.top_p", _check_sampling("top_p", None)),
    "seed": Lands("SamplingConfig.seed; the preset's init", _check_gen_seed),
    "cache_size": Lands("generate's cache_size", _check_cache_size),
    "output": Lands("the JSONL file written", _check_gen_output),
    "mesh": Lands("the model's placement", _check_gen_mesh),
}

#: workflow -> (options class, its rows).


LANDINGS: dict[str, tuple[type, dict[str, Lands]]] = {
    "sft": (SFTConfig, SFT),  # and --vision
    "dpo": (DPORunConfig, DPO),  # and ORPO
    "grpo": (GRPORunConfig, GRPO),
    "distill": (DistillRunConfig, DISTILL),
    "generate": (GenerateOptions, GENERATE),
}


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One start of a workflow: the options it overrides (``"{name}"``: a file of
    :func:`tests.landing.files`) and whether the gate runs it (else the slow tier)."""

    workflow: str
    overrides: dict
    gate: bool = False
    refused: str | None = None  # the field whose row checks the run's refusal
    only: str | None = None  # the field whose row is checked (the run stops before the rest)


SMALL_SFT = {"steps": 4, "max_target_length": 64}
SCENARIOS: dict[str, Scenario] = {
    "sft-full": Scenario(
        "sft",
        {
            **SMALL_SFT,
            "model": "llama3-tiny",
            "tokenizer": "{tokenizer}",
            "chat_template": "{template}",
            "mesh": {"data": 2, "fsdp": 2, "tensor": 2},
            "per_device_batch_size": 2,
            "steps": 6,
            "learning_rate": 2e-2,
            "max_grad_norm": 0.5,
            "seed": 3,
            "save_every": 2,
            "stop_after": 5,
            "data": "{chat}",
            "data_shards": 2,
            "grad_accum": 2,
            "warmup_steps": 0,
            "remat": "full",
            "attention_kernel": "splash_interpret",  # the CLI's splash, interpreted
            "scan_layers": True,
            "max_target_length": 32,
            "packing": False,
            "sync_saves": True,
            "replica_parallel_saves": "on",
        },
    ),
    "sft-lora": Scenario(
        "sft",
        {
            **SMALL_SFT,
            "data": "{chat}",
            "max_target_length": 128,
            "lora_rank": 4,
            "lora_alpha": 3.0,
            "seed": 0,
            "warmup_steps": 2,
            "replica_parallel_saves": "off",
        },
    ),
    "sft-defaults": Scenario("sft", {}),
    # the gate's SFT start: the loading options (#59: one never reached the model), the
    # schedule with an explicit zero warm-up and its floor
    "sft-model": Scenario(
        "sft",
        {
            **SMALL_SFT,
            "remat": "full",
            "attention_kernel": "splash_interpret",  # the CLI's splash, interpreted
            "scan_layers": True,
            "warmup_steps": 0,
            "max_grad_norm": 0.0,
        },
        gate=True,
    ),
    # #39, #56: images through TrainingInput.images, the tower trained, read from --image-root
    "vision": Scenario(
        "sft",
        {
            "steps": 3,
            "vision": True,
            "data": "{vision}",
            "image_root": "{images}",
            "train_vision_tower": True,
            "max_target_length": 128,
        },
    ),
    "vision-frozen": Scenario(
        "sft",
        {
            "steps": 3,
            "vision": True,
            "data": "{vision}",
            "image_root": "{images}",
            "max_target_length": 128,
            "lora_rank": 2,
        },
    ),
    "vision-confined": Scenario(
        "sft", {"vision": True, "data": "{vision}"}, refused="image_root"
    ),  # the images are outside the data's directory: refused without --image-root
    "sft-reject": Scenario("sft", {**SMALL_SFT, "overflow": "reject"}, refused="overflow"),
}

SMALL_DPO = {"steps": 3, "max_prompt_length": 16, "max_response_length": 16}
SCENARIOS.update(
    {
        "dpo-full": Scenario(
            "dpo",
            {
                "model": "llama3-tiny",
                "tokenizer": "{tokenizer}",
                "chat_template": "{template}",
                "mesh": {"data": 2, "fsdp": 2, "tensor": 2},
                "per_device_batch_size": 2,
                "steps": 6,
                "learning_rate": 2e-2,
                "max_grad_norm": 0.5,
                "seed": 3,
                "save_every": 2,
                "stop_after": 5,
                "data": "{pairs}",
                "data_shards": 2,
                "grad_accum": 2,
                "warmup_steps": 0,
                "remat": "full",
                "attention_kernel": "splash_interpret",  # the CLI's splash, interpreted
                "scan_layers": True,
                "max_prompt_length": 32,
                "max_response_length": 8,
                "beta": 0.5,
                "label_smoothing": 0.2,
            },
        ),
        "orpo": Scenario(
            "dpo",
            {
                **SMALL_DPO,
                "algorithm": "orpo",
                "lambda_orpo": 0.3,
                "max_grad_norm": 0.0,
                "label_smoothing": 0.0,
                "lora_rank": 4,
                "lora_alpha": 3.0,
                "data": "{pairs}",
            },
        ),
        "dpo-defaults": Scenario("dpo", {}),
        # the gate's DPO start: the loss's hyperparameters (#59: an explicit zero dropped,
        # a smoothing never passed)
        "dpo-loss": Scenario(
            "dpo", {**SMALL_DPO, "beta": 0.5, "label_smoothing": 0.2, "data": "{pairs}"}, gate=True
        ),
        # the evaluation before training compiles a forward (seconds): the slow tier
        "dpo-eval": Scenario("dpo", {**SMALL_DPO, "data": "{pairs}", "eval_data": "{held}"}),
        "dpo-reject": Scenario(
            "dpo", {**SMALL_DPO, "max_prompt_length": 4, "overflow": "reject"}, refused="overflow"
        ),
    }
)

SMALL_GRPO = {
    "steps": 2,
    "warmup_steps": 0,
    "per_device_batch_size": 1,
    "num_generations": 2,
    "max_new_tokens": 3,
    "eval_samples": 0,
}
SCENARIOS.update(
    {
        "grpo-full": Scenario(
            "grpo",
            {
                **SMALL_GRPO,
                "model": "llama3-tiny",
                "tokenizer": "{tokenizer}",
                "chat_template": "{template}",
                "mesh": {"data": 2, "fsdp": 2, "tensor": 2},
                "rollout_mesh": {"data": 8},
                "rollout_dtype": "bfloat16",
                "per_device_batch_size": 2,
                "num_generations": 3,
                "steps": 6,
                "grad_accum": 2,
                "learning_rate": 2e-3,
                "max_grad_norm": 0.5,
                "algorithm": "drgrpo",
                "beta": 0.0,  # an explicit zero: no KL term, not the algorithm's default
                "epsilon": 0.3,
                "temperature": 0.7,
                "max_prompt_length": 40,
                "max_new_tokens": 4,
                "reward": ("exact_answer",),
                "seed": 3,
                "save_every": 4,
                "stop_after": 5,
            },
            gate=True,
        ),
        "dapo-lora": Scenario(
            "grpo", {**SMALL_GRPO, "algorithm": "dapo", "lora_rank": 4, "lora_alpha": 3.0}
        ),
        # stops at the evaluation before training (our generate's first call)
        "grpo-eval": Scenario("grpo", {**SMALL_GRPO, "eval_samples": 3}, only="eval_samples"),
        # the warm-up SFT trains (seconds): the slow tier. GRPO's optimizer options differ
        # from the warm-up's own recipe (_check_warmup)
        "grpo-warmup": Scenario(
            "grpo",
            {
                **SMALL_GRPO,
                "warmup_steps": 1,
                "warmup_data_shards": 2,
                "learning_rate": 1e-3,
                "max_grad_norm": 0.25,
                "lora_rank": 2,
            },
        ),
    }
)

SCENARIOS.update(
    {
        "distill-full": Scenario(
            "distill",
            {
                "model": "llama3-tiny",
                "teacher": "llama3-tiny",
                "student_layers": 0,  # an explicit zero: every layer of the preset
                "temperature": 2.0,
                "alpha": 0.0,  # an explicit zero: the task loss alone
                "distill_top_k": 5,
                "teacher_dtype": "bfloat16",
                "tokenizer": "{tokenizer}",
                "chat_template": "{template}",
                "mesh": {"data": 2, "fsdp": 2, "tensor": 2},
                "per_device_batch_size": 2,
                "steps": 6,
                "learning_rate": 2e-2,
                "max_grad_norm": 0.5,
                "seed": 3,
                "save_every": 2,
                "stop_after": 5,
                "data": "{chat}",
                "data_shards": 2,
                "grad_accum": 2,
                "warmup_steps": 0,
                "remat": "full",
                "attention_kernel": "splash_interpret",  # the CLI's splash, interpreted
                "scan_layers": True,
                "max_target_length": 32,
                "packing": False,
                "sync_saves": True,
                "replica_parallel_saves": "on",
            },
        ),
        "distill-features": Scenario(
            "distill",
            {
                "steps": 3,
                "max_target_length": 64,
                "teacher": "qwen3-tiny",
                "student_layers": 2,
                "strategy": "feature-pooling",
                "alpha": 0.3,
                "max_grad_norm": 0.0,
                "lora_rank": 4,
                "lora_alpha": 3.0,
                "replica_parallel_saves": "off",
            },
        ),
        "distill-reject": Scenario(
            "distill",
            {"teacher": "qwen3-tiny", "max_target_length": 64, "overflow": "reject"},
            refused="overflow",
        ),
        # the teacher trained on the fly (seconds): the slow tier
        "distill-teacher": Scenario(
            "distill", {"steps": 3, "max_target_length": 64, "teacher_steps": 2}
        ),
    }
)

SCENARIOS.update(
    {
        "generate": Scenario(
            "generate",
            {
                "model": "llama3-tiny",
                "adapter": "{adapter}",
                "tokenizer": "{tokenizer}",
                "chat_template": "{template}",
                "prompt": ("2+2?",),
                "prompts": "{prompts}",
                "chat": True,
                "max_new_tokens": 3,
                "temperature": 0.0,
                "top_k": 1,
                "top_p": 0.5,
                "seed": 3,
                "cache_size": 64,
                "mesh": "data=2,fsdp=2,tensor=2",
            },
        ),
        "generate-sampled": Scenario(
            "generate",
            {
                "model": "qwen3-tiny",
                "prompt": ("a", "b"),
                "temperature": 0.7,
                "top_k": 5,
                "max_new_tokens": 2,
                "output": "{out}",
            },
        ),
        "generate-image": Scenario(
            "generate",
            {"model": "gemma4-vision-tiny", "image": "{picture}", "prompt": ("what?",)},
        ),
    }
)


# --- the tests ----------------------------------------------------------------------


def test_every_generated_field_has_a_reviewed_landing():
    """Each subcommand's generated fields are exactly its rows here (or of
    :data:`ELSEWHERE`): a field added without its landing fails, named."""
    for command in cli.COMMANDS:
        workflow = {c: w for w, (c, _) in LANDINGS.items()}.get(command.options)
        rows = LANDINGS[workflow][1] if workflow else ELSEWHERE.get(command.name, {})
        fields = {f.name for f, _ in flags._fields(command.options)}
        missing = sorted(fields - set(rows))
        assert not missing, f"posttrain {command.name}: no landing row for {missing}"
        assert not set(rows) - fields, f"posttrain {command.name}: rows of no field"


def _referred(test: str, *names: str) -> dict[str, str]:
    return {name: test for name in names}


#: Subcommands that are not training or sampling workflows: each field names the test
#: that drives it through the command (not a per-field landing check here; #59 asks it
#: of the workflows). A field added to them without a row still fails.
ELSEWHERE: dict[str, dict[str, str]] = {
    "forward": _referred(
        "tests/test_launch.py::test_a_forward_on_two_processes_equals_one_process_of_eight_devices",
        "model",
        "mesh",
        "per_device_batch_size",
        "seq",
        "scan",
        "remat",
        "repeats",
        "seed",
    ),
    "convert": _referred(
        "tests/test_conversion_roundtrip.py::test_hf_native_hf_is_bit_exact",
        "source_format",
        "target_format",
        "src",
        "dst",
        "scan",
        "vision",
        "layout",
        "prefix",
        "max_shard_size",
        "no_fsync",
    ),
    "check-logits": _referred(
        "tests/test_conversion_parity.py::test_converted_logits_match_transformers",
        "hf_dir",
        "native_dir",
        "max_kl",
        "atol",
        "seq",
        "seed",
    ),
    "plan": _referred(
        "tests/test_plan.py::test_the_record_carries_the_options_and_the_figures",
        "model",
        "topology",
        "mesh",
        "rollout_mesh",
        "workflow",
        "lora_rank",
        "qlora",
        "remat",
        "per_device_batch_size",
        "batch",
        "seq",
        "new_tokens",
        "grad_accum",
        "num_iterations",
        "optimizer",
        "dtype",
        "param_dtype",
        "scan_layers",
        "num_layers",
        "extrapolate",
        "json_path",
        "run_steps",
    )
    | _referred(
        "tests/test_plan_search.py::test_a_policy_stops_at_its_first_batch_that_does_not_fit",
        "search",
        "search_max_batch",
    )
    | _referred(
        "tests/test_plan.py::test_a_splash_plan_compiles_the_mosaic_kernel_for_a_v5e_deviceless",
        "attention_kernel",
    )
    | _referred(
        "tests/test_plan_profile.py::test_the_profile_option_lands_in_the_run_of_the_planned_program",
        "profile_dir",
        "probe_headroom",
    ),
}


def test_the_referred_tests_exist():
    """Each test :data:`ELSEWHERE` names is defined where it says."""
    root = pathlib.Path(__file__).resolve().parent.parent
    for rows in ELSEWHERE.values():
        for ref in set(rows.values()):
            path, name = ref.split("::")
            assert f"def {name}(" in (root / path).read_text(), ref


def _zero_accepted(cls, name: str, zero) -> bool:
    """Whether the options accept ``zero`` for ``name`` (the others at their defaults)."""
    options = cls(**{name: zero})
    try:
        options.check_fields() if hasattr(options, "check_fields") else options.check()
    except (ValueError, TypeError):
        return False
    return True


@pytest.mark.parametrize("workflow", sorted(LANDINGS))
def test_the_scenarios_drive_every_field_off_its_default_and_to_zero(workflow, tmp_path):
    """Every field of the workflow is given a value other than its default by some
    scenario, and an explicit zero (``0``, ``0.0``, ``False``) where its options accept
    one (a truthiness filter drops exactly those)."""
    cls, _ = LANDINGS[workflow]
    scenarios = [s for s in SCENARIOS.values() if LANDINGS[s.workflow][0] is cls]
    where = collections.defaultdict(lambda: "a/file")  # file names only: none is read
    given = [landing.resolve(_overrides(s), where, tmp_path / "run") for s in scenarios]
    for field, hint in flags._fields(cls):
        name, default = field.name, field.default
        values = [g[name] for g in given if name in g]
        assert any(v != default for v in values), f"{workflow}: no scenario changes {name}"
        zero = {int: 0, float: 0.0, bool: False}.get(hint)
        if zero is None or zero == default or not _zero_accepted(cls, name, zero):
            continue
        assert any(type(v) is hint and v == zero for v in values), (
            f"{workflow}: no scenario gives {name} the explicit zero {zero!r}"
        )


def _overrides(s: Scenario) -> dict:
    """The scenario's options; each start writes to a fresh ``output``."""
    return {"output": "{run}", **s.overrides}


def _devices_needed(s: Scenario) -> int:
    """The devices the scenario's explicit meshes take (1 when it gives none), and those
    whose rows a global batch needs to divide into its data shards."""
    from posttrain import sharding

    needed = 1
    for key in ("mesh", "rollout_mesh"):
        mesh = s.overrides.get(key)
        if isinstance(mesh, str):
            mesh = sharding.parse_mesh_spec(mesh)
        if mesh:
            needed = max(needed, math.prod(mesh.values()))
    rows = s.overrides.get("per_device_batch_size") or 1  # the global batch splits in shards
    for key in ("data_shards", "warmup_data_shards"):
        needed = max(needed, -(-(s.overrides.get(key) or 1) // rows))
    return needed


def _params():
    params = []
    for name, s in SCENARIOS.items():
        marks = [pytest.mark.devices(_devices_needed(s))]
        if not s.gate:
            marks.append(pytest.mark.slow)
        params.append(pytest.param(name, marks=marks, id=name))
    return params


@pytest.mark.parametrize("scenario", _params())
@pytest.mark.wiring
def test_each_option_lands_where_it_acts(scenario, tmp_path, monkeypatch):
    """Every row of the scenario's workflow holds on what the run built: the value of
    each field reached its object."""
    s = SCENARIOS[scenario]
    cls, rows = LANDINGS[s.workflow]
    where = landing.files(tmp_path / "files")
    cfg = cls(**landing.resolve(_overrides(s), where, tmp_path / "run"))
    seen = landing.capture(s.workflow, cfg, monkeypatch)
    if s.refused:
        assert seen.error, "the run started"
        names = [s.refused]
    elif s.only:
        assert seen.error is None, seen.error
        names = [s.only]
    else:
        assert seen.error is None, seen.error
        names = list(rows)
    failed = []
    for name in names:
        try:
            rows[name].check(seen)
        except Exception as error:  # noqa: BLE001 - every row is reported, by name
            text = next((line for line in str(error).splitlines() if line.strip()), "")
            failed.append(f"{name} ({rows[name].where}): {type(error).__name__}: {text}")
    assert not failed, "options that did not land:\n" + "\n".join(failed)
