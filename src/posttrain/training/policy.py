"""Our :class:`~posttrain.models.CausalLM` in the shape Tunix's RL stack takes, and its
reference model.

:class:`TunixPolicy` is what ``RLCluster`` holds as the actor, the reference and the
rollout model. It adds nothing to the computation; it exists for three reads that
Tunix makes and ``CausalLM`` cannot serve as it is:

- ``config.num_layers`` / ``config.num_kv_heads`` / ``config.head_dim``: every release's
  ``RLCluster`` reads them unconditionally for its ``CacheConfig``
  (``shared/research/tunix-rl.md`` 3.1), but our config keeps the last two per layer type
  (Gemma 4's full layers differ). :class:`ConfigView` answers them from the first layer
  type (only Tunix's deprecated fallback cache would use them, and
  :meth:`TunixPolicy.init_cache` always replaces it) and forwards every other field.
- (The MoE load-balancing term, which Tunix's logits-only losses drop, is added by
  :func:`posttrain.rl.tunix_rl.with_moe_aux_loss`.)

The reference (:func:`reference_of`) is the actor with its adapters off when it has LoRA
(the base weights are shared, not copied), else a frozen copy.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain import _compat
from posttrain.config import ModelConfig
from posttrain.lora.layout import LORA_B


@dataclasses.dataclass(frozen=True)
class ConfigView:
    """A :class:`~posttrain.config.ModelConfig` with Tunix's flat cache fields.

    ``num_kv_heads`` and ``head_dim`` are the first layer type's
    (``config.attention[config.layer_types[0]]``); every other attribute is the
    config's own.
    """

    config: ModelConfig

    @property
    def num_kv_heads(self) -> int:
        return self.config.attention[self.config.layer_types[0]].num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.config.attention[self.config.layer_types[0]].head_dim

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.config, name)


class TunixPolicy(nnx.Module):
    """``model`` behind Tunix's calling convention, with :class:`ConfigView` as ``config``.

    Args:
      model: a :class:`~posttrain.models.CausalLM`, LoRA or QLoRA adapters included.

    Attributes:
      model: the wrapped model (its parameters are the policy's, under ``model``).
      config: :class:`ConfigView` of ``model.config``.
    """

    def __init__(self, model: nnx.Module):
        self.model = model
        self.config = ConfigView(model.config)

    def init_cache(self, batch: int, cache_size: int, dtype=None) -> dict:
        """:meth:`CausalLM.init_cache <posttrain.models.CausalLM.init_cache>`."""
        return self.model.init_cache(batch, cache_size, dtype)

    def __call__(
        self,
        input_tokens: jax.Array,
        positions: jax.Array | None = None,
        cache: Any = None,
        attention_mask: jax.Array | None = None,
        decode_only_last_token: bool = False,
    ) -> tuple[jax.Array, Any]:
        """``CausalLM.__call__``: ``(logits [batch, seq, vocab] float32, cache or None)``.
        The parameter names and order are the ones Tunix's sampler binds (positional up to
        google-tunix 0.1.5, keywords from 0.1.6); ``decode_only_last_token`` (probed by
        0.1.7+'s sampler, so rollouts prefill with the last position's logits only) as
        ``CausalLM.__call__``'s."""
        logits, aux = self.model.forward(
            input_tokens, positions, attention_mask, cache, last_only=decode_only_last_token
        )
        return logits, aux.get("cache")


def has_lora(model: nnx.Module) -> bool:
    """Whether ``model`` holds LoRA parameters (``nnx.LoRAParam``)."""
    return bool(jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))


def reference_of(model: nnx.Module) -> nnx.Module:
    """The reference policy of ``model`` (a ``CausalLM``).

    With LoRA (or QLoRA): the same graph with every ``*_lora_b`` set to zero, so each
    adapted projection adds ``x A 0 = 0`` and the output is the base model's. Its base
    (and quantised) weights are the actor's arrays themselves, not copies: LoRA training
    never writes them and Tunix donates only the optimizer state, so they stay valid.
    Without LoRA: a frozen copy (its own buffers; the actor's are replaced every step).
    """
    graphdef, state = nnx.split(model)
    if has_lora(model):

        def zero_b(path, var):
            name = str(path[-1])
            if isinstance(var, nnx.LoRAParam) and name.endswith(LORA_B):
                return var.replace(_placed_like(_compat.variable_value(var), zero=True))
            return var

        flat = [(p, zero_b(p, v)) for p, v in nnx.to_flat_state(state)]
        return nnx.merge(graphdef, nnx.from_flat_state(flat))
    return nnx.merge(graphdef, jax.tree.map(_placed_like, state))


def _placed_like(value: jax.Array, zero: bool = False) -> jax.Array:
    """A copy of ``value`` (or zeros) with its sharding: ``jnp.zeros_like`` and
    ``jnp.copy`` keep it in recent JAX but put the result on one device in jax 0.7
    (found by the matrix's era rows: the reference then failed every jitted step)."""
    fresh = np.zeros(value.shape, value.dtype) if zero else jnp.copy(value)
    return jax.device_put(fresh, value.sharding)
