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
* ``softmax``: attention's softmax divided after the weighted sum of the values
  (``softmax_attend``: ``(e @ v) / l``) against ``jax.nn.softmax`` then the sum.
* ``heads``: the q/k/v projections' kernels as ``[D, heads * head_dim]`` matrices against
  the einsum over the ``[D, heads, head_dim]`` kernel (the form Qwix still gets).
* ``grouped`` (``--family qwen3_moe``): the sorted MoE's grouped matmul (``layers.moe.
  grouped``: each expert's weights read once, its rows in chunks of up to the mean rows
  per expert, a hand-written backward, blocks of A / (8E) rows) against the scan over
  blocks of A / (2E) rows it replaced (:func:`block_scan_sorted`: a ``cond`` per block to
  skip the unused ones, each block's weight slices taken again in the backward).
* ``splash``: ``attention_kernel`` splash (on a TPU; elsewhere splash_interpret, slow)
  against xla, float32, no remat: ``JAX_PLATFORMS=tpu python benchmarks/model_ab.py
  --form splash --batch 4 --seq 2048`` (qwen3-0.6b's shape: ``--d-model 1024
  --num-layers 28 --num-heads 16 --num-kv-heads 8 --head-dim 128 --d-ff 3072
  --vocab-size 151936``).
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


def normalised_softmax_attention(q, k, v, mask, sinks, scale):
    """``softmax_attend`` before #43's last change: ``jax.nn.softmax`` over the masked scores
    and the sink column, then the weighted sum of the values."""
    import jax
    import jax.numpy as jnp

    logits = jnp.einsum("btkgh,bskh->bkgts", q.astype(jnp.float32), k) * scale
    logits = jnp.where(mask[:, None, None, :, :], logits, jnp.finfo(jnp.float32).min)
    if sinks is not None:
        sink = jnp.broadcast_to(sinks[None, :, :, None, None], (*logits.shape[:-1], 1))
        logits = jnp.concatenate([logits, sink], axis=-1)  # [B, K, G, T, S + 1]
    probs = jax.nn.softmax(logits, axis=-1)[..., : k.shape[1]]
    return jnp.einsum("bkgts,bskh->btkgh", probs, v)


def einsum_over_batch_and_sequence(spec, x, kernel):
    """``token_einsum`` before #43: the einsum over ``x``'s own token dims."""
    import jax.numpy as jnp

    return jnp.einsum(spec, x, kernel)


def block_scan_sorted(self, x, weights, expert_ids, p):
    """``Experts._sorted`` before the grouped matmul: a scan over fixed blocks of the old
    default size, A / (2E) rows, each block multiplied by its expert's weight slices under a
    ``cond`` that skips the unused trailing blocks, the scan body checkpointed to save only
    the matmuls' outputs."""
    import jax
    import jax.numpy as jnp

    from posttrain.layers.moe import dispatch

    num_experts = self.moe.num_experts
    # the old default, A / (2E) rows: default_block_size now takes A / (8E)
    size = self.moe.block_size or dispatch.default_block_size(4 * expert_ids.size, num_experts)
    layout = dispatch.block_layout(expert_ids, num_experts, size)
    num_blocks, d_model = layout.row_token.shape[0] // size, x.shape[-1]
    block_ids = jnp.arange(num_blocks, dtype=jnp.int32)  # [NB]
    ended = layout.block_ends[None, :] <= block_ids[:, None]  # [NB, E]
    block_expert = jnp.minimum(jnp.sum(ended, axis=1), num_experts - 1)  # [NB]
    rows = x[layout.row_token].reshape(num_blocks, size, d_model)  # [NB, S, D]

    def mlp(rows, w):
        gate, up = rows @ w["gate_proj"], rows @ w["up_proj"]  # [S, F]
        if w["gate_proj_bias"] is not None:
            gate, up = gate + w["gate_proj_bias"], up + w["up_proj_bias"]
        out = self._act(gate, up) @ w["down_proj"]  # [S, D]
        return out if w["down_proj_bias"] is None else out + w["down_proj_bias"]

    def block(carry, inputs):
        block_rows, e, b = inputs
        w = {n: None if v is None else v[e] for n, v in p.items()}
        skip = lambda rows, w: jnp.zeros((size, d_model), rows.dtype)  # noqa: E731
        return carry, jax.lax.cond(b < layout.block_ends[-1], mlp, skip, block_rows, w)

    block = jax.checkpoint(block, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    _, out = jax.lax.scan(block, None, (rows, block_expert, block_ids))  # [NB, S, D]
    out = out.reshape(num_blocks * size, d_model)
    return dispatch.combine_rows(out, layout.assignment_row, weights)


# form -> the (module, attribute or Class.attribute, earlier value) patches that put the
# earlier form back
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
    "softmax": [("posttrain.layers.attention", "softmax_attend", normalised_softmax_attention)],
    "grouped": [("posttrain.layers.moe.experts", "Experts._sorted", block_scan_sorted)],
    "splash": [],  # a config choice, not a patch (main)
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
    old_cfg = cfg
    if known.form == "splash":  # the new form is the kernel, the old the XLA path
        kernel = "splash" if jax.default_backend() == "tpu" else "splash_interpret"
        cfg, old_cfg = cfg.replace(attention_kernel=kernel), cfg.replace(attention_kernel="xla")
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, args.vocab_size, (args.batch, args.seq)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(args.seq, dtype=jnp.int32), tokens.shape)
    mask = jnp.broadcast_to(
        jnp.tril(jnp.ones((args.seq, args.seq), bool)), (args.batch, args.seq, args.seq)
    )
    patches = []
    for module, path, old in FORMS[known.form]:  # "Class.method" patches the class
        *owners, attr = path.split(".")
        owner = importlib.import_module(module)
        for name in owners:
            owner = getattr(owner, name)
        patches.append((owner, attr, old))
    new_step, new_fwd, _ = steps(build_model(cfg, seed=0), tokens, positions, mask)
    kept = [(module, attr, getattr(module, attr)) for module, attr, _ in patches]
    for module, attr, old in patches:
        setattr(module, attr, old)
    try:
        old_step, old_fwd, _ = steps(build_model(old_cfg, seed=0), tokens, positions, mask)
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
