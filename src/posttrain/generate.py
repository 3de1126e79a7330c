"""Sampling from a :class:`~posttrain.models.CausalLM` with its KV cache: one jitted
prefill, then a ``lax.while_loop`` of one-token decode steps.

Dimensions: B batch (prompts), P the longest prompt, N ``max_new_tokens``, S the cache
size (``P + N`` unless given), V vocab.

Prompts are left-padded to P (``pad_id``), so cache slot i is buffer index i, the
layout Tunix's sampler uses (:mod:`posttrain.layers.kv_cache`). Positions count each
row's real tokens from 0 (pads get 0). A row stops at its first ``eos_ids`` token (kept
in its output) or after N tokens; the loop ends when every row has stopped.

Sampling (:func:`sample`): ``temperature == 0`` is greedy (argmax); otherwise the logits
are divided by the temperature, cut to the ``top_k`` largest and to the smallest set
whose probability reaches ``top_p`` (nucleus sampling, Holtzman et al. 2019), and one
token is drawn. The RNG of step i is ``fold_in(key(seed), i)``: a seed gives the same
tokens on every run and mesh. ``logprobs`` are the model's (``log_softmax`` of the raw
logits, temperature 1) at each chosen token: what RL and scoring need.

Across processes (:mod:`posttrain.distributed`) every process passes the same prompts:
they become global arrays with the batch over the data-parallel axes, each process
placing its own devices' rows, and the results are gathered into every process
(:func:`posttrain.distributed.host_array`). Streaming (``on_token``) is one process's
host callback, so it is refused there.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import io_callback

from posttrain import distributed, sharding


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How to pick each token.

    Attributes:
      max_new_tokens: N, at most this many tokens per row (>= 1).
      temperature: 0 for greedy, else > 0 (finite).
      top_k: keep the k most likely tokens (``None``: all); 1 is greedy.
      top_p: keep the smallest set of tokens whose probability reaches p, in (0, 1]
        (``None``: all).
      seed: the RNG seed, in [0, 2**32).
      eos_ids: token ids that end a row.
      pad_id: the id prompts are left-padded with and stopped rows are filled with.

    Raises:
      ValueError: a value outside its range (named).
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    eos_ids: tuple[int, ...] = ()
    pad_id: int = 0

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens}: expected >= 1")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature={self.temperature}: expected a finite value >= 0")
        if not 0 <= self.seed < 2**32:  # jax.random.key of a uint32
            raise ValueError(f"seed={self.seed}: expected an integer in [0, 2**32)")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k={self.top_k}: expected >= 1 or None")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: expected in (0, 1] or None")


@dataclasses.dataclass(frozen=True)
class Generation:
    """What :func:`generate` returns (host arrays).

    Attributes:
      tokens: ``[B, N]`` int32 generated ids, ``pad_id`` after a row stopped.
      logprobs: ``[B, N]`` float32 model log-probability of each generated token (0
        after a row stopped).
      lengths: ``[B]`` int32 generated tokens per row (the EOS included).
      stop_reasons: per row, ``"eos"`` or ``"length"``.
    """

    tokens: np.ndarray
    logprobs: np.ndarray
    lengths: np.ndarray
    stop_reasons: list[str]

    def row(self, i: int) -> list[int]:
        """Row ``i``'s generated ids, without the padding after it stopped."""
        return [int(t) for t in self.tokens[i, : self.lengths[i]]]


def sample(logits: jax.Array, key: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """One token id per row of ``logits`` ``[B, V]`` float32 (see the module docstring).

    Returns:
      ``[B]`` int32.
    """
    if cfg.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / cfg.temperature
    neg = jnp.finfo(scaled.dtype).min
    if cfg.top_k is not None and cfg.top_k < scaled.shape[-1]:
        kth = jax.lax.top_k(scaled, cfg.top_k)[0][..., -1:]  # [B, 1]
        scaled = jnp.where(scaled < kth, neg, scaled)
    if cfg.top_p is not None and cfg.top_p < 1:
        order = jnp.argsort(-scaled, axis=-1)  # [B, V] most likely first
        ranked = jnp.take_along_axis(scaled, order, axis=-1)
        probs = jax.nn.softmax(ranked, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the more likely tokens
        cut_ranked = jnp.where(before < cfg.top_p, ranked, neg)  # the first always stays
        inverse = jnp.argsort(order, axis=-1)
        scaled = jnp.take_along_axis(cut_ranked, inverse, axis=-1)
    return jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens [B, P] int32, real [B, P] bool)``: each prompt right-aligned.

    Raises:
      ValueError: no prompts, or an empty one.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate: every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    tokens = np.full((len(prompts), width), pad_id, np.int32)
    real = np.zeros((len(prompts), width), bool)
    for i, p in enumerate(prompts):
        tokens[i, width - len(p) :] = p
        real[i, width - len(p) :] = True
    return tokens, real


def _positions(real: jax.Array) -> jax.Array:
    return jnp.maximum(jnp.cumsum(real.astype(jnp.int32), axis=-1) - 1, 0)


def _prefill(model, tokens, real, cache_size: int, images):
    """The prompts' forward into a fresh cache of ``cache_size`` slots.

    Returns:
        ``(logits, cache, valid, last_position)``: the last position's ``[B, V]`` logits
        (only it is projected), the filled cache, ``valid[b, s]`` (``[B, S]`` bool: slot
        ``s`` holds a real token of row ``b``; prompt pads never do) and the ``[B]`` last
        positions. The images enter here only: their soft tokens are then in the cache.
    """
    batch, width = tokens.shape
    valid = jnp.concatenate([real, jnp.ones((batch, cache_size - width), bool)], axis=1)
    slots = jnp.arange(cache_size)
    cache = model.init_cache(batch, cache_size, model.config.dtype)
    prefill_mask = (slots[None, :] <= jnp.arange(width)[:, None])[None] & valid[:, None, :]
    positions = _positions(real)
    image_kw = {} if images is None else {"images": images}
    logits, cache = model(
        tokens, positions, cache, prefill_mask, decode_only_last_token=True, **image_kw
    )
    return logits[:, -1], cache, valid, positions[:, -1]


def _choose(logits, key, step, cfg: SamplingConfig):
    """The ``[B]`` tokens sampled from ``[B, V]`` logits at ``step`` and their log-probabilities."""
    token = sample(logits, jax.random.fold_in(key, step), cfg)
    logprob = jnp.take_along_axis(jax.nn.log_softmax(logits), token[:, None], axis=-1)
    return token, logprob[:, 0]


def _emit(on_token, token, done) -> None:
    """Hands ``on_token`` the step's tokens and done flags on the host as soon as they
    are chosen, in order (nothing without a callback)."""
    if on_token is not None:
        token, done = sharding.constrain(token, (None,)), sharding.constrain(done, (None,))
        io_callback(
            lambda t, d: on_token(np.asarray(t), np.asarray(d)), None, token, done, ordered=True
        )


@nnx.jit(static_argnames=("cfg", "cache_size", "on_token"))
def _generate(
    model, tokens, real, seed, cfg: SamplingConfig, cache_size: int, on_token=None, images=None
):
    batch, width = tokens.shape
    n = cfg.max_new_tokens
    key = jax.random.key(seed)  # traced: a new seed does not compile again
    eos = jnp.asarray(cfg.eos_ids or (-1,), jnp.int32)
    slots = jnp.arange(cache_size)
    graphdef, params = nnx.split(model)
    logits, cache, valid, last_position = _prefill(model, tokens, real, cache_size, images)

    first, first_lp = _choose(logits, key, 0, cfg)
    out = jnp.full((batch, n), cfg.pad_id, jnp.int32).at[:, 0].set(first)
    lps = jnp.zeros((batch, n), jnp.float32).at[:, 0].set(first_lp)
    _emit(on_token, first, jnp.zeros((batch,), bool))
    done = jnp.isin(first, eos)
    lengths = jnp.ones((batch,), jnp.int32)

    def cond(state):
        step, _, _, _, done, _ = state
        return (step < n) & ~jnp.all(done)

    def body(state):
        step, out, lps, lengths, done, cache = state
        last = out[:, step - 1]
        position = last_position + step
        mask = (slots <= width + step - 1)[None, None, :] & valid[:, None, :]  # [B, 1, S]
        # a fresh module inside the loop's trace: LoRA's interception sets attributes
        step_model = nnx.merge(graphdef, params)
        logits, cache = step_model(last[:, None], position[:, None], cache, mask)
        token, lp = _choose(logits[:, -1], key, step, cfg)
        token = jnp.where(done, cfg.pad_id, token)
        _emit(on_token, token, done)
        lp = jnp.where(done, 0.0, lp)
        lengths = lengths + (~done).astype(jnp.int32)
        done = done | jnp.isin(token, eos)
        return step + 1, out.at[:, step].set(token), lps.at[:, step].set(lp), lengths, done, cache

    state = (jnp.int32(1), out, lps, lengths, done, cache)
    _, out, lps, lengths, done, _ = jax.lax.while_loop(cond, body, state)
    return out, lps, lengths, done


def generate(
    model,
    prompts: Sequence[Sequence[int]],
    cfg: SamplingConfig,
    *,
    cache_size: int | None = None,
    on_token: Callable[[np.ndarray, np.ndarray], None] | None = None,
    images=None,
) -> Generation:
    """Generates up to ``cfg.max_new_tokens`` tokens after each prompt.

    Args:
      model: a :class:`~posttrain.models.CausalLM` (LoRA adapters included); when a
        mesh is current (:func:`posttrain.sharding.use_mesh`) the cache is sharded on it
        and the batch is filled up to a multiple of the data-parallel size (the extra
        rows are dropped from the result).
      prompts: token ids, one list per row (any lengths >= 1).
      cfg: :class:`SamplingConfig`.
      cache_size: S slots (default: the longest prompt + ``max_new_tokens``).
      on_token: called on the host with ``(tokens [B], stopped [B])`` after each step
        (the step's token of every row, and which rows had stopped before it), in order:
        streaming. Each distinct callback compiles the loop once.
      images: the rows' images (a :class:`~posttrain.layers.vision.ImageBatch`,
        ``[rows, I, P, C]`` / ``[rows, I, P, 2]``), placed at each prompt's image tokens
        in the prefill (a model with a vision tower); None: text only.

    Returns:
      :class:`Generation`.

    Raises:
      ValueError: an empty prompt, or ``cache_size`` too small for the longest prompt
        plus ``max_new_tokens`` (both numbers named); ``on_token`` across processes.
    """
    if on_token is not None and distributed.process_count() > 1:
        raise ValueError("on_token (streaming) runs in one process; across processes pass None")
    rows = len(prompts)
    current = sharding.current()
    if current is not None and rows:  # the batch must divide over the data-parallel axes
        extra = -rows % sharding.data_parallel_size(current.mesh, current.rules)
        prompts = [*prompts, *[prompts[0]] * extra]
        if images is not None and extra:  # the extra rows repeat row 0's images too
            images = jax.tree.map(lambda x: np.concatenate([x, *[x[:1]] * extra]), images)
    tokens, real = left_pad(prompts, cfg.pad_id)
    need = tokens.shape[1] + cfg.max_new_tokens
    cache_size = need if cache_size is None else cache_size
    if cache_size < need:
        raise ValueError(
            f"cache_size={cache_size} is too small: the longest prompt has "
            f"{tokens.shape[1]} tokens and max_new_tokens={cfg.max_new_tokens}"
        )
    static = dataclasses.replace(cfg, seed=0)
    seed = np.uint32(cfg.seed)
    if current is not None and distributed.process_count() > 1:
        tokens, real, seed = _global(current.mesh, current.rules, tokens, real, seed)
    out, lps, lengths, done = _generate(
        model, tokens, real, seed, static, cache_size, on_token, images
    )
    # a collective across processes: every process gathers the same four, in order
    out, lps, lengths, done = (distributed.host_array(x)[:rows] for x in (out, lps, lengths, done))
    return Generation(out, lps, lengths, ["eos" if d else "length" for d in done])


def _global(mesh, rules, tokens: np.ndarray, real: np.ndarray, seed: np.uint32):
    """The host inputs as global arrays on ``mesh``: ``tokens`` and ``real`` [B, P] with
    B over the data-parallel axes, ``seed`` replicated; each process places the pieces
    of its own devices from its (identical) host copy."""
    spec = sharding.logical_to_spec(
        ("activation_batch", None), tokens.shape, dict(mesh.shape), rules
    )
    rows = jax.sharding.NamedSharding(mesh, spec)
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    seed = np.asarray(seed)
    return (
        jax.make_array_from_callback(tokens.shape, rows, lambda i: tokens[i]),
        jax.make_array_from_callback(real.shape, rows, lambda i: real[i]),
        jax.make_array_from_callback((), whole, lambda i: seed),
    )
