"""``DistillTrainer``: Tunix's ``DistillationTrainer`` with our train step in front.

Tunix's trainer subclasses ``PeftTrainer``; ours puts
:class:`~posttrain.training.trainer.SFTTrainerMixin`'s step in front of it (every step
convention, exact gradient accumulation, finiteness checks, checkpoints with the
optimizer state, one record per optimizer step) and replaces only what it must:

- The teacher runs where Tunix runs it, in ``_prepare_inputs``, through the strategy's
  own ``get_teacher_outputs`` (its ``nnx.jit`` of the teacher forward and
  ``jax.lax.stop_gradient``); our ``_prepare_inputs`` keeps every batch field (Tunix's
  rebuilds a ``TrainingInput`` of tokens and mask only) and places the rows on the
  data-parallel axes first, so the teacher runs sharded on the student's mesh.
- The objective is the strategy's own ``compute_loss`` per target position, summed over
  completion tokens and divided by the step's target-token count
  (:mod:`posttrain.distill.loss`): prompt and padding stay out (Tunix's strategy means
  over every position), and the micro-steps' objectives average to one large batch's
  loss (:func:`posttrain.training.loss.step_objective`).
- The student's MoE load-balancing term enters the objective as in SFT (weight: the
  student config's ``moe.aux_loss_weight``); the teacher's forward returns logits only,
  so its term never does.
- Eval (no eval set by default) is the student's task loss, as Tunix's eval is.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from posttrain.distill import features, tunix_distill
from posttrain.distill import loss as distill_loss
from posttrain.distributed import host_array
from posttrain.training import loss as sft_loss
from posttrain.training.metrics import StepMetrics
from posttrain.training.trainer import SFTOptions, SFTTrainerMixin

__all__ = [
    "DistillMetrics",
    "DistillTrainerMixin",
    "cast_params",
    "check_vocabularies",
    "distill_trainer_class",
    "held_out_kl",
    "labels_fn",
    "model_logits",
    "shallower",
]

#: the batch fields the teacher forward reads
TEACHER_FIELDS = ("input_tokens", "positions", "segment_ids")


def model_logits(model, input_tokens, positions=None, segment_ids=None, **_):
    """``[batch, seq, vocab]`` logits of a :class:`posttrain.models.CausalLM` on a packed
    batch (Tunix's ``ModelForwardCallable``); its auxiliary outputs are dropped."""
    if segment_ids is None:
        segment_ids = jnp.ones_like(input_tokens)
    logits, _ = model.forward(input_tokens, positions, sft_loss.packed_attention_mask(segment_ids))
    return logits


def labels_fn(vocab_size: int):
    """Tunix's ``labels_fn``: ``[batch, seq-1, vocab]`` one-hot ``input_tokens[:, 1:]``
    (Tunix's ``get_train_loss`` would use it; our step builds the same labels per
    position in :mod:`posttrain.distill.loss`)."""

    def labels(input_tokens, **_):
        return jax.nn.one_hot(input_tokens[:, 1:], vocab_size, dtype=jnp.float32)

    return labels


class DistillMetrics(StepMetrics):
    """One record per optimizer step (``metrics.jsonl``):

    ===================  ================================================================
    ``step``             optimizer step, from 1
    ``loss``             the distillation objective per target token (without MoE term)
    ``kl``               KL(teacher || student) at temperature 1 per target token
                         (logit strategy; ``null`` for the feature strategies)
    ``task_loss``        the student's cross-entropy per target token
    ``perplexity``       ``exp(task_loss)``
    ``grad_norm``        global norm of the applied (accumulated) gradient
    ``moe_aux_loss``     the student's load-balancing loss (unweighted; 0 if dense)
    ``target_tokens``    target tokens in the step
    ``tokens``           non-padding tokens through the student
    ===================  ================================================================
    """

    keys = (
        "distill_sum",
        "nll_sum",
        "kl_sum",
        "target_tokens",
        "moe_aux_loss",
        "grad_norm",
        "tokens",
    )

    def summarise(self, micro: list[dict]) -> dict:
        targets = max(float(sum(m["target_tokens"] for m in micro)), 1.0)

        def per_token(key):
            return float(sum(m[key] for m in micro)) / targets

        return {
            "loss": per_token("distill_sum"),
            # the feature strategies' teacher output is features: no KL in the step
            "kl": per_token("kl_sum") if "kl_sum" in micro[0] else None,
            "task_loss": per_token("nll_sum"),
            "perplexity": math.exp(min(per_token("nll_sum"), 80.0)),
            "grad_norm": float(micro[-1]["grad_norm"]),
            "moe_aux_loss": float(np.mean([m["moe_aux_loss"] for m in micro])),
            "target_tokens": int(targets),
            "tokens": int(sum(m["tokens"] for m in micro)),
        }

    def line(self, record: dict) -> str:
        kl = "" if record["kl"] is None else f", kl {record['kl']:.4f}"
        return (
            f"loss {record['loss']:.4f}{kl}, task {record['task_loss']:.4f}, "
            f"grad_norm {record['grad_norm']:.3f}"
        )


class DistillTrainerMixin(SFTTrainerMixin):
    """The distillation step; mix in front of Tunix's ``DistillationTrainer``.

    Args:
      model: the student (a :class:`posttrain.models.CausalLM`, LoRA or not).
      teacher: the teacher, frozen (never in the optimizer; its logits are constants).
      strategy: a Tunix strategy with :func:`model_logits` as both forwards
        (:func:`posttrain.distill.tunix_distill.logit_strategy`, or a feature strategy of
        :func:`posttrain.distill.features.feature_strategy`, which also reads the
        student's taps in the step).
      optimizer, training_config: Tunix's (``training_config`` of
        :func:`posttrain.distill.tunix_distill.config_class`).
      options: :class:`~posttrain.training.trainer.SFTOptions` (keyword-only).

    Raises:
      ValueError: the student's and teacher's vocabularies differ, or a feature strategy
        cannot read the two models (:func:`posttrain.distill.features.check_models`).
      posttrain.training.tunix_compat.UnknownConventionError: an unknown step convention.
    """

    reported_sum = "distill_sum"  # the reported loss: the distillation objective's mean

    metrics_class = DistillMetrics

    def __init__(
        self, model, teacher, strategy, optimizer, training_config, *, options: SFTOptions
    ):
        check_vocabularies(model, teacher)
        features.check_models(features.strategy_name(strategy), model.config, teacher.config)
        self._teacher, self._strategy = teacher, strategy
        self._reads_features = features.strategy_name(strategy) in features.TAPS
        distill_loss.check_strategy(strategy)
        super().__init__(model, optimizer, training_config, options=options)
        self.gen_model_input_fn = lambda x: x  # our batches are dicts of every field

    def _init_tunix(self, model, optimizer, training_config, *args, **kwargs):
        super(SFTTrainerMixin, self).__init__(
            model, self._teacher, self._strategy, optimizer, training_config, *args, **kwargs
        )

    def _objective(self, model, inputs):
        segment_ids = inputs.get("segment_ids")
        if segment_ids is None:
            segment_ids = jnp.ones_like(inputs["input_tokens"])
        if self._reads_features:
            nnx.pop(model, nnx.Intermediate)  # none left from another forward (eval)
        logits, aux = model.forward(
            inputs["input_tokens"],
            inputs.get("positions"),
            sft_loss.packed_attention_mask(segment_ids),
        )
        student = (
            {"logits": logits, "features": features.student_features(model)}
            if self._reads_features
            else logits
        )
        terms = distill_loss.distill_terms(
            self.strategy,
            student,
            inputs["teacher_output"],
            inputs["input_tokens"],
            inputs["input_mask"],
            segment_ids,
        )
        terms["moe_aux_loss"] = jnp.asarray(aux["moe_aux_loss"], jnp.float32)
        objective = sft_loss.step_objective(
            {**terms, "nll_sum": terms["distill_sum"]},
            inputs.get("step_target_tokens"),
            moe_aux_weight=self.moe_aux_loss_weight,
            grad_accum_steps=self.grad_accum_steps,
        )
        return objective, terms

    def _prepare_inputs(self, input_data):
        """Every batch field placed on the data-parallel axes, plus ``teacher_output``
        (``[batch, seq, vocab]``, the strategy's ``get_teacher_outputs``) in training."""
        from tunix.sft import metrics_logger

        placed = {k: self._place_rows(v) for k, v in dict(input_data).items()}
        if self._mode != metrics_logger.Mode.EVAL:
            fields = {k: placed[k] for k in TEACHER_FIELDS if k in placed}
            placed["teacher_output"] = self.strategy.get_teacher_outputs(self.teacher_model, fields)
        return placed


def check_vocabularies(student, teacher) -> None:
    """Raises ValueError (one line) unless both models have the same ``vocab_size``."""
    s, t = student.config.vocab_size, teacher.config.vocab_size
    if s != t:
        raise ValueError(
            f"student vocab_size {s} and teacher vocab_size {t}: distillation needs the "
            "same vocabulary (the same tokenizer)"
        )


def distill_trainer_class(base: type | None = None) -> type:
    """``DistillTrainerMixin`` over ``base`` (default: the installed Tunix
    ``DistillationTrainer``)."""
    base = base or tunix_distill.trainer_class()
    return type(f"DistillTrainer[{base.__name__}]", (DistillTrainerMixin, base), {})


def shallower(config, num_layers: int):
    """``config`` with its first ``num_layers`` layers (the embedded run's student: the
    tiny preset one layer deep).

    Raises:
      ValueError: ``num_layers`` is not in 1..``config.num_layers``.
    """
    if not 1 <= num_layers <= config.num_layers:
        raise ValueError(f"num_layers {num_layers}: expected 1..{config.num_layers}")
    return dataclasses.replace(
        config, num_layers=num_layers, layer_types=config.layer_types[:num_layers]
    )


def cast_params(model, dtype: str):
    """Casts every ``nnx.Param`` of ``model`` to ``dtype`` in place, each keeping its
    sharding (``--teacher-dtype``: the teacher, once after loading). The modules keep
    their compute dtype, so a ``float32`` model with ``bfloat16`` parameters upcasts each
    weight in its matmuls (rounding: relative error <= 2^-8 per weight, round to nearest).

    Returns the same model for chaining.
    """
    target = jnp.dtype(dtype)
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda x: x.astype(target), state))
    return model


def held_out_kl(student, teacher, batch: dict, mesh=None) -> float:
    """Mean ``KL(teacher || student)`` at temperature 1 over the target tokens of
    ``batch`` (``[batch, seq]`` host arrays, the same in every process; fields of
    :mod:`posttrain.training.loss`): the figure ``posttrain distill`` reports falling.
    ``mesh``: the models' mesh, on which the batch is placed replicated (needed when it
    spans processes)."""

    @nnx.jit
    def kl(student, teacher, tokens, mask, positions, segments):
        s = model_logits(student, tokens, positions, segments)
        t = model_logits(teacher, tokens, positions, segments)
        targets = sft_loss.target_mask(mask, segments).astype(jnp.float32)
        per_token = distill_loss.kl_to_teacher(s[:, :-1], t[:, :-1])
        return jnp.sum(targets * per_token) / jnp.maximum(jnp.sum(targets), 1.0)

    fields = dict(batch)
    if fields.get("segment_ids") is None:
        fields["segment_ids"] = np.ones_like(fields["input_tokens"])
    if mesh is not None:
        fields = {k: _replicated(v, mesh) for k, v in fields.items() if v is not None}
    value = kl(
        student,
        teacher,
        fields["input_tokens"],
        fields["input_mask"],
        fields.get("positions"),
        fields["segment_ids"],
    )
    for model in (student, teacher):  # what wrapped taps sowed here is no strategy's
        nnx.pop(model, nnx.Intermediate)
    return float(host_array(value))


def _replicated(host, mesh):
    """``host`` (the same NumPy array in every process) as a global array replicated over
    ``mesh`` (each process fills its own devices)."""
    host = np.asarray(host)
    sharding = NamedSharding(mesh, PartitionSpec())
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
