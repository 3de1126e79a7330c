"""The decoder stack: embeddings, layers (a Python loop or ``jax.lax.scan``), final norm.

Layers are grouped by the period P of ``layer_types`` (P = 1 for homogeneous
models, 2 for GPT-OSS and the tiny Gemma 4). Unscanned, ``layers.{i}`` holds
layer i. Scanned, ``blocks.{p}`` holds layers p, p + P, p + 2P ... stacked on a
leading axis of size L / P (logical axis ``layers``), and one scan step runs one
period of layers in order. :func:`stack_layers` / :func:`unstack_layers`
convert between the two parameter layouts. What each layer is given beside its
hidden states (per layer type, RoPE tables and the attention mask: causal, window,
packing, images, splash, cache slots) is :mod:`posttrain.models.layer_inputs`'s.

Each layer runs through ``nnx.split`` / ``nnx.merge`` around a pure function,
so remat (``jax.checkpoint``) and scan are plain JAX transforms: no NNX
transform is nested inside the ``nnx.jit`` / ``value_and_grad`` of a trainer.
That runs a *copy* of each layer, so a pass that adds variables to the modules
it runs in (Qwix creating LoRA params or quantised kernels on its first call)
runs inside :func:`unrolled_layers` instead, which keeps what the layers add.
Unscanned, what a layer sows in its copy (a distillation strategy's wrapped tap,
:mod:`posttrain.models.taps`) is written back into the layer; scanned, it is not (a
strategy that needs per-layer outputs refuses scanned layers).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain import _compat, sharding
from posttrain.config import ModelConfig
from posttrain.layers import kv_cache
from posttrain.layers.embeddings import Embed
from posttrain.layers.norms import RMSNorm
from posttrain.layers.splash import check_backend
from posttrain.models import taps
from posttrain.models.decoder_layer import DecoderLayer
from posttrain.models.layer_inputs import cached_layer_inputs, layer_inputs

VISION_PREFIX = "vision_tower."
"""Flat names of ``CausalLM.vision_tower``'s params: its ``layers.{v}`` are never stacked."""

_UNROLLED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "posttrain_unrolled_layers", default=False
)


@contextlib.contextmanager
def unrolled_layers() -> Iterator[None]:
    """Runs decoder layers as plain calls on layer modules, keeping variables they add.

    For one initialisation pass under ``nnx.eval_shape`` (the outputs are not the
    model's; not for training: there is no scan and no remat). Unscanned layers are
    called directly. Of a scanned block only the first layer runs, as its own module
    (slice 0); afterwards the variables it gained are broadcast over a new leading
    ``layers`` axis and the block is rebuilt with them, so the scan sees them in later
    calls: every layer of a block gains the same variables, so one traced layer per
    block shows them all, and the pass costs one period of layers, not L.
    Qwix's first call (``qwix.apply_lora_to_model``) needs this: it adds LoRA
    params to the module it finds in the calling frame, which under the usual
    ``nnx.merge`` path is a discarded copy.
    """
    token = _UNROLLED.set(True)
    try:
        yield
    finally:
        _UNROLLED.reset(token)


def _is_stacked(path, variable) -> bool:
    axes = sharding.variable_logical_axes(variable) if isinstance(variable, nnx.Variable) else None
    return bool(axes) and axes[0] == "layers"


def _first_layer(block: DecoderLayer) -> DecoderLayer:
    """Layer 0 of a scanned block (slice 0 of each stacked variable) as its own module."""
    graphdef, stacked, rest = nnx.split(block, _is_stacked, ...)

    def first(v):
        return v.replace(
            _compat.variable_value(v)[0], logical_axes=sharding.variable_logical_axes(v)[1:]
        )

    layer = jax.tree.map(first, stacked, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.merge(graphdef, layer, rest)


def _restack(block: DecoderLayer, layer: DecoderLayer, count: int) -> DecoderLayer:
    """``block`` plus the variables ``layer`` gained, broadcast over a leading ``layers``
    axis of size ``count``."""
    old = dict(nnx.to_flat_state(nnx.state(block)))
    flat = {}
    for path, new in nnx.to_flat_state(nnx.state(layer)):
        if path in old:
            flat[path] = old[path]
            continue
        value = _compat.variable_value(new)
        value = jnp.broadcast_to(value, (count, *value.shape))  # [L/P, ...]
        axes = sharding.variable_logical_axes(new)
        flat[path] = new.replace(
            value, **({} if axes is None else {"logical_axes": ("layers", *axes)})
        )
    return nnx.merge(nnx.graphdef(layer), nnx.from_flat_state(flat))


REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _stacked_layers(cfg: ModelConfig, layer_type: str, count: int, rngs: nnx.Rngs) -> DecoderLayer:
    """``count`` layers of one type with parameters stacked on a new leading ``layers`` axis."""
    keys = jax.random.split(_compat.next_rng_key(rngs.params), count)
    abstract = nnx.eval_shape(lambda: DecoderLayer(cfg, layer_type, rngs=nnx.Rngs(0)))
    graphdef, _ = nnx.split(abstract)
    state = jax.vmap(lambda key: nnx.state(DecoderLayer(cfg, layer_type, rngs=nnx.Rngs(key))))(keys)

    def add_layers_axis(variable):
        axes = sharding.variable_logical_axes(variable)
        return variable if axes is None else variable.replace(logical_axes=("layers", *axes))

    state = jax.tree.map(add_layers_axis, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.merge(graphdef, state)


class Decoder(nnx.Module):
    """Embeddings -> L decoder layers -> final RMSNorm.

    ``__call__(tokens [B, T] int, positions [B, T] int, padding_mask [B, T, T] bool | None)``
    returns ``(hidden [B, T, D] in cfg.dtype, moe_aux_loss scalar float32)``, the
    aux loss summed over layers.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        check_backend(cfg.attention_kernel)  # splash off a TPU: refused at build, once
        self.cfg = cfg
        dtype, param_dtype = _compat.module_dtypes(cfg)
        self.embed_tokens = Embed(
            cfg.vocab_size,
            cfg.d_model,
            scale_by_sqrt_dim=cfg.embed_scale,
            rngs=rngs,
            dtype=dtype,
            param_dtype=param_dtype,
        )
        period = cfg.layer_period
        if cfg.scan_layers:
            self.blocks = _compat.module_list(
                [
                    _stacked_layers(cfg, cfg.layer_types[p], cfg.num_layers // period, rngs)
                    for p in range(period)
                ]
            )
            self.layers = None
        else:
            self.layers = _compat.module_list(
                [DecoderLayer(cfg, t, rngs=rngs) for t in cfg.layer_types]
            )
            self.blocks = None
        self.norm = RMSNorm(
            cfg.d_model, eps=cfg.norm_eps, rngs=rngs, dtype=dtype, param_dtype=param_dtype
        )

    def _tables(self, positions, padding_mask, blocks=None):
        """cos/sin and mask per layer type present (:func:`layer_inputs`; ``blocks``: see
        :meth:`__call__`)."""
        return layer_inputs(self.cfg, positions, padding_mask, blocks)

    def _call_unrolled(self, x, tables):
        """The layers as plain module calls (see :func:`unrolled_layers`)."""
        cfg, aux = self.cfg, jnp.zeros((), jnp.float32)
        if self.blocks is None:
            for layer, t in zip(self.layers, cfg.layer_types, strict=True):
                x, layer_aux = layer(x, *tables[t])
                aux = aux + layer_aux
            return x, aux
        firsts = [_first_layer(block) for block in self.blocks]
        for layer, t in zip(firsts, cfg.layer_types[: cfg.layer_period], strict=True):
            x, layer_aux = layer(x, *tables[t])
            aux = aux + layer_aux
        for p, layer in enumerate(firsts):
            self.blocks[p] = _restack(self.blocks[p], layer, cfg.num_layers // cfg.layer_period)
        return x, aux

    def init_cache(self, batch: int, cache_size: int, dtype) -> dict:
        """An empty KV cache for ``batch`` rows of ``cache_size`` slots (layout and memory:
        :mod:`posttrain.layers.kv_cache`), sharded like the activations when a mesh is
        current (batch over the data-parallel axes, kv heads over ``tensor``)."""
        cfg = self.cfg

        def layer(t: str) -> dict:
            attn = cfg.attention[t]
            cache = kv_cache.init_layer(batch, cache_size, attn.num_kv_heads, attn.head_dim, dtype)
            return {
                **cache,
                "k": sharding.constrain(cache["k"], kv_cache.KV_AXES),
                "v": sharding.constrain(cache["v"], kv_cache.KV_AXES),
            }

        if not cfg.scan_layers:
            return {f"layer_{i}": layer(t) for i, t in enumerate(cfg.layer_types)}
        count = cfg.num_layers // cfg.layer_period
        return {
            f"block_{p}": jax.tree.map(
                lambda x: jnp.broadcast_to(x, (count, *x.shape)), layer(cfg.layer_types[p])
            )
            for p in range(cfg.layer_period)
        }

    def _cached(self, x, positions, mask, cache, blocks=None):
        """The layers on ``x`` ``[B, T, D]`` writing into and attending over ``cache``;
        ``blocks`` ``[B, T]`` (:meth:`__call__`) open each image's slots written by this
        call."""
        cfg = self.cfg
        first = next(iter(cache.values()))["end_index"]
        end = first[0] if first.ndim == 1 else first[0, 0]  # scanned: [L/P, B]
        size = next(iter(cache.values()))["k"].shape[-3]
        tables = cached_layer_inputs(cfg, positions, mask, blocks, end, size)
        aux = jnp.zeros((), jnp.float32)
        new = {}
        if not cfg.scan_layers:
            for i, (layer, t) in enumerate(zip(self.layers, cfg.layer_types, strict=True)):
                x, layer_aux, new[f"layer_{i}"] = layer(x, *tables[t], cache[f"layer_{i}"])
                aux = aux + layer_aux
            return x, aux, new
        period_types = cfg.layer_types[: cfg.layer_period]
        graphdefs, states = zip(*(nnx.split(b) for b in self.blocks), strict=True)

        def body(x, xs):
            states, caches = xs
            aux, out = jnp.zeros((), jnp.float32), []
            for graphdef, state, c, t in zip(graphdefs, states, caches, period_types, strict=True):
                x, layer_aux, c = nnx.merge(graphdef, state)(x, *tables[t], c)
                aux, out = aux + layer_aux, [*out, c]
            return x, (aux, tuple(out))

        caches = tuple(cache[f"block_{p}"] for p in range(cfg.layer_period))
        x, (auxes, caches) = jax.lax.scan(body, x, (tuple(states), caches))
        return x, jnp.sum(auxes), {f"block_{p}": c for p, c in enumerate(caches)}

    def __call__(self, tokens, positions, padding_mask=None, cache=None, embeds=None, blocks=None):
        """The final-normed hidden states of ``tokens``.

        Dimensions: B batch, T sequence, D d_model.

        Args:
          tokens: ``[B, T]`` int token ids.
          positions: ``[B, T]`` int position of each token (inside its packed segment).
          padding_mask: ``[B, T, T]`` bool, True where query t may attend key s beyond
            causality (packing segments, padding), or ``None`` (causal only). Each
            layer type adds its own sliding window.
          cache: a KV cache (:meth:`init_cache`): ``tokens`` are written at its write
            index, and ``padding_mask`` is then ``[B, T, cache_size]`` over its slots
            (``None``: each token sees every slot up to its own). Never rematerialised.
          embeds: ``[B, T, D]`` input embeddings used instead of ``tokens``' (a vision
            model's, with image soft tokens placed), or ``None``.
          blocks: ``[B, T]`` int32 image of each token (-1: not an image token;
            :func:`posttrain.layers.vision.image_blocks`): tokens of one image also see
            each other, later ones included; ``None``: causal only.

        Returns:
          ``(hidden [B, T, D] in cfg.dtype, moe_aux_loss)``: the load-balancing losses of
          the MoE layers summed (a float32 scalar, 0 for a dense model), unweighted; with
          a cache, also the updated cache. Layers run scanned per period of
          ``cfg.layer_types`` when ``cfg.scan_layers``, rematerialised per ``cfg.remat``.
        """
        cfg = self.cfg
        x = self.embed_tokens(tokens) if embeds is None else embeds
        x = sharding.constrain(x, sharding.ACTIVATION_AXES)
        if cache is not None:
            x, aux, cache = self._cached(x, positions, padding_mask, cache, blocks)
            return self.norm(x), aux, cache
        tables = self._tables(positions, padding_mask, blocks)
        if _UNROLLED.get():
            x, aux = self._call_unrolled(x, tables)
            return self.norm(x), aux
        policy = REMAT_POLICIES[cfg.remat]
        period = cfg.layer_period
        period_types = cfg.layer_types[:period]

        def run_period(x, states, graphdefs):
            aux = jnp.zeros((), jnp.float32)
            for graphdef, state, t in zip(graphdefs, states, period_types, strict=True):
                x, layer_aux = nnx.merge(graphdef, state)(x, *tables[t])
                aux = aux + layer_aux
            return x, aux

        if cfg.scan_layers:
            graphdefs, states = zip(*(nnx.split(b) for b in self.blocks), strict=True)

            def body(carry, states):
                return run_period(carry, states, graphdefs)

            if cfg.remat != "none":
                body = jax.checkpoint(body, policy=policy, prevent_cse=False)
            x, auxes = jax.lax.scan(body, x, tuple(states))
            aux = jnp.sum(auxes)
        else:
            aux = jnp.zeros((), jnp.float32)
            for i, layer in enumerate(self.layers):
                graphdef, state = nnx.split(layer)
                t = cfg.layer_types[i]

                def one(x, state, graphdef=graphdef, t=t):
                    copy = nnx.merge(graphdef, state)
                    return copy(x, *tables[t]), taps.sown(copy)

                if cfg.remat != "none":
                    one = jax.checkpoint(one, policy=policy)
                (x, layer_aux), sown = one(x, state)
                if taps.has_sown(sown):  # a strategy's wrapped tap ran in the copy
                    nnx.update(layer, sown)
                aux = aux + layer_aux
        return self.norm(x), aux


def _split_path(key: str) -> list[str]:
    return key.split(".")


def stack_layers(params: Mapping[str, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Unscanned flat params (``layers.{i}.<rest>``) -> scanned (``blocks.{p}.<rest>``).

    Args:
      params: flat dict, dotted path -> array; non-layer entries pass through.
      cfg: the model config (its ``layer_period`` P and ``num_layers`` L).

    Returns:
      A new flat dict where ``blocks.{p}.<rest>`` is ``[L / P, ...]``, stacking
      layers p, p + P, ... in order.
    """
    period = cfg.layer_period
    out: dict[str, np.ndarray] = {}
    grouped: dict[tuple[int, str], list[tuple[int, np.ndarray]]] = {}
    for key, value in params.items():
        parts = _split_path(key)
        if key.startswith(VISION_PREFIX):
            out[key] = value
        elif "layers" in parts and parts[parts.index("layers") + 1].isdigit():
            at = parts.index("layers")
            i = int(parts[at + 1])
            prefix = ".".join(parts[:at])
            rest = ".".join(parts[at + 2 :])
            grouped.setdefault((i % period, f"{prefix}|{rest}"), []).append((i, value))
        else:
            out[key] = value
    for (p, joined), items in grouped.items():
        prefix, rest = joined.split("|")
        items.sort(key=lambda item: item[0])
        name = ".".join(x for x in (prefix, "blocks", str(p), rest) if x)
        out[name] = np.stack([np.asarray(v) for _, v in items])
    return out


def unstack_layers(params: Mapping[str, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Inverse of :func:`stack_layers`."""
    period = cfg.layer_period
    out: dict[str, np.ndarray] = {}
    for key, value in params.items():
        parts = _split_path(key)
        if "blocks" in parts and parts[parts.index("blocks") + 1].isdigit():
            at = parts.index("blocks")
            p = int(parts[at + 1])
            for j, layer_value in enumerate(np.asarray(value)):
                name = ".".join(
                    x for x in (*parts[:at], "layers", str(j * period + p), *parts[at + 2 :]) if x
                )
                out[name] = layer_value
        else:
            out[key] = value
    return out
