"""Our model's step with one function in its committed form (B) against an earlier form (A).

Usage::

    python benchmarks/model_ab.py --form rope [--repeats 15] [model_step's shape options]

The A/B figure of a change to the model's hot path, measured in one process: the same
model and batch as ``benchmarks/model_step.py`` (one CPU device, float32, forward +
cross-entropy + backward, and forward only), traced twice, once with the function as it is
and once with the earlier form patched in, then timed in turns (``_timing``); prints
``new/old`` as ratios of medians and the largest gradient difference between the two.

Forms (the earlier one kept here as the reference it replaced):

* ``rope``: ``apply_rope`` rotating each half with its own cos/sin slices, against the
  ``x * cos + rotate_half(x) * sin`` form (HF ``apply_rotary_pos_emb``), whose backward
  pads and concatenates the negated halves.
* ``tokens``: the projections' matmuls over the merged token dims ``[B*T, D]``
  (``token_einsum``) against the einsums over ``[B, T, D]``.
* ``blocks``: causal attention in ``QUERY_BLOCKS`` query blocks against one block.
* ``heads``: the q/k/v projections' kernels as ``[D, heads * head_dim]`` matrices against
  the einsum over the ``[D, heads, head_dim]`` kernel (the form Qwix still gets).
* ``slices`` (``--family qwen3_moe``): the sorted MoE's block scan under a checkpoint that
  saves only the matmuls' outputs (``experts.BLOCK_POLICY``) against one that saves
  everything, as no checkpoint does: each block's weight slices stacked for the backward.
"""

from __future__ import annotations

import argparse
import os
import sys


def rotate_half_rope(x, cos, sin, sections: int = 1):
    """``apply_rope`` before #43: builds ``rotate_half(x)`` per section, then one multiply-add."""
    import jax.numpy as jnp

    x32 = x.astype(jnp.float32)
    rotated = []
    for part in jnp.split(x32, sections, axis=-1):  # [B, T, N, H/sections]
        half = part.shape[-1] // 2
        rotated.append(jnp.concatenate([-part[..., half:], part[..., :half]], axis=-1))
    rotated = jnp.concatenate(rotated, axis=-1)  # [B, T, N, H]
    return (x32 * cos[:, :, None, :] + rotated * sin[:, :, None, :]).astype(x.dtype)


def einsum_over_batch_and_sequence(spec, x, kernel):
    """``token_einsum`` before #43: the einsum over ``x``'s own token dims."""
    import jax.numpy as jnp

    return jnp.einsum(spec, x, kernel)


def jax_policy(name: str):
    """``jax.checkpoint_policies.<name>`` (``everything_saveable``: a checkpoint that saves
    what no checkpoint would)."""
    import jax

    return getattr(jax.checkpoint_policies, name)


# form -> the (module, attribute, earlier value) patches that put the earlier form back
FORMS = {
    "rope": [("posttrain.layers.attention", "apply_rope", rotate_half_rope)],
    "tokens": [
        (module, "token_einsum", einsum_over_batch_and_sequence)
        for module in (
            "posttrain.layers.mlp",
            "posttrain.layers.attention",
            "posttrain.layers.embeddings",
        )
    ],
    "blocks": [("posttrain.layers.attention", "QUERY_BLOCKS", 1)],
    "heads": [("posttrain.layers.attention", "qwix_may_intercept", lambda module: True)],
    "slices": [
        (
            "posttrain.layers.moe.experts",
            "BLOCK_POLICY",
            jax_policy("everything_saveable"),
        )
    ],
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--form", required=True, choices=sorted(FORMS))
    known, rest = parser.parse_known_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import importlib

    import jax
    import jax.numpy as jnp
    import numpy as np
    from _timing import interleaved_medians
    from model_step import _args, configs, steps

    from posttrain.models import build_model

    args = _args(rest)
    cfg, _ = configs(args)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, args.vocab_size, (args.batch, args.seq)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(args.seq, dtype=jnp.int32), tokens.shape)
    mask = jnp.broadcast_to(
        jnp.tril(jnp.ones((args.seq, args.seq), bool)), (args.batch, args.seq, args.seq)
    )
    patches = [(importlib.import_module(m), attr, old) for m, attr, old in FORMS[known.form]]
    new_step, new_fwd, _ = steps(build_model(cfg, seed=0), tokens, positions, mask)
    kept = [(module, attr, getattr(module, attr)) for module, attr, _ in patches]
    for module, attr, old in patches:
        setattr(module, attr, old)
    try:
        old_step, old_fwd, _ = steps(build_model(cfg, seed=0), tokens, positions, mask)
        old_grads = jax.tree.leaves(old_step())  # both traced while the old form is in
        old_fwd()
    finally:
        for module, attr, value in kept:
            setattr(module, attr, value)
    new_grads = jax.tree.leaves(new_step())
    diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(old_grads, new_grads, strict=True))
    fns = {"new": new_step, "old": old_step, "new_fwd": new_fwd, "old_fwd": old_fwd}
    times = interleaved_medians(
        {k: (lambda fn=fn: jax.block_until_ready(fn())) for k, fn in fns.items()}, args.repeats
    )
    print(
        f"{known.form}: {args.family}, batch {args.batch} x {args.seq}, max |grad diff| {diff:.2e}"
    )
    for label, new, old_key in (("step", "new", "old"), ("forward", "new_fwd", "old_fwd")):
        ms_new, ms_old = times[new] * 1e3, times[old_key] * 1e3
        print(
            f"  {label:8s} new {ms_new:.1f} ms, old {ms_old:.1f} ms, new/old {ms_new / ms_old:.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
