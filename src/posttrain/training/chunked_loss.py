"""Next-token NLL from the final hidden states, a chunk of positions at a time: the batch's
float32 logits ``[batch, seq, vocab]`` never exist whole, in the forward or the backward.

Why: at qwen3-0.6b (vocab 151,936), batch 4 x 2048, those logits are a 4.98 GB float32
temporary, and their gradient another: the largest temporaries of the SFT step (issue #55).
Chunked, the step holds one chunk's logits (:data:`LOGIT_CHUNK_BYTES` per device by default)
and the head's weight gradient, and the head's matmul still runs once a chunk (step 4).

How (:func:`chunked_nll`):

1. Position t's label is token t+1, counted where ``targets`` is set (never at the last
   position); the sequence is padded to ``count`` chunks of ``length`` positions
   (:func:`chunk_length`) with positions that count nowhere.
2. Chunk j holds positions j, j + count, j + 2 * count, ... (strided): a sequence sharded over
   ``tensor_sequence x context`` in contiguous blocks gives every chunk the same number of
   positions from each block, so no chunk gathers the sequence (``length`` is a multiple of
   that product).
3. A ``jax.lax.scan`` over the chunks: the model's head (``CausalLM.logits``: head, float32
   cast, softcap, the ``LOGIT_AXES`` constraint, so the vocabulary stays sharded over
   ``tensor``), ``log_softmax`` in float32, the labels' NLL summed where counted.
4. Gradients (``jax.custom_vjp``): when the loss is differentiated, the forward's scan takes
   each chunk's VJP at cotangent 1 while its logits exist (the NLL is a sum of the chunks'),
   keeps the chunk's hidden-state gradient, and sums the gradients of what the head closes
   over (its weights and adapters, hoisted by ``jax.closure_convert``) in float32 across
   the chunks; only those being differentiated (a frozen head under LoRA gets none). The
   backward scales them by the NLL's cotangent and casts each to its dtype (the head's
   once; the hidden-state gradient, already in its dtype, a second time). So the
   head's matmul runs once a chunk: the hidden states' gradient and the weights' are the
   other two (two with a frozen head), where recomputing each chunk's logits in a backward
   scan, as this loss did before, ran it twice (four matmuls and three; the head is a
   quarter of qwen3-0.6b's parameters). Held: one ``[batch, seq, d_model]`` gradient in
   the compute dtype and, for a trained head, its float32 gradient sum, from the loss to
   the backward. (``jax.checkpoint`` inside a scan would recompute, and sum a closed-over
   weight's gradient in the weight's dtype: one more bfloat16 rounding per chunk.) XLA's
   ``cost_analysis()`` counts a loop's body once: :func:`uncounted_costs` is the rest, for
   ``posttrain plan``.

The result equals :func:`posttrain.training.loss.token_nll` of the full logits up to float32
reassociation (the sum's order, and the head gradient's per-chunk partial sums).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from posttrain import sharding

TILE = 128
"""A default chunk's length is a multiple of this many positions (when its budget is at
least that many, or half and the tile pads less, :func:`chunk_length`): a chunk of 205
positions (4 x 1024 tokens of qwen3-0.6b under :data:`LOGIT_CHUNK_BYTES`, 5 chunks) made
a v5e compile the full fine-tuning step in 83 s against 13-16 s for chunks of 256, 512 or
1024 and for the full logits, and ran it 7.5% slower than the full logits (256: 2.7%;
docs/benchmarks.md)."""

SUBLANES = 16
"""Under a :data:`TILE`, a default chunk's length is a multiple of this many positions
(when its budget is at least that many) or the tile: the rows of a TPU's bfloat16 tile
(8 x 128, two rows packed), so that a chunk's ``[rows, length, vocab]`` logits and their
gradient reshape to ``[rows * length, vocab]`` without a copy. Chunks of 103 positions
(8 x 1024 tokens of qwen3-0.6b, 10 chunks) spent 14.4 ms of a v5e's 405 ms full
fine-tuning step in that copy (`reshape` of ``bf16[8,103,151936]``, the chip's profile;
docs/benchmarks.md)."""

LOGIT_CHUNK_BYTES = 512 * 2**20
"""Default size of one chunk's float32 logits on one device: 512 MiB, 882 tokens of qwen3-0.6b's
151,936-entry vocabulary (batch 4 on one chip: 220 positions of a row, so 8 chunks of 256
positions of a 2048-token row, :data:`TILE`). Fewer tokens a chunk leave its gradients
bound by memory on a v5e: each chunk reads the head's weights twice and its float32
gradient sum once and writes it once (12 bytes per weight in bfloat16), which its 3
matmuls take as long to compute at ~480 tokens (197 TFLOP/s, 819 GB/s)."""


def _shards(mesh_shape: dict, rules: sharding.Rules) -> tuple[int, int, int]:
    """``(batch, length, vocab)`` shard counts of the logits under ``rules``."""
    table = sharding.rules_dict(rules)
    return tuple(
        sharding.axis_product(mesh_shape, table.get(name, ()))
        for name in ("activation_batch", "activation_length", "activation_vocab")
    )


def chunk_length(
    batch: int,
    seq: int,
    vocab_size: int,
    chunk: int | None = None,
    *,
    mesh_shape: dict | None = None,
    rules: sharding.Rules | None = None,
) -> int:
    """Positions per chunk of a ``[batch, seq]`` batch's logits.

    ``chunk`` caps it; the count of chunks that takes is then evened out (``seq`` 16, chunk
    5: 4 chunks of 4, not 3 of 5 and a 1), and the length rounded up to a multiple of the
    mesh axes sharding the sequence (a chunk's ``activation_length`` must divide by them).
    The default: as many positions as keep one chunk's float32 logits on one device within
    :data:`LOGIT_CHUNK_BYTES` (the rows and vocabulary divided by the mesh axes that shard
    them), evened out the same way, then, from :data:`TILE` positions up, the multiple of
    ``TILE`` and of those axes just below or above it whose chunks pad the sequence least,
    else the nearer (``seq`` 2048, 220 positions fit: 8 chunks of 256, not 10 of 205; 683:
    3 of 768, not 4 of 640); under a ``TILE``, from :data:`SUBLANES` up, the same among
    the multiples of ``SUBLANES`` and, from half a ``TILE``, the ``TILE`` itself (``seq``
    1024, 110 positions: 8 of 128, not 10 of 103; 55: 16 of 64, not 19 of 54); one past
    the sequence is the sequence rounded up to those axes (one chunk). The mesh and rules:
    ``mesh_shape`` and ``rules`` when given, else the current
    :func:`posttrain.sharding.use_mesh`'s (none: one device).

    Raises:
      ValueError: ``chunk`` is not a positive integer.
    """
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"logit chunk={chunk!r} must be a positive integer (positions) or None")
    ctx = sharding.current()
    if mesh_shape is None:
        mesh_shape = {} if ctx is None else dict(ctx.mesh.shape)
    if rules is None:
        rules = sharding.DEFAULT_RULES if ctx is None else ctx.rules
    rows, split, columns = _shards(mesh_shape, rules)
    default = chunk is None
    if default:
        chunk = split * max(
            1, LOGIT_CHUNK_BYTES // (4 * -(-batch // rows) * -(-vocab_size // columns))
        )
    count = -(-seq // min(chunk, seq))
    length = -(-seq // count)  # evened out: fewer than `count` padded positions
    length = -(-length // split) * split
    if not default or length >= seq:
        return length
    tile = math.lcm(TILE, split)
    under_a_tile = length < tile
    quantum = math.lcm(SUBLANES, split) if under_a_tile else tile
    if length < quantum:
        return length  # fewer positions than a tile's rows fit: the budget decides
    below = length // quantum * quantum
    candidates = [below, below + quantum]
    if under_a_tile and 2 * length >= tile:
        candidates.append(tile)  # at most twice the budget
    # the one that pads the sequence least, then the nearer; one past the sequence is the
    # sequence rounded up to its shards (one chunk)
    whole = -(-seq // split) * split
    return min(
        {min(n, whole) for n in candidates}, key=lambda n: (-(-seq // n) * n, abs(n - length))
    )


def uncounted_costs(
    cfg, batch: int, seq: int, mesh_shape: dict, rules: sharding.Rules, *, head_trained: bool
) -> tuple[float, float]:
    """``(FLOPs, bytes accessed)`` per device of the chunked loss that XLA's
    ``cost_analysis()`` leaves out: it counts a while loop's body once, and the loss runs its
    gradients in one loop of ``count`` chunks (step 4 of the module docstring), so ``count -
    1`` chunks.

    A chunk (per device: ``b`` rows, ``c`` positions, ``v`` vocabulary entries, ``D`` =
    d_model): the head's matmul and the hidden states' gradient, ``2 b c D v`` FLOPs each,
    with the weights' gradient (``head_trained``) one more; bytes: the head's weights read
    by the first two, a trained head's float32 gradient sum read and written, and passes
    over the chunk's float32 logits (written, read by the softmax, the softmax's gradient
    written and read by each gradient matmul: 4, 5 with a trained head). Elementwise FLOPs
    (the softmax's) are left out: under ``4 / D`` of the matmuls'. An estimate, for
    ``posttrain plan``.
    """
    rows, split, columns = _shards(mesh_shape, rules)
    length = chunk_length(batch, seq, cfg.vocab_size, mesh_shape=mesh_shape, rules=rules)
    count = -(-seq // length)
    b, c, v, d = -(-batch // rows), length // split, -(-cfg.vocab_size // columns), cfg.d_model
    matmuls = 3 if head_trained else 2
    weight = jnp.dtype(cfg.param_dtype).itemsize
    flops = matmuls * 2.0 * b * c * d * v
    moved = 2 * d * v * weight + (8 * d * v if head_trained else 0) + 4 * (matmuls + 2) * b * c * v
    return (count - 1) * flops, (count - 1) * float(moved)


def equations(jaxpr: jax.extend.core.Jaxpr):
    """Every equation of ``jaxpr`` and, depth first, of the jaxprs its equations hold (a
    scan's body, a cond's branches, a custom VJP's rules, a checkpoint's bare jaxpr)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                if hasattr(sub, "eqns"):  # a Jaxpr, or a ClosedJaxpr (its jaxpr's)
                    yield from equations(sub)


def vocab_matmuls(jaxpr: jax.extend.core.Jaxpr, vocab_size: int) -> int:
    """How many ``dot_general``s with a ``vocab_size``-sized operand or result ``jaxpr``
    holds (:func:`equations`), each counted once: the head's matmuls of a traced loss
    (``jax.make_jaxpr(...).jaxpr``). The differentiated chunked NLL holds 3 (2 with a frozen
    head), the full logits' loss the same; recomputing the logits in the backward would add
    one."""
    return sum(
        any(vocab_size in v.aval.shape for v in (*eqn.invars, *eqn.outvars))
        for eqn in equations(jaxpr)
        if eqn.primitive.name == "dot_general"
    )


def _chunk_nll_sum(graphdef, state, hidden, labels, counted):
    """NLL (float32 scalar) of one chunk: ``hidden [B, C, D]``, ``labels [B, C]`` int32,
    ``counted [B, C]`` bool. The model is merged here, in this trace: Qwix's LoRA einsum sets
    an attribute on the adapted module, which Flax refuses on one from an outer trace."""
    logits = nnx.merge(graphdef, state).logits(hidden)  # [B, C, V] float32
    logp = jax.nn.log_softmax(logits)  # [B, C, V] over the vocabulary (the last axis)
    picked = jnp.squeeze(jnp.take_along_axis(logp, labels[..., None]), -1)  # [B, C]
    return -jnp.sum(jnp.where(counted, picked, 0.0))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _scan_nll(fn, hidden, labels, counted, *consts):
    """Sum over chunks of ``fn(hidden[j], labels[j], counted[j], *consts)``."""

    def body(total, chunk):
        return total + fn(*chunk, *consts), None

    total, _ = jax.lax.scan(body, jnp.float32(0), (hidden, labels, counted))
    return total


def _scan_nll_fwd(fn, hidden, labels, counted, *consts):
    # The gradients are taken here, in the forward's one pass over the chunks: each chunk's
    # VJP at cotangent 1 while its logits exist (the NLL is a sum, so d total / d chunk = 1),
    # its hidden states' gradient kept and the differentiated consts' summed in float32. The
    # backward then only scales them by the NLL's cotangent: the head's matmul runs once a
    # chunk, not again in the backward. A const not perturbed (a frozen head under LoRA)
    # gets no gradient computed. Residuals: those gradients, and a scalar of each summed
    # const's dtype; no chunk's logits outlive its scan iteration.
    values = [c.value for c in consts]
    picked = [i for i, c in enumerate(consts) if c.perturbed]

    def body(carry, chunk):
        total, sums = carry
        h, y, m = chunk

        def one(h, differentiated):  # {index in consts: array}
            return fn(h, y, m, *[differentiated.get(i, c) for i, c in enumerate(values)])

        nll, vjp = jax.vjp(one, h, {i: values[i] for i in picked})
        dh, dconsts = vjp(jnp.ones_like(nll))
        sums = {i: sums[i] + d for i, d in dconsts.items()}  # float32 + the weight's dtype
        return (total + nll, sums), dh

    zeros = {i: jnp.zeros_like(values[i], jnp.float32) for i in picked}
    xs = (hidden.value, labels.value, counted.value)
    (total, sums), dhidden = jax.lax.scan(body, (jnp.float32(0), zeros), xs)
    like = [jnp.zeros((), v.dtype) if i in sums else None for i, v in enumerate(values)]
    return total, (dhidden, sums, like)


def _scan_nll_bwd(fn, residuals, g):
    dhidden, sums, like = residuals
    # g: the NLL's cotangent (float32 scalar), never a symbolic zero: the NLL is this rule's
    # one output, and JAX drops the rule when nothing differentiates it (a step of the MoE
    # term alone). The head's gradients: one rounding, from their float32 sums. The hidden
    # states' gradient was taken at cotangent 1 in its own dtype and is rounded again after
    # the scaling: two roundings for a bfloat16 model (one when the backward recomputed).
    dhidden = (g * dhidden).astype(dhidden.dtype)
    dconsts = [None if z is None else (g * sums[i]).astype(z.dtype) for i, z in enumerate(like)]
    return (dhidden, None, None, *dconsts)


_scan_nll.defvjp(_scan_nll_fwd, _scan_nll_bwd, symbolic_zeros=True)


def chunked_nll(
    hidden: jax.Array,
    model,
    input_tokens: jax.Array,
    targets: jax.Array,
    *,
    chunk: int | None = None,
) -> jax.Array:
    """Summed NLL (float32 scalar) of ``input_tokens[:, 1:]`` where ``targets`` is set, from
    the hidden states, :func:`chunk_length` positions at a time (module docstring).

    A ``head`` for :meth:`posttrain.models.CausalLM.forward` once the keywords are bound
    (``functools.partial``): called inside ``forward``, so LoRA adapters on ``lm_head`` apply.

    Args:
      hidden: ``[batch, seq, d_model]`` final-normed hidden states (compute dtype).
      model: the :class:`~posttrain.models.CausalLM` whose ``logits`` (hidden ``[batch, C,
        d_model]`` -> float32 ``[batch, C, vocab]``) project each chunk.
      input_tokens: ``[batch, seq]`` int32.
      targets: ``[batch, seq-1]`` bool (:func:`posttrain.training.loss.target_mask`).
      chunk: positions per chunk, at most (:func:`chunk_length`); None: the default.

    Raises:
      ValueError: ``chunk`` is not a positive integer.
    """
    batch, seq, d_model = hidden.shape
    length = chunk_length(batch, seq, model.config.vocab_size, chunk)
    count = -(-seq // length)
    pad = count * length - seq
    labels = jnp.pad(input_tokens[:, 1:], ((0, 0), (0, 1 + pad)))  # [B, count * C]
    counted = jnp.pad(targets, ((0, 0), (0, 1 + pad)))  # [B, count * C] bool
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))  # [B, count * C, D]
    # chunk j: positions j, j + count, ... (strided: step 2 of the module docstring)
    hidden = hidden.reshape(batch, length, count, d_model).transpose(2, 0, 1, 3)  # [n, B, C, D]
    hidden = sharding.constrain(hidden, (None, *sharding.ACTIVATION_AXES))
    labels = labels.reshape(batch, length, count).transpose(2, 0, 1)  # [n, B, C]
    counted = counted.reshape(batch, length, count).transpose(2, 0, 1)  # [n, B, C]
    one = functools.partial(_chunk_nll_sum, *nnx.split(model))
    with jax.named_scope("chunked_nll"):
        # the arrays `one` reads from the model (the head's weights, adapters) become
        # explicit arguments: their gradients are summed over the chunks in float32
        fn, consts = jax.closure_convert(one, hidden[0], labels[0], counted[0])
        return _scan_nll(fn, hidden, labels, counted, *consts)
