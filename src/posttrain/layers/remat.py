"""Rematerialisation of the decoder layers: the policies ``ModelConfig.remat`` names, and
the values the ``save_attention`` policy keeps.

Under ``jax.checkpoint`` a layer's forward runs again in the backward pass, except for
what its policy saves (``jax.checkpoint_policies``):

- ``none``: no checkpoint (every activation the backward needs is kept);
- ``full``: nothing saved (``nothing_saveable``), the whole layer recomputed;
- ``save_dots``: every matmul output without batch dimensions
  (``dots_with_no_batch_dims_saveable``);
- ``save_attention``: the attention's projections (query, key and value, each
  ``[B, T, heads, head_dim]`` before their norms and RoPE: :data:`PROJECTIONS`), its
  output before ``o_proj`` (``[B, T, N, H]``: :data:`OUTPUT`) and, under splash
  attention, the kernel's residuals (its output and softmax statistics:
  :data:`RESIDUALS`, :func:`keep_residuals`). The backward pass then recomputes the
  norms, RoPE, ``o_proj`` and the MLP, but neither the query/key/value matmuls nor the
  attention (MaxText's ``save_qkv_proj`` and ``minimal_flash`` policies keep such values
  by the same means, ``checkpoint_name``).

A custom-VJP kernel's residuals (splash's ``_splash_attention_fwd``) are made inside
its forward rule, where no policy sees them: under ``full`` or ``save_dots`` the
backward pass runs the forward kernel again (the v5e's profile showed it twice a
layer). :func:`keep_residuals` wraps such a function in a custom VJP of its own whose
residuals are its ``jax.vjp`` closure's arrays, each named :data:`RESIDUALS`, so that a
policy can keep them.
"""

from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name

#: the name of the attention's query, key and value projections (before norms and RoPE)
PROJECTIONS = "attention_projections"
#: the name of the attention's output before ``o_proj``
OUTPUT = "attention_output"
#: the name of a wrapped kernel's residuals (:func:`keep_residuals`)
RESIDUALS = "attention_residuals"

#: ``ModelConfig.remat`` -> the ``jax.checkpoint`` policy (``none``: no checkpoint)
POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save_attention": jax.checkpoint_policies.save_only_these_names(PROJECTIONS, OUTPUT, RESIDUALS),
}


def name(x: jax.Array, what: str) -> jax.Array:
    """``x`` unchanged, named ``what`` for the policies (``jax.ad_checkpoint.checkpoint_name``)."""
    return checkpoint_name(x, what)


def keep_residuals(fn):
    """``fn`` with its residuals named :data:`RESIDUALS`, so that ``save_attention`` keeps
    them instead of running ``fn``'s forward again in the backward pass.

    Args:
      fn: a function of arrays to an array or a tuple of arrays (e.g. a Pallas kernel with
        its own custom VJP); differentiated through ``jax.vjp``.

    Returns:
      a function with ``fn``'s arguments, values and gradients. Outside a checkpoint, or
      under a policy that does not save :data:`RESIDUALS`, nothing changes but the name.
    """

    @jax.custom_vjp
    def run(*args):
        return fn(*args)

    def forward(*args):
        out, pullback = jax.vjp(fn, *args)
        leaves, tree = jax.tree.flatten(pullback)  # a jax.tree_util.Partial: its residuals
        return out, jax.tree.unflatten(tree, [name(leaf, RESIDUALS) for leaf in leaves])

    def backward(pullback, cotangent):
        return pullback(cotangent)

    run.defvjp(forward, backward)
    return run
