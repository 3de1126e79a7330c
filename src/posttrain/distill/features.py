"""The feature and attention strategies: Tunix's own classes on our model's taps.

Tunix's ``FeaturePoolingStrategy``, ``AttentionTransferStrategy`` (a feature-pooling
strategy over an attention layer type) and ``FeatureProjectionStrategy``
(``tunix.distillation.strategies``; the same in google-tunix 0.1.5, 0.1.7 and main)
capture intermediate outputs by module type: ``pre_process_models`` wraps every
submodule of that type in a ``SowedModule``, and the features are what those sowed in a
forward, popped and stacked in model order (``jnp.stack(jax.tree.leaves(...))``):
``[layers, batch, seq, d_model]``. The type each ``--strategy`` wraps is one of our
identity taps (:mod:`posttrain.models.taps`), one per decoder layer:

=======================  ==================  =====================================
``--strategy``           tap                 feature loss (Tunix's default)
=======================  ==================  =====================================
``feature-pooling``      ``LayerOutput``     cosine distance over d_model to the
                                             teacher's features average-pooled to
                                             the student's ``[layers, d_model]``
``attention-transfer``   ``AttentionOutput`` the same, on the attention outputs
``feature-projection``   ``LayerOutput``     mean squared error to the teacher's
                                             features after a trained projection
=======================  ==================  =====================================

Each strategy's loss is ``alpha * feature_loss + (1 - alpha) * CE(student logits,
labels)`` (Tunix's ``compute_loss``), taken per target position by
:mod:`posttrain.distill.loss`.

Tunix's own projection (``ModelWithFeatureProjection``) maps the whole stacked feature
array, batch and sequence axes included: ``[L_s, B, T, D_s] -> [L_t, B, T, D_t]``, a
``L_s B T D_s x L_t B T D_t`` kernel fixed to one batch shape (8.6e9 weights for 8 rows of
128 tokens at d_model 64). :class:`FeatureProjection` is per token, ``[L_s, D_s] -> [L_t,
D_t]``, and lives beside the student in :class:`ProjectedStudent` (what the trainer
trains; Tunix's ``close()`` hands back the bare student through ``post_process_models``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from posttrain import sharding
from posttrain.distill import tunix_distill
from posttrain.models.taps import AttentionOutput, LayerOutput

#: the tap each feature strategy wraps
TAPS = {
    "feature-pooling": LayerOutput,
    "feature-projection": LayerOutput,
    "attention-transfer": AttentionOutput,
}
#: strategies whose teacher features are average-pooled to the student's shape
POOLED = ("feature-pooling", "attention-transfer")


def stacked(model: nnx.Module) -> jax.Array:
    """``[layers, batch, seq, d_model]``: what ``model``'s wrapped taps sowed in its last
    forward, popped (a later forward starts clean) and stacked in model order, as Tunix's
    strategies stack the teacher's."""
    sown = nnx.pop(model, nnx.Intermediate)
    return jnp.stack(jax.tree.leaves(sown))


def feature_shape(config) -> tuple[int, int]:
    """``(layers, d_model)`` of one position's features of a model with ``config``."""
    return config.num_layers, config.d_model


def strategy_name(strategy) -> str:
    """The ``--strategy`` name of a Tunix strategy object (``attention-transfer`` before
    ``feature-pooling``: Tunix's attention class subclasses the pooling one)."""
    for name in ("attention-transfer", "feature-pooling", "feature-projection", "logit"):
        if isinstance(strategy, tunix_distill.strategy_class(name)):
            return name
    raise ValueError(f"{type(strategy).__name__}: not one of Tunix's strategies")


def check_models(name: str, student_config, teacher_config) -> None:
    """Raises ValueError (one line) unless ``--strategy name`` can read both models.

    A scanned model runs its layers in a ``jax.lax.scan``, where what a tap sows is not
    kept; the pooling strategies only shrink the teacher's features (Tunix's
    ``avg_pool_array_to_target_shape``), so the student must be no deeper and no wider.
    """
    if name not in TAPS:
        return
    for who, config in (("student", student_config), ("teacher", teacher_config)):
        if config.scan_layers:
            raise ValueError(
                f"--strategy {name!r} reads each layer's output, but the {who}'s layers are "
                "scanned (--scan / scan_layers), which keeps none: use unscanned layers"
            )
    s, t = feature_shape(student_config), feature_shape(teacher_config)
    if name in POOLED and (s[0] > t[0] or s[1] > t[1]):
        raise ValueError(
            f"--strategy {name!r} pools the teacher's features [{t[0]} layers, d_model "
            f"{t[1]}] to the student's [{s[0]}, {s[1]}]: expected a student no deeper and "
            "no wider than its teacher (--strategy feature-projection projects instead)"
        )


class FeatureProjection(nnx.Module):
    """``features [L_s, batch, seq, D_s] -> [L_t, batch, seq, D_t]``, one linear map per
    token over its layers and d_model (kernel ``[L_s, D_s, L_t, D_t]``, bias ``[L_t,
    D_t]``, replicated).

    Args:
      student_shape, teacher_shape: ``(layers, d_model)`` of each model's features.
      trained: the variable type of the weights: ``nnx.LoRAParam`` when the student's
        trained variables are its LoRA adapters (the projection trains with them), else
        ``nnx.Param``.
    """

    def __init__(self, student_shape, teacher_shape, *, trained=nnx.Param, rngs: nnx.Rngs):
        shape = (*student_shape, *teacher_shape)
        init = nnx.initializers.lecun_normal(in_axis=(0, 1), out_axis=(2, 3))
        kernel = sharding.param(rngs, init, shape, (None,) * 4)
        bias = sharding.param(rngs, nnx.initializers.zeros, teacher_shape, (None, None))
        self.kernel = trained(kernel[...], **kernel.get_metadata())
        self.bias = trained(bias[...], **bias.get_metadata())

    def __call__(self, features: jax.Array) -> jax.Array:
        projected = jnp.einsum("lbtd,ldme->mbte", features, self.kernel[...])  # [L_t, B, T, D_t]
        return projected + self.bias[...][:, None, None, :]


class ProjectedStudent(nnx.Module):
    """The student with its :class:`FeatureProjection`: what the trainer trains under
    ``--strategy feature-projection``. ``forward`` and ``config`` are the student's."""

    def __init__(self, model: nnx.Module, projection: FeatureProjection):
        self.model = model
        self.projection = projection
        self.config = model.config

    def forward(self, *args, **kwargs):
        return self.model.forward(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)


def student_features(model: nnx.Module) -> jax.Array:
    """The student's features after its forward: ``[L_s, B, T, D_s]`` popped from its
    taps, projected to ``[L_t, B, T, D_t]`` for a :class:`ProjectedStudent`."""
    if isinstance(model, ProjectedStudent):
        return model.projection(stacked(model.model))
    return stacked(model)


def _uses_lora(model: nnx.Module) -> bool:
    return bool(jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))


def _place_like(projection: FeatureProjection, model: nnx.Module) -> None:
    """``projection`` replicated on the mesh of ``model``'s parameters, if they have one."""
    placed = jax.tree.leaves(nnx.state(model, nnx.Param))[0].sharding
    if isinstance(placed, jax.sharding.NamedSharding):
        sharding.shard_model(projection, placed.mesh)


def _project_pre_process(self, student_model, teacher_model):
    """Both models' taps wrapped (Tunix's ``wrap_model_with_sowed_modules``), the student
    returned inside a :class:`ProjectedStudent` on its mesh."""
    from tunix.distillation import feature_extraction

    feature_extraction.wrap_model_with_sowed_modules(student_model, [self.feature_layer])
    feature_extraction.wrap_model_with_sowed_modules(teacher_model, [self.feature_layer])
    projection = FeatureProjection(
        feature_shape(student_model.config),
        feature_shape(teacher_model.config),
        trained=nnx.LoRAParam if _uses_lora(student_model) else nnx.Param,
        rngs=self.rngs,
    )
    _place_like(projection, student_model)
    return ProjectedStudent(student_model, projection), teacher_model


def _project_post_process(self, student_model, teacher_model):
    """The bare student and teacher, taps unwrapped (Tunix's ``unwrap_sowed_modules``)."""
    from tunix.distillation import feature_extraction

    if isinstance(student_model, ProjectedStudent):
        student_model = student_model.model
    feature_extraction.unwrap_sowed_modules(student_model)
    feature_extraction.unwrap_sowed_modules(teacher_model)
    return student_model, teacher_model


def projection_strategy_class() -> type:
    """Tunix's ``FeatureProjectionStrategy`` with a per-token :class:`FeatureProjection`
    (its ``compute_loss``, ``get_teacher_outputs`` and the rest are Tunix's)."""
    base = tunix_distill.strategy_class("feature-projection")
    methods = {
        "pre_process_models": _project_pre_process,
        "post_process_models": _project_post_process,
        "__doc__": projection_strategy_class.__doc__,
    }
    return type(f"PerToken{base.__name__}", (base,), methods)


def feature_strategy(name, student_forward_fn, teacher_forward_fn, labels_fn, *, alpha, seed=0):
    """Tunix's strategy for the feature or attention ``--strategy name`` on our taps.

    Raises:
      ValueError: ``name`` is not a feature strategy, or the release lacks it.
    """
    if name not in TAPS:
        raise ValueError(f"--strategy {name!r}: expected one of {', '.join(TAPS)}")
    fns = (student_forward_fn, teacher_forward_fn, labels_fn)
    if name == "feature-pooling":
        return tunix_distill.strategy_class(name)(*fns, feature_layer=TAPS[name], alpha=alpha)
    if name == "attention-transfer":
        return tunix_distill.strategy_class(name)(*fns, attention_layer=TAPS[name], alpha=alpha)
    return projection_strategy_class()(
        *fns, feature_layer=TAPS[name], dummy_input={}, rngs=nnx.Rngs(seed), alpha=alpha
    )
