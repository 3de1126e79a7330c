"""Causal self-attention through JAX's Pallas splash attention (TPU), issue #55.

The XLA path (:func:`posttrain.layers.attention.softmax_attend`) materialises float32
scores ``[B, K, G, T, S]``; splash attention (``jax.experimental.pallas.ops.tpu.
splash_attention``, a flash-attention kernel: online softmax over key blocks) keeps
O(T) residuals per head (the output and its log-sum-exp) and skips the key blocks the
causal or local mask hides. It computes what :func:`softmax_attend` computes for every
query that sees at least one key, with these differences of form:

* the mask is the kernel's static mask (:class:`CausalMask`, or :class:`LocalMask`
  for a sliding window) and-ed with segment ids (:func:`segment_ids`), derived from
  the caller's mask before the window. That expresses causal x same-segment x
  valid-key masks (left, right and middle padding, packing). A mask it cannot
  express (e.g. a key one query sees and a later query of the same segment does not)
  is caught by :func:`splash_mask`'s check, and that example's output is NaN, so
  training shows a NaN loss instead of silently computing another model.
* ``q`` is multiplied by the scale before the kernel (splash does not scale).
* a query that sees no key (padding): without sinks it averages the values of the
  keys in the kernel blocks its static mask visits (the XLA path averages its query
  block's keys); with sinks its output is 0, as in the XLA path. Such queries are
  padding, never trained on.

Used by :class:`posttrain.layers.attention.Attention` when the decoder hands it a
:class:`SplashMask` (``ModelConfig.attention_kernel``); the XLA path still runs where
the kernel cannot: non-causal attention (the vision tower, bidirectional image
blocks), a KV cache (generation), a sequence sharded over ``context``.

Under a mesh of more than one device (:func:`posttrain.sharding.use_mesh`) the kernel
runs under ``jax.shard_map`` (:func:`sharded`): XLA's partitioner cannot split the
Mosaic call (jax 0.10.2 refuses to lower it for a TPU slice; interpreted, it gathers
q, k and v onto every device around it). Each device runs it on its batch rows and
query heads (``activation_batch``, ``activation_heads``) with its kv heads
(``activation_kv_heads``), the whole sequence. That needs each shard's query heads to
read only its own kv heads: both head axes on the same mesh axes (the default rules; a
num_kv_heads the ``tensor`` axis does not divide is refused earlier, by the kv heads'
constraint). Rules that shard them differently are refused at trace time
(``ValueError``) rather than silently replicating the kv heads.

Reference: ``splash_attention_kernel.py`` / ``splash_attention_mask.py`` of jax 0.10.2
(``make_splash_mha``: query head h reads kv head h // (N / K), as ``repeat_kv``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as sa
from jax.sharding import PartitionSpec as P

from posttrain import sharding

#: Splash's blocks: the kernel needs multiples of 128 (the TPU's lanes) on the
#: sequence axes, interpreted or not (segment ids tile by 128). The largest that
#: divides the (padded) sequence is used.
BLOCKS = (512, 256, 128)
LANES = 128
#: Segment id of a query that sees no key, and of a key no query may see.
NO_QUERY, NO_KEY = -2, -1


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["mask", "q_segment", "kv_segment", "exact"],
    meta_fields=["window", "interpret"],
)
@dataclasses.dataclass(frozen=True)
class SplashMask:
    """What one layer type's splash attention needs, built once per forward.

    Attributes:
      mask: ``[B, T, T]`` bool, the dense mask in use (window included): the XLA
        path's, where the kernel cannot run.
      q_segment, kv_segment: ``[B, T]`` int32 segment ids (:func:`segment_ids`).
      exact: ``[B]`` bool, the segment ids with the static mask reproduce ``mask``
        in every row of that example; where not, its attention output is NaN.
      window: W keys visible to each query (itself included), or ``None``.
      interpret: run the kernel with Pallas' interpreter (any backend; slow).
    """

    mask: jax.Array
    q_segment: jax.Array
    kv_segment: jax.Array
    exact: jax.Array
    window: int | None
    interpret: bool


def target_platform() -> str:
    """The platform the program being built will run on: the devices of the current mesh
    (:func:`posttrain.sharding.use_mesh`; ``posttrain plan``'s deviceless TPU devices
    while this process's backend is the CPU), else JAX's default backend."""
    context = sharding.current()
    if context is not None:
        return context.mesh.devices.flat[0].platform
    return jax.default_backend()


def check_backend(kernel: str, name: str = "attention_kernel='splash'") -> None:
    """Refuses ``kernel='splash'`` off a TPU (:func:`target_platform`;
    ``splash_interpret`` runs anywhere).

    Args:
      kernel: ``ModelConfig.attention_kernel``.
      name: how the message names the choice (the CLI: ``--attention-kernel splash``).

    Raises:
      ValueError: in one line naming the backend.
    """
    platform = target_platform()
    if kernel == "splash" and platform != "tpu":
        raise ValueError(f"{name} needs a TPU backend, this is {platform!r}")


def segment_ids(causal: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Splash segment ids ``(q [B, T], kv [B, S])`` int32 from a mask without window.

    ``q[t]`` is the first key query t sees (:data:`NO_QUERY` if none), ``kv[s]`` is
    ``q[s]`` where key s is valid (``causal[s, s]``), else :data:`NO_KEY`. For a
    causal x same-segment x valid-key mask (packing; left, right or middle padding)
    ``causal[t, s] == (s <= t and q[t] == kv[s])``.

    Args:
      causal: ``[B, T, S]`` bool (S = T), True where query t may attend key s.
    """
    seen = jnp.any(causal, axis=-1)  # [B, T]
    first = jnp.argmax(causal, axis=-1).astype(jnp.int32)  # [B, T]
    q = jnp.where(seen, first, NO_QUERY)  # [B, T]
    valid = jnp.diagonal(causal, axis1=1, axis2=2)  # [B, T]
    return q, jnp.where(valid, q, NO_KEY)


def implied_mask(q: jax.Array, kv: jax.Array, window: int | None) -> jax.Array:
    """``[B, T, S]`` bool: the mask the kernel applies, causal (and ``t - s < window``)
    and-ed with ``q[t] == kv[s]``."""
    t = jnp.arange(q.shape[1])[:, None]  # [T, 1]
    s = jnp.arange(kv.shape[1])[None, :]  # [1, S]
    static = s <= t
    if window is not None:
        static &= (t - s) < window
    return static[None] & (q[:, :, None] == kv[:, None, :])  # [B, T, S]


def splash_mask(causal: jax.Array, mask: jax.Array, window: int | None, kernel: str) -> SplashMask:
    """A :class:`SplashMask` for layers of window ``window``.

    Args:
      causal: ``[B, T, T]`` bool, the caller's mask and-ed with causality, before any
        window (:func:`posttrain.layers.attention.attention_mask` with ``None``).
      mask: ``[B, T, T]`` bool, the mask in use (``causal`` with the window).
      window: the layers' sliding window, or ``None``.
      kernel: ``splash`` or ``splash_interpret`` (``ModelConfig.attention_kernel``).
    """
    q, kv = segment_ids(causal)
    exact = jnp.all(implied_mask(q, kv, window) == mask, axis=(1, 2))  # [B]
    return SplashMask(mask, q, kv, exact, window, kernel == "splash_interpret")


def padded_length(seq: int) -> int:
    """``seq`` rounded up to a multiple of :data:`LANES`: the length the kernel runs on."""
    return -(-seq // LANES) * LANES


def block_sizes(seq: int) -> sa.BlockSizes:
    """The same block (the largest of :data:`BLOCKS` dividing ``seq``) for every pass."""
    block = next(b for b in BLOCKS if seq % b == 0)
    return sa.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    masks: SplashMask,
    sinks: jax.Array | None,
    scale: float,
) -> jax.Array:
    """Causal softmax attention of ``q`` over ``k``, ``v`` with splash attention.

    Dimensions: B batch, T seq (keys S = T), N num_heads, K num_kv_heads, H head_dim.

    Args:
      q: ``[B, T, N, H]`` in the compute dtype.
      k, v: ``[B, T, K, H]`` in the compute dtype.
      masks: the layer type's :class:`SplashMask`.
      sinks: ``[N]`` float32 sink logits (GPT-OSS), or ``None``.
      scale: the scores' factor (``AttentionConfig.logit_scale``), applied to ``q``
        in float32 before the kernel.

    Returns:
      ``[B, T, N, H]`` in ``q``'s dtype; NaN in the examples whose mask the segment ids
      do not reproduce (``masks.exact`` False).
    """
    seq, dtype = q.shape[1], q.dtype
    q = (q.astype(jnp.float32) * scale).astype(dtype)
    q = jnp.swapaxes(q, 1, 2)  # [B, N, T, H]
    k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, K, T, H]
    q_seg, kv_seg = masks.q_segment, masks.kv_segment
    padded = padded_length(seq)
    if padded != seq:  # padded queries see no key; padded keys no query sees
        pad = [(0, 0), (0, 0), (0, padded - seq), (0, 0)]
        q, k, v = jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad)
        q_seg = jnp.pad(q_seg, [(0, 0), (0, padded - seq)], constant_values=NO_QUERY)
        kv_seg = jnp.pad(kv_seg, [(0, 0), (0, padded - seq)], constant_values=NO_KEY)
    args = (q, k, v, q_seg, kv_seg) + (() if sinks is None else (sinks,))
    run = functools.partial(call_kernel, window=masks.window, interpret=masks.interpret)
    context = sharding.current()
    if context is not None and context.mesh.size > 1:
        run = sharded(run, context, q.shape, k.shape, sinks is not None)
    with jax.named_scope("attention_splash"):
        out = run(*args)  # [B, N, T', H]
    out = jnp.swapaxes(out[:, :, :seq], 1, 2)  # [B, T, N, H]
    out = jnp.where(masks.exact[:, None, None, None], out, jnp.nan)
    return sharding.constrain(
        out, ("activation_batch", "activation_length", "activation_heads", None)
    ).astype(dtype)


def call_kernel(q, k, v, q_seg, kv_seg, sinks=None, *, window: int | None, interpret: bool):
    """Splash attention over the batch (``jax.vmap``), built for ``q``'s heads.

    Args:
      q: ``[B, N, T, H]`` (T a multiple of :data:`LANES`), already scaled.
      k, v: ``[B, K, T, H]``, N divisible by K.
      q_seg, kv_seg: ``[B, T]`` int32 segment ids.
      sinks: ``[N]`` float32 sink logits, or ``None``.
      window: :attr:`SplashMask.window`; interpret: :attr:`SplashMask.interpret`.

    Returns:
      ``[B, N, T, H]`` in ``q``'s dtype.
    """
    heads, seq = q.shape[1], q.shape[2]
    shape = (seq, seq)
    if window is None:
        static = sa.CausalMask(shape)
    else:
        static = sa.LocalMask(shape, window_size=(window - 1, 0), offset=0)
    kernel = sa.make_splash_mha(
        sa.MultiHeadMask([static] * heads),
        block_sizes=block_sizes(seq),
        head_shards=1,
        q_seq_shards=1,
        interpret=interpret,
    )
    segments = sa.SegmentIds(q_seg, kv_seg)
    return jax.vmap(kernel, in_axes=(0, 0, 0, 0, None))(q, k, v, segments, sinks)


def sharded(run, context: sharding.MeshContext, q_shape, kv_shape, sinks: bool):
    """``run`` (:func:`call_kernel`'s arguments) under ``jax.shard_map`` on the mesh of
    ``context``: batch and heads split as the logical axes resolve, the sequence whole.

    Args:
      run: the kernel call, on the local shards.
      context: the current mesh and rules (:func:`posttrain.sharding.current`).
      q_shape: ``(B, N, T, H)``; kv_shape: ``(B, K, T, H)``.
      sinks: whether ``run`` takes the ``[N]`` sinks.

    Raises:
      ValueError: the query heads and the kv heads resolve to different mesh axes (a
        shard's query heads would read other shards' kv heads), or (from
        :func:`~posttrain.sharding.logical_to_spec`) a dimension does not divide.
    """
    mesh_shape = dict(context.mesh.shape)

    def spec(heads: str, shape) -> tuple:
        axes = ("activation_batch", heads, None, None)
        resolved = sharding.logical_to_spec(axes, shape, mesh_shape, context.rules)
        return tuple(resolved) + (None,) * (4 - len(resolved))  # trailing Nones dropped

    q_spec, kv_spec = spec("activation_heads", q_shape), spec("activation_kv_heads", kv_shape)
    if q_spec[1] != kv_spec[1]:  # the batch resolves alike: same name, first dimension
        raise ValueError(
            f"splash attention splits num_heads={q_shape[1]} over mesh axes {q_spec[1]!r} "
            f"but num_kv_heads={kv_shape[1]} over {kv_spec[1]!r}; expected the same axes "
            "for both (each shard's query heads read only its own kv heads)"
        )
    batch, heads = P(q_spec[0]), P(q_spec[1])
    in_specs = (P(*q_spec), P(*kv_spec), P(*kv_spec), batch, batch) + ((heads,) if sinks else ())
    # jax.shard_map(check_vma=): jax >= 0.7, the oldest era of compat/entries.toml (0.7.1).
    # check_vma=False: splash's pallas_call declares its outputs without the varying mesh
    # axes the check needs (jax 0.10.2: "manual_axis_type ... must not be None").
    return jax.shard_map(
        run, mesh=context.mesh, in_specs=in_specs, out_specs=P(*q_spec), check_vma=False
    )
