"""The SFT train step of :class:`posttrain.training.trainer.SFTTrainer`: one body that works
under every calling convention Tunix has used, exact gradient accumulation and the SFT loss.

The step body is written once (:meth:`SFTStep._step_body`) and wrapped
into the signature the installed Tunix expects (:mod:`posttrain.training.tunix_compat`):

- ``positional3`` (google-tunix 0.0.2-0.1.5): ``step(model, optimizer, inputs) -> (loss, aux)``;
- ``bound2`` (0.1.6-0.1.7): same parameters, ``-> (loss, aux, grad_norm)``;
- ``bound3_update`` (main since 659881fb): ``step(model, optimizer, grad_accumulator,
  inputs, is_update_step) -> (loss, aux, grad_norm)``.

Parameter names are fixed because ``nnx.jit`` donates by name (``optimizer``,
``grad_accumulator``). Gradients: ``nnx.split`` the model into the trained
variables (``nnx.LoRAParam`` when LoRA is on, else ``nnx.Param``) and the rest,
``jax.value_and_grad`` a pure function that merges them; no NNX transform is
nested inside Tunix's ``nnx.jit``.

Gradient accumulation is exact: both of Tunix's accumulators average the
micro-steps' gradients (``optax.MultiSteps`` in releases; main's
``GradientAccumulator``, every micro-step ``add``-ed, also the first: an empty
accumulator is never a reason to skip, and the optimizer runs only under
``is_update_step``), and each micro-step differentiates its objective, whose mean over
the step's micro-batches is the step loss (:func:`posttrain.training.loss.step_objective`,
the one place the accumulation count scales anything), so the average is the gradient of
one large batch. The step hands the gradients over unscaled.

Donation (:meth:`SFTStep.jit_train_step`, the one definition the trainer runs and
``posttrain plan`` compiles): Tunix's ``nnx.jit`` donates the optimizer (and main's
gradient accumulator) only, so every step wrote the model's parameters to new buffers
beside the old ones: a second copy of the trained weights (full fine-tuning), or of the
frozen base, which ``nnx.jit`` returns too (LoRA). The step also donates ``model``
(:meth:`SFTStep.donated_argnames`); ``nnx.jit`` writes the outputs back into the model's
``Variable`` objects, so whatever holds the model or its Variables reads the new arrays.
Only a holder of the old *arrays* would break; none does:

- checkpoints: Tunix's ``CheckpointManager.save`` (and ``OptimizerStateCheckpoints``)
  take the model after the step; Orbax copies every array to the host before ``save``
  returns (no ``device_host_byte_limiter`` is set), as it must for the optimizer state,
  which Tunix always donated; the finiteness check reads ``self.model``'s current state;
- the eval step, Tunix's ``cached_partial`` and the metrics: the eval step is bound to
  the model object (``cached_partial``'s clone shares its Variables); the records hold
  the step's outputs (loss, aux, grad norm), never an input;
- LoRA's frozen base and DPO's reference: :func:`posttrain.training.policy.reference_of`
  builds the reference from the policy's own base Variables (flax 0.12 ``nnx.merge``
  reuses them), so it reads the new arrays; distillation's teacher is its own model;
- GRPO's actor is Tunix's trainer, not this step: Tunix's sampler shares its model and
  its donation (the optimizer's) is left as it is.

A module the trainer holds that keeps one of the model's arrays in a Variable of its own
(:func:`arrays_held_beside`: a reference built by copying Variables but not arrays, as
``nnx.merge`` did before flax 0.12) would lose it: the model is then not donated.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import jax
import jax.numpy as jnp
from flax import nnx
from typing_extensions import override

from posttrain import _compat
from posttrain.training import loss as sft_loss
from posttrain.training import tunix_compat

#: the step's parameter holding the model, which it donates (:meth:`SFTStep.donated_argnames`)
MODEL = "model"


def arrays_held_beside(model, others) -> list[str]:
    """Paths of ``model``'s arrays that a module in ``others`` holds in a ``Variable`` of its
    own, which donating ``model`` would delete under it (a Variable shared with ``model``
    gets the step's new array, as the model does).

    Args:
      model: the trained model.
      others: the other modules the trainer keeps (a reference, a teacher).
    """
    variables, arrays = set(), {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Variable):
            variables.add(id(node))
            arrays[id(_compat.variable_value(node))] = "/".join(map(str, path))
    return [
        arrays[id(_compat.variable_value(node))]
        for other in others
        for _, node in nnx.iter_graph(other)
        if isinstance(node, nnx.Variable)
        and id(node) not in variables
        and id(_compat.variable_value(node)) in arrays
    ]


class SFTStep:
    """The step: :meth:`create_train_step_fn` wraps :meth:`_step_body` in the installed
    convention's signature. A mixin of :class:`~posttrain.training.trainer.SFTTrainerMixin`,
    whose ``__init__`` sets what it reads: ``convention``, ``grad_accum_steps``,
    ``moe_aux_loss_weight``, ``learned`` and ``_wrt`` / ``_frozen`` (the trained variables),
    and Tunix's ``gen_model_input_fn``. Other trainers (DPO, distillation) override
    :meth:`_objective`, :meth:`_report` and :attr:`reported_sum`.
    """

    reported_sum = "nll_sum"  # the term whose per-target-token mean is the reported loss
    loss_options: Mapping[str, object] = MappingProxyType({})
    """Keywords of :func:`posttrain.training.loss.sft_terms` in the SFT objective: the
    loss's form (``chunked``, ``logit_chunk``) for a subclass to choose
    (``benchmarks/sft_step.py --logit-chunk``); none: the default (chunked)."""

    def _objective(self, model, inputs):
        """``(this micro-step's objective, the forward terms)`` for ``model``
        (the merged, differentiable model): :func:`posttrain.training.loss.step_objective`,
        MoE load-balancing term included. Other trainers (DPO) override this and
        :meth:`_report`; the step around them is shared."""
        terms = sft_loss.sft_terms(model, **inputs, **self.loss_options)
        objective = sft_loss.step_objective(
            terms,
            inputs.get("step_target_tokens"),
            moe_aux_weight=self.moe_aux_loss_weight,
            grad_accum_steps=self.grad_accum_steps,
        )
        return objective, terms

    def _report(self, terms, inputs, grad_norm):
        """``(reported loss, aux)`` of one micro-step from its forward terms."""
        tokens = (
            jnp.sum(inputs["segment_ids"] > 0)
            if "segment_ids" in inputs
            else (jnp.asarray(inputs["input_tokens"].size))
        )
        aux = {**terms, "grad_norm": grad_norm, "tokens": tokens.astype(jnp.float32)}
        return terms[self.reported_sum] / jnp.maximum(terms["target_tokens"], 1.0), aux

    def _grads(self, model, inputs):
        """``(objective, terms, grads)``: :meth:`_objective` and d(objective)/d(trained
        variables); zero for the ``SFTOptions.frozen`` ones, which are constants of the
        objective (no backward through them)."""
        graphdef, trained, frozen, rest = nnx.split(model, self.learned, self._wrt, ...)

        def share(trained_state):
            # New Variable objects for the frozen part, made in this trace: nnx.merge
            # reuses a State's Variables (flax 0.12), and an nnx.jit called inside the
            # objective (Tunix's DPO compute_logps) writes its outputs back into them,
            # which flax refuses across trace levels (TraceContextError).
            constants = jax.tree.map(lambda x: x, (frozen, rest))
            return self._objective(nnx.merge(graphdef, trained_state, *constants), inputs)

        (objective, terms), grads = jax.value_and_grad(share, has_aux=True)(trained)
        if self._frozen is not None:  # Tunix's optimizer holds every trained-kind variable
            grads = nnx.merge_state(grads, jax.tree.map(jnp.zeros_like, frozen))
        return objective, terms, grads

    def _step_body(self, model, optimizer, grad_accumulator, inputs, is_update_step):
        """One micro-step; returns ``(reported loss, aux, grad_norm)``."""
        inputs = self.gen_model_input_fn(inputs)
        _, terms, grads = self._grads(model, inputs)
        if grad_accumulator is None or self.grad_accum_steps == 1:
            # MultiSteps (releases) averages the micro-gradients itself; on main without
            # accumulation: update every call. grad_norm is the norm of the applied
            # (accumulated) gradient under every convention: MultiSteps applies the
            # window's mean at its last micro-step, and only that micro-step's value is
            # logged (posttrain.training.metrics).
            window = _compat.multisteps_window_gradient(optimizer.opt_state, grads)
            grad_norm = _compat.global_norm(grads if window is None else window)
            optimizer.update(model, grads)
        else:
            grad_accumulator.add(grads)  # denom += 1

            def apply(model, optimizer, grad_accumulator):
                total = grad_accumulator.get()  # their mean: the step's gradient
                norm = _compat.global_norm(total).astype(jnp.float32)
                optimizer.update(model, total)
                grad_accumulator.reset()
                return norm

            def skip(model, optimizer, grad_accumulator):
                return jnp.zeros((), jnp.float32)

            grad_norm = nnx.cond(is_update_step, apply, skip, model, optimizer, grad_accumulator)
        loss, aux = self._report(terms, inputs, grad_norm)
        return loss, aux, grad_norm

    def donated_argnames(self) -> tuple[str, ...]:
        """The step arguments its jit donates: Tunix's (``Convention.donated``: the
        optimizer, main's gradient accumulator) and the model (module docstring), unless
        another module this trainer keeps holds one of the model's arrays
        (:func:`arrays_held_beside`)."""
        beside = [
            value
            for value in vars(self).values()
            if isinstance(value, nnx.Module) and value is not self.model
        ]
        if arrays_held_beside(self.model, beside):
            return self.convention.donated
        return (MODEL, *self.convention.donated)

    def jit_train_step(self):
        """``nnx.jit`` of :meth:`create_train_step_fn` donating :meth:`donated_argnames`: the
        program the trainer runs (bound as Tunix binds its own,
        :func:`posttrain.training.tunix_compat.bind_like`) and ``posttrain plan`` compiles."""
        return nnx.jit(self.create_train_step_fn(), donate_argnames=self.donated_argnames())

    @override  # PeftTrainer's, past this mixin in the trainer's MRO
    def create_train_step_fn(self):
        """The step in the installed convention's signature (see the module docstring)."""
        name = self.convention.name
        body = self._step_body
        if name == "positional3":

            def train_step(model, optimizer, inputs):
                loss, aux, _ = body(model, optimizer, None, inputs, None)
                return loss, aux
        elif name == "bound2":

            def train_step(model, optimizer, inputs):
                return body(model, optimizer, None, inputs, None)
        elif name == "bound3_update":

            def train_step(model, optimizer, grad_accumulator, inputs, is_update_step=True):
                return body(model, optimizer, grad_accumulator, inputs, is_update_step)
        else:
            raise tunix_compat.UnknownConventionError(
                f"no step for convention {self.convention.describe()}"
            )
        return train_step
