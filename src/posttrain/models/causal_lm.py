"""``CausalLM``: the decoder plus the output head, in Tunix's model calling convention.

Tunix's default loss and sampler call ``model(input_tokens, positions, cache,
attention_mask)`` and unpack ``(logits, cache)`` (``tunix/sft/peft_trainer.py``
``_default_loss_fn``, tunix 0.0.2-0.1.7). :meth:`CausalLM.forward` also returns
the MoE load-balancing loss for our own trainer.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from posttrain import _compat, sharding
from posttrain.config import ModelConfig
from posttrain.layers.mlp import Linear
from posttrain.models.decoder import Decoder

LOGIT_AXES = ("activation_batch", "activation_length", "activation_vocab")


class CausalLM(nnx.Module):
    """Decoder-only causal language model built from a :class:`ModelConfig`.

    Parameters: ``model.*`` (see :class:`Decoder`) and ``lm_head.kernel``
    ``[d_model, vocab]`` (absent when ``tie_word_embeddings``).

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

    def forward(
        self,
        input_tokens: jax.Array,
        positions: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Logits and auxiliary outputs.

        Args:
          input_tokens: ``[batch, seq]`` int32 token ids.
          positions: ``[batch, seq]`` int32 positions; ``arange(seq)`` when None.
          attention_mask: ``[batch, seq, seq]`` bool, True where query t may see
            key s; combined with the causal (and sliding-window) mask. ``None``
            for plain causal.

        Returns:
          ``(logits [batch, seq, vocab] float32, {"moe_aux_loss": scalar float32})``;
          the aux loss is unweighted and summed over layers.
        """
        batch, seq = input_tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
        hidden, aux = self.model(input_tokens, positions, attention_mask)
        if self.lm_head is None:
            logits = self.model.embed_tokens.attend(hidden)
        else:
            logits = self.lm_head(hidden)
        logits = logits.astype(jnp.float32)  # [B, T, V]
        cap = self.config.final_logit_softcap
        if cap is not None:
            logits = cap * jnp.tanh(logits / cap)
        return sharding.constrain(logits, LOGIT_AXES), {"moe_aux_loss": aux}

    def __call__(
        self,
        input_tokens: jax.Array,
        positions: jax.Array | None = None,
        cache: Any = None,
        attention_mask: jax.Array | None = None,
    ) -> tuple[jax.Array, Any]:
        """Tunix convention: returns ``(logits [batch, seq, vocab] float32, cache)``.

        Raises:
          NotImplementedError: ``cache`` is not None (KV-cache decoding is not
            implemented yet).
        """
        if cache is not None:
            raise NotImplementedError(
                "KV-cache decoding is not implemented; call CausalLM with cache=None"
            )
        logits, _ = self.forward(input_tokens, positions, attention_mask)
        return logits, None
