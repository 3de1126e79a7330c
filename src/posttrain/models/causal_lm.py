"""``CausalLM``: the decoder plus the output head, in Tunix's model calling convention.

Tunix's default loss and sampler call ``model(input_tokens, positions, cache,
attention_mask)`` and unpack ``(logits, cache)`` (``tunix/sft/peft_trainer.py``
``_default_loss_fn``, tunix 0.0.2-0.1.7). :meth:`CausalLM.forward` also returns
the MoE load-balancing loss for our own trainer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from posttrain import _compat, sharding
from posttrain.config import ModelConfig
from posttrain.layers.mlp import Linear
from posttrain.layers.vision import (
    ImageBatch,
    VisionProjector,
    VisionTower,
    image_blocks,
    place_image_features,
)
from posttrain.models.decoder import Decoder

LOGIT_AXES = ("activation_batch", "activation_length", "activation_vocab")


class CausalLM(nnx.Module):
    """Decoder-only causal language model built from a :class:`ModelConfig`.

    Parameters: ``model.*`` (see :class:`Decoder`) and ``lm_head.kernel``
    ``[d_model, vocab]`` (absent when ``tie_word_embeddings``); with ``cfg.vision``,
    ``vision_tower.*`` and ``embed_vision.*`` (:mod:`posttrain.layers.vision`).

    Attributes:
      config: the model config.
      lora_config: the ``posttrain.lora.LoraConfig`` of the adapters when
        ``posttrain.lora.apply_lora`` added them, else None.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        self.lora_config = None
        self.model = Decoder(cfg, rngs=rngs)
        dtype, param_dtype = _compat.module_dtypes(cfg)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else Linear(
                cfg.d_model,
                cfg.vocab_size,
                ("embed", "vocab"),
                rngs=rngs,
                dtype=dtype,
                param_dtype=param_dtype,
            )
        )
        vision = cfg.vision
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.vision_tower = None if vision is None else VisionTower(vision, **kw)
        self.embed_vision = None if vision is None else VisionProjector(vision, cfg.d_model, **kw)

    def init_cache(self, batch: int, cache_size: int, dtype=None) -> dict:
        """An empty KV cache (Tunix's ``init_cache`` signature): ``batch`` rows of
        ``cache_size`` slots in ``dtype`` (default ``config.dtype``). Layout and memory:
        :mod:`posttrain.layers.kv_cache`."""
        return self.model.init_cache(batch, cache_size, dtype or self.config.dtype)

    def embed_with_images(self, input_tokens: jax.Array, images: ImageBatch) -> jax.Array:
        """Token embeddings ``[batch, seq, d_model]`` with each row's image soft tokens at its
        ``image_token_id`` positions (HF ``Gemma4Model.forward``; image tokens embed as
        token 0 first, as HF embeds them as the pad token).

        Raises:
          ValueError: the model has no vision tower.
        """
        if self.vision_tower is None:
            raise ValueError("images given to a model without a vision tower (config.vision=None)")
        is_image = input_tokens == self.config.vision.image_token_id  # [B, T]
        embeds = self.model.embed_tokens(jnp.where(is_image, 0, input_tokens))  # [B, T, D]
        features, valid = self.vision_tower(images)  # [B, I, L, D_v], [B, I, L]
        features = self.embed_vision(features)  # [B, I, L, D]
        batch = features.shape[0]
        features = features.reshape(batch, -1, features.shape[-1])  # [B, I*L, D]
        return place_image_features(embeds, is_image, features, valid.reshape(batch, -1))

    def logits(self, hidden: jax.Array) -> jax.Array:
        """The output head: final-normed hidden states ``[batch, seq, d_model]`` (``seq`` any
        length: a chunk of a sequence too) -> float32 logits ``[batch, seq, vocab]``: ``lm_head``
        (or the tied embedding's ``attend``) in the compute dtype, cast to float32, Gemma's
        ``final_logit_softcap`` (``cap * tanh(logits / cap)``), and the :data:`LOGIT_AXES`
        constraint (vocabulary over ``tensor``). Qwix's LoRA adapters apply to ``lm_head``
        only while :meth:`forward` runs (Qwix intercepts it): call this through
        ``forward``'s ``head``, not directly, when they may; and, inside a JAX transform
        (a scan over chunks), on a copy of the model merged in that trace (Qwix sets an
        attribute on the adapted module, which Flax refuses across trace levels).
        """
        if self.lm_head is None:
            logits = self.model.embed_tokens.attend(hidden)
        else:
            logits = self.lm_head(hidden)
        logits = logits.astype(jnp.float32)  # [B, T, V]
        cap = self.config.final_logit_softcap
        if cap is not None:
            logits = cap * jnp.tanh(logits / cap)
        return sharding.constrain(logits, LOGIT_AXES)

    def forward(
        self,
        input_tokens: jax.Array,
        positions: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
        cache: Any = None,
        last_only: bool = False,
        images: ImageBatch | None = None,
        head: Callable[[jax.Array, CausalLM], Any] | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        """Logits and auxiliary outputs (LoRA's adapters apply here: Qwix wraps ``forward``).

        Args:
          input_tokens: ``[batch, seq]`` int32 token ids.
          positions: ``[batch, seq]`` int32 positions; ``arange(seq)`` when None.
          attention_mask: ``[batch, seq, seq]`` bool, True where query t may see
            key s; combined with the causal (and sliding-window) mask. ``None``
            for plain causal. With a cache: ``[batch, seq, cache_size]`` over its slots.
          cache: a KV cache (:meth:`init_cache`); see :meth:`__call__`.
          last_only: the logits of the last position only (``[batch, 1, vocab]``): a
            prefill that samples from the last token skips the vocabulary projection
            of the rest of the prompt (with left-padded prompts, every row's last token).
          images: the rows' images (:class:`posttrain.layers.vision.ImageBatch`), placed at
            the image tokens (:meth:`embed_with_images`); ``None`` for text only.
          head: called as ``head(hidden, self)`` in place of ``self.logits(hidden)``, with
            the final-normed hidden states ``[batch, seq, d_model]`` (``[batch, 1,
            d_model]`` with ``last_only``) in the compute dtype; its result replaces the
            logits. Inside ``forward``, so that a loss projecting the hidden states a chunk
            at a time (:func:`posttrain.training.chunked_loss.chunked_nll`) still gets
            Qwix's adapters on a LoRA-targeted ``lm_head``. ``None``: the logits.

        Returns:
          ``(logits [batch, seq, vocab] float32, aux)`` (``head``'s result in place of the
          logits when given): ``aux["moe_aux_loss"]`` a float32 scalar, unweighted and summed
          over layers; with a cache, ``aux["cache"]`` the updated cache.
        """
        batch, seq = input_tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
        embeds = None if images is None else self.embed_with_images(input_tokens, images)
        blocks = None  # images seen bidirectionally (VisionConfig.bidirectional)
        if images is not None and self.config.vision.bidirectional:
            blocks = image_blocks(input_tokens, self.config.vision.image_token_id)  # [B, T]
        kw = {"embeds": embeds, "blocks": blocks}
        if cache is None:
            hidden, aux = self.model(input_tokens, positions, attention_mask, **kw)
            out = {"moe_aux_loss": aux}
        else:
            hidden, aux, cache = self.model(input_tokens, positions, attention_mask, cache, **kw)
            out = {"moe_aux_loss": aux, "cache": cache}
        hidden = hidden[:, -1:] if last_only else hidden  # [B, T or 1, D]
        return (self.logits(hidden) if head is None else head(hidden, self)), out

    def __call__(
        self,
        input_tokens: jax.Array,
        positions: jax.Array | None = None,
        cache: Any = None,
        attention_mask: jax.Array | None = None,
        decode_only_last_token: bool = False,
        images: ImageBatch | None = None,
    ) -> tuple[jax.Array, Any]:
        """Tunix's calling convention: ``(logits [batch, seq, vocab] float32, cache)``.

        Without a cache, :meth:`forward`'s logits and ``None``. With one (from
        :meth:`init_cache`), ``input_tokens`` are written at its write index and
        ``attention_mask`` is ``[batch, seq, cache_size]`` over its slots (``None``: each
        token sees every slot up to its own); returns the updated cache.
        ``decode_only_last_token``: logits ``[batch, 1, vocab]`` of the last position
        only (``forward``'s ``last_only``). google-tunix >= 0.1.7's ``Sampler`` passes it
        to the prefill when this signature has it (``inspect.signature``), unless it
        echoes the prompt's logits; older releases never pass it. ``images``: as in
        :meth:`forward`.
        """
        logits, aux = self.forward(
            input_tokens,
            positions,
            attention_mask,
            cache,
            last_only=decode_only_last_token,
            images=images,
        )
        return logits, aux.get("cache")
