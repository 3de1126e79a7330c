"""One distillation run end to end, a supervised run (``posttrain.training.supervised``):
the same data, rows, checkpoints, record, metrics and export, with
:class:`~posttrain.distill.trainer.DistillTrainerMixin` over Tunix's
``DistillationTrainer`` as its trainer.

Output directory (``DistillRunConfig.output``): a supervised run's, as ``posttrain sft``'s,
plus::

    data/train.jsonl      the conversations trained on (7 in 8)
    data/held_out.jsonl   the others: the held-out KL to the teacher is measured on them
    student-init/         a preset student cut to ``student_layers`` layers (native)
    teacher/              the teacher's SFT run, when it is trained on the fly

Across processes (``posttrain-harness launch``): process 0 writes the data split and the
student's start, the others wait for it; the teacher and the student are sharded on the
one mesh, each process tokenises its share of the training data (SFT's data shards) and
all of the held-out set (the KL's batch is replicated).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib

from posttrain import distributed, limits, sharding
from posttrain.conversion.native import NativeMeta, is_native_dir, save_native
from posttrain.distill import features, tunix_distill
from posttrain.distill import trainer as distill_trainer
from posttrain.distill.options import SFT_EXPORT, DistillRunConfig
from posttrain.distill.trainer import (
    cast_params,
    distill_trainer_class,
    labels_fn,
    model_logits,
    shallower,
)
from posttrain.loading import load_model
from posttrain.models import PRESETS, build_model, get_config
from posttrain.models.params import flat_params
from posttrain.training import data
from posttrain.training.default_data import pydoc_conversations
from posttrain.training.formats import run_tokenizer_and_formats
from posttrain.training.options import SupervisedRunOptions
from posttrain.training.supervised import build_rows, run_supervised

__all__ = ["DistillResult", "check_student", "run_distill"]

#: the on-the-fly teacher's preset (another family than the default student's)
TEACHER_PRESET = "llama3-tiny"


@dataclasses.dataclass
class DistillResult:
    """The supervised run's result (``posttrain.training.supervised.SFTResult``), the
    teacher used and
    the held-out KL(teacher || student) per target token before and after training."""

    sft: object
    teacher: str
    kl_before: float
    kl_after: float

    def __getattr__(self, name):
        return getattr(self.sft, name)

    def summary(self) -> str:
        return (
            f"{self.sft.summary()}; held-out KL to the teacher {self.kl_before:.4f} -> "
            f"{self.kl_after:.4f}"
        )


def run_distill(
    cfg: DistillRunConfig, *, log_every: int | None = None, on_built=None
) -> DistillResult:
    """Runs (or resumes) one distillation run; see the module docstring.

    Args:
      cfg: the run.
      log_every: print a line every this many steps (None: quiet).
      on_built: called with the trainer before training (tests).

    Raises:
      ValueError: a bad option, a strategy or ``distill_top_k`` the release lacks, a
        teacher whose vocabulary is not the student's (one line each).
    """
    cfg.check()
    tunix_distill.check_strategy(cfg.strategy, cfg.distill_top_k)
    mesh = sharding.make_mesh(cfg.mesh)
    out = pathlib.Path(cfg.output)
    # both models' configs are checked before anything is read or written
    check_student(cfg, _teacher_config(cfg))
    teacher = None
    if cfg.teacher is not None:
        teacher, _ = load_model(cfg.teacher, mesh, seed=cfg.seed + 1, scratch=cfg.output)
    train_path, held_path = _split_data(cfg, out / "data")
    teacher_spec = cfg.teacher or _default_teacher(cfg, out, train_path)
    run_cfg = dataclasses.replace(
        cfg, data=str(train_path), model=_student(cfg, out / "student-init")
    )
    if teacher is None:
        teacher, _ = load_model(teacher_spec, mesh, seed=cfg.seed + 1, scratch=cfg.output)
    cast_params(teacher, cfg.teacher_dtype)  # once; frozen, on the student's mesh
    tok, formats = run_tokenizer_and_formats(run_cfg)  # the held-out rows in the run's template
    held_cfg = dataclasses.replace(run_cfg, data=str(held_path), packing=True)
    held_out = build_rows(held_cfg, tok, template=formats.template)
    strategy = _strategy(cfg, labels_fn(teacher.config.vocab_size))
    built = {}

    def trainer(model, tx, training_config, options):
        cls = distill_trainer_class()
        return cls(model, teacher, strategy, tx, training_config, options=options)

    def measured(t):
        built["before"] = distill_trainer.held_out_kl(t.model, teacher, held_out, mesh)
        built["trainer"] = t
        if on_built is not None:
            on_built(t)

    result = run_supervised(run_cfg, trainer_class=trainer, on_built=measured, log_every=log_every)
    after = distill_trainer.held_out_kl(built["trainer"].model, teacher, held_out, mesh)
    return DistillResult(result, teacher_spec, built["before"], after)


def _teacher_config(cfg: DistillRunConfig):
    """The teacher's ``ModelConfig`` from its files (no weight read), the on-the-fly
    teacher's without ``--teacher``; a missing or unreadable one names ``--teacher``."""
    if cfg.teacher is None:
        return _default_teacher_config()
    return limits.checkpoint_config(cfg.teacher, "--teacher")[0]


def check_student(cfg: DistillRunConfig, teacher_config) -> None:
    """Raises ValueError (one line) when the student is missing or unreadable, its
    ``vocab_size`` is not the teacher's, ``--distill-top-k`` is past the teacher's
    vocabulary, or ``--strategy`` cannot read the two models
    (:func:`posttrain.distill.features.check_models`; an HF student's layers are checked
    when the trainer is built)."""
    if cfg.distill_top_k > teacher_config.vocab_size:
        raise ValueError(
            f"distill_top_k={cfg.distill_top_k} (--distill-top-k): expected at most the "
            f"teacher's vocab_size {teacher_config.vocab_size}"
        )
    student = _student_config(cfg)
    vocab = (student or limits.checkpoint_config(cfg.model)[0]).vocab_size
    if vocab != teacher_config.vocab_size:
        raise ValueError(
            f"--teacher {cfg.teacher!r} has vocab_size {teacher_config.vocab_size} but the "
            f"student {cfg.model!r} has {vocab}: distillation needs the same vocabulary"
        )
    if student is not None:
        features.check_models(cfg.strategy, student, teacher_config)


def _student_config(cfg: DistillRunConfig):
    """The student's ``ModelConfig`` as the run will build it (a preset cut to
    ``student_layers``, a native directory's, ``--scan`` applied), None for an HF one."""
    if cfg.model in PRESETS:
        config = get_config(cfg.model)
        if cfg.student_layers:
            config = shallower(config, cfg.student_layers)
    elif is_native_dir(cfg.model):
        config = NativeMeta.read(cfg.model).cfg
    else:
        return None
    return config.replace(scan_layers=config.scan_layers or cfg.scan_layers)


def _strategy(cfg: DistillRunConfig, labels):
    """Tunix's strategy for ``cfg.strategy`` (both forwards :func:`model_logits`)."""
    if cfg.strategy == "logit":
        return tunix_distill.logit_strategy(
            model_logits,
            model_logits,
            labels,
            temperature=cfg.temperature,
            alpha=cfg.alpha,
            distill_top_k=cfg.distill_top_k,
        )
    return features.feature_strategy(
        cfg.strategy, model_logits, model_logits, labels, alpha=cfg.alpha, seed=cfg.seed + 2
    )


def _split_data(cfg: DistillRunConfig, where: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """``(train, held-out)`` chat JSONL files of ``cfg.data`` (or the embedded set): every
    8th conversation held out. Written by process 0 only when absent (a resumed run keeps
    them); every process returns once they are there."""
    train, held = where / "train.jsonl", where / "held_out.jsonl"
    distributed.on_writer(lambda: _write_split(cfg, train, held), "write the data split")
    return train, held


def _write_split(cfg: DistillRunConfig, train: pathlib.Path, held: pathlib.Path) -> None:
    if train.exists() and held.exists():
        return
    conversations = data.read_chat_jsonl(cfg.data) if cfg.data else pydoc_conversations()
    if len(conversations) < 8:
        raise ValueError(
            f"data {cfg.data!r}: {len(conversations)} conversations; expected >= 8 "
            "(1 in 8 is held out)"
        )
    train.parent.mkdir(parents=True, exist_ok=True)
    for path, part in ((held, conversations[7::8]), (train, _without_every_8th(conversations))):
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps({"messages": c}) + "\n" for c in part))
        os.replace(tmp, path)


def _without_every_8th(items: list) -> list:
    return [c for i, c in enumerate(items) if i % 8 != 7]


def _student(cfg: DistillRunConfig, where: pathlib.Path) -> str:
    """The student's model spec: a preset cut to ``student_layers`` layers is written once
    as a native directory (seed ``cfg.seed``; by process 0); anything else is
    ``cfg.model``."""
    if cfg.model not in PRESETS or cfg.student_layers in (0, get_config(cfg.model).num_layers):
        return cfg.model
    distributed.on_writer(lambda: _write_student(cfg, where), "write the student's start")
    return str(where)


def _write_student(cfg: DistillRunConfig, where: pathlib.Path) -> None:
    if not where.exists():
        config = shallower(get_config(cfg.model), cfg.student_layers)
        save_native(flat_params(build_model(config, seed=cfg.seed)), config, where)


def _default_teacher_config():
    """The config of the default teacher (:func:`_default_teacher`), before it exists."""
    return (
        NativeMeta.read(SFT_EXPORT).cfg if os.path.isdir(SFT_EXPORT) else get_config(TEACHER_PRESET)
    )


def _default_teacher(cfg: DistillRunConfig, out: pathlib.Path, train: pathlib.Path) -> str:
    """:data:`SFT_EXPORT` if present, else :data:`TEACHER_PRESET` trained by a short SFT
    run on the training split (``out/teacher``), reused by a rerun."""
    if os.path.isdir(SFT_EXPORT):
        return SFT_EXPORT

    teacher_out = out / "teacher"
    export = teacher_out / f"model-step{cfg.teacher_steps}"
    if not export.is_dir():
        run_supervised(
            SupervisedRunOptions(
                model=TEACHER_PRESET,
                data=str(train),
                chat_template=cfg.chat_template,
                mesh=cfg.mesh,
                steps=cfg.teacher_steps,
                max_target_length=cfg.max_target_length,
                seed=cfg.seed,
                output=str(teacher_out),
            )
        )
    return str(export)
