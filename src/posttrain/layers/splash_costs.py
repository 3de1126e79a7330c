"""What splash attention's kernels cost, for ``posttrain plan`` (issue 54).

XLA's ``cost_analysis()`` counts a custom call as no work, and JAX's splash kernels
(jax 0.10.2) declare no cost estimate: a plan of a program with
``attention_kernel='splash'`` left out every attention matmul. On a lent v5e
(qwen3-0.6b SFT, batch 4 x 2048, remat save_dots, docs/scale.md) that was 1.32e13 of
the step's 4.52e13 FLOPs, and its estimated MFU was 54% above the chip's.

Counted per attention layer, per device (B batch rows and N query heads of the device,
T the sequence padded to the kernel's 128 lanes, H head_dim), in units of one
``[T, T] x H`` matmul pass over the blocks the kernel visits, ``2 B N T^2 H x density``
FLOPs (:func:`block_density`; the kernel skips the blocks its static mask hides):

- forward (``splash_mha_fwd``): ``q k^T`` and ``p v``: 2;
- again in the backward pass under remat (``full`` and ``save_dots``: the kernel's
  output is not a dot, so the policy recomputes it; the v5e's profile showed the forward
  kernel twice a layer): 2;
- backward: the ``dq`` kernel (``q k^T`` again, ``do v^T``, ``ds k``): 3, and the ``dkv``
  kernel (``q k^T``, ``do v^T``, ``p^T do``, ``ds^T q``): 4.

Bytes: each pass reads and writes its operands once (``q``, ``k``, ``v``, ``o``, and in
the backward ``do``, ``dq``, ``dk``, ``dv``) in the compute dtype; the blocks the kernel
revisits stay in VMEM. The softmax's elementwise work is left out (under ``4 / H`` of
the matmuls'). An estimate, as :func:`posttrain.training.chunked_loss.uncounted_costs`.

Source: ``splash_attention_kernel.py`` of jax 0.10.2 (``_splash_attention_forward``,
``_splash_attention_bwd_dq``, ``_splash_attention_bwd_dkv``).
"""

from __future__ import annotations

import jax.numpy as jnp

from posttrain import sharding
from posttrain.layers.splash import block_sizes, padded_length

#: matmul passes over the visited blocks: forward, the forward again under remat, backward
FORWARD_PASSES, BACKWARD_PASSES = 2, 7
#: what a program's ``cost_source`` says when it carries these costs
COST_SOURCE = "splash's kernels analytic"


def block_density(seq: int, window: int | None) -> float:
    """The fraction of ``[T', T']`` score blocks the kernel computes for a causal mask
    (``window``: a local one, each query seeing itself and ``window - 1`` keys before),
    ``T'`` = :func:`~posttrain.layers.splash.padded_length` of ``seq``, in blocks of
    :func:`~posttrain.layers.splash.block_sizes`. A block is computed where any of its
    (query, key) pairs is visible.

    Raises:
      ValueError: ``seq`` or ``window`` < 1.
    """
    if seq < 1 or (window is not None and window < 1):
        raise ValueError(f"seq={seq} and window={window} must be >= 1")
    padded = padded_length(seq)
    block = block_sizes(padded).block_q
    count = padded // block
    visited = 0
    for i in range(count):  # query block i: queries [i b, (i + 1) b)
        first = 0
        if window is not None:  # the first key block holding a key query i b can see
            first = max(0, (i * block - window + 1) // block)
        visited += i - first + 1  # key blocks first..i (later ones are all in the future)
    return visited / count**2


def uncounted_costs(
    cfg, batch: int, seq: int, mesh_shape: dict, rules: sharding.Rules, *, backward: bool
) -> tuple[float, float]:
    """``(FLOPs, bytes accessed)`` per device of the splash kernels of one step of ``cfg``
    on ``[batch, seq]`` (``backward``: a train step; else a forward, such as DPO's
    reference); ``(0, 0)`` unless ``cfg.attention_kernel`` is ``splash`` (XLA counts its own
    path and the interpreter's HLO). Batch rows divide by
    the mesh axes of ``activation_batch``, query heads by ``activation_heads``, as
    :func:`posttrain.layers.splash.sharded` splits them.

    Raises:
      ValueError: ``batch`` or ``seq`` < 1.
    """
    if batch < 1 or seq < 1:
        raise ValueError(f"batch={batch} and seq={seq} must be >= 1")
    if cfg.attention_kernel != "splash":  # XLA's path, or the interpreter's HLO: counted
        return 0.0, 0.0
    table = sharding.rules_dict(rules)
    rows = -(-batch // sharding.axis_product(mesh_shape, table.get("activation_batch", ())))
    head_shards = sharding.axis_product(mesh_shape, table.get("activation_heads", ()))
    padded = padded_length(seq)
    recomputed = backward and cfg.remat != "none"  # the forward kernel again, under remat
    passes = FORWARD_PASSES * (2 if recomputed else 1) + (BACKWARD_PASSES if backward else 0)
    itemsize = jnp.dtype(cfg.dtype).itemsize
    flops = moved = 0.0
    for layer_type in cfg.layer_types:
        attn = cfg.attention[layer_type]
        heads = -(-attn.num_heads // head_shards)
        kv_heads = -(-attn.num_kv_heads // head_shards)
        one_pass = 2.0 * rows * heads * padded**2 * attn.head_dim
        flops += passes * one_pass * block_density(seq, attn.sliding_window)
        operand = rows * padded * attn.head_dim * itemsize  # one head's [B, T', H]
        forward = (2 * heads + 2 * kv_heads) * operand  # q, k, v read; o written
        moved += forward * (2 if recomputed else 1)
        if backward:  # dq: q, k, v, do read, dq written; dkv: q, k, v, do read, dk, dv written
            moved += (3 * heads + 2 * kv_heads) * operand + (2 * heads + 4 * kv_heads) * operand
    return flops, moved
