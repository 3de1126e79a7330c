"""Identity submodules marking the activations a distillation strategy may read.

Tunix's feature and attention strategies (``tunix.distillation``, google-tunix 0.1.5 -
0.1.7 and main) capture intermediate outputs by module *type*: ``pre_process_models``
replaces every submodule of the given type with a ``SowedModule`` that calls it and
sows its output (``nnx.Intermediate``, tag ``intermediate_output``), and the
strategy pops them after each forward. Each decoder layer holds one of each tap below;
unwrapped they return their input and add nothing to the traced forward (tested: the
jaxpr of the plain forward is unchanged). They have no variables, so wrapping them moves
no parameter path (checkpoints and LoRA paths are the same with and without a strategy).

Dimensions: B batch, T seq, D d_model.
"""

from __future__ import annotations

import jax
from flax import nnx


class _Tap(nnx.Module):
    """Returns its input unchanged (an ``nnx.Module`` so a strategy can wrap it)."""

    def __call__(self, x: jax.Array) -> jax.Array:
        return x


class LayerOutput(_Tap):
    """A decoder layer's output ``[B, T, D]`` (after its residual adds, and Gemma 4's
    ``layer_scalar``): the features ``--strategy feature-pooling|feature-projection``
    read."""


class AttentionOutput(_Tap):
    """A decoder layer's attention block output ``[B, T, D]`` (after ``o_proj``, before
    the residual add): what ``--strategy attention-transfer`` reads."""


def sown(module: nnx.Module) -> nnx.State:
    """The ``nnx.Intermediate`` variables ``module`` holds (a sow inside it ran)."""
    return nnx.state(module, nnx.Intermediate)


def has_sown(state) -> bool:
    """Whether ``state`` (from :func:`sown`) holds any array."""
    return bool(jax.tree.leaves(state))
