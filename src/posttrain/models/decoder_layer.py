"""One decoder layer: attention then MLP (dense, MoE, or both), pre-norm or sandwich-norm.

Data flow (``x`` enters, B batch, T seq, D d_model):

* pre-norm (Llama 3, Qwen3, Qwen3-MoE, Mixtral, GPT-OSS; HF ``LlamaDecoderLayer``):
  ``h = x + attn(input_layernorm(x))``; ``out = h + mlp(post_attention_layernorm(h))``.
* sandwich (Gemma 4; HF ``Gemma4TextDecoderLayer``):
  ``r = x + post_attention_layernorm(attn(input_layernorm(x)))``;
  dense only: ``out = r + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(r)))``;
  dense + MoE: ``d = post_feedforward_layernorm_1(mlp(pre_feedforward_layernorm(r)))``,
  ``e = post_feedforward_layernorm_2(moe(pre_feedforward_layernorm_2(r), router_input=r))``,
  ``out = r + post_feedforward_layernorm(d + e)``; then ``out *= layer_scalar``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from posttrain import _compat, sharding
from posttrain.config import ModelConfig
from posttrain.layers.attention import Attention
from posttrain.layers.mlp import MLP
from posttrain.layers.moe import MoEBlock
from posttrain.layers.norms import RMSNorm
from posttrain.models.taps import AttentionOutput, LayerOutput


class DecoderLayer(nnx.Module):
    """A decoder layer of type ``layer_type`` (``full`` or ``sliding``) of ``cfg``.

    ``__call__(x [B, T, D], cos, sin [B, T, H] float32, mask [B, T, T] bool)``
    returns ``(out [B, T, D], moe_aux_loss scalar float32)`` (0 for dense layers).
    """

    def __init__(self, cfg: ModelConfig, layer_type: str, *, rngs: nnx.Rngs):
        dtype, param_dtype = _compat.module_dtypes(cfg)
        self.sandwich = cfg.sandwich_norm
        self.has_dense_and_moe = cfg.dense_mlp_with_moe

        def norm():
            return RMSNorm(
                cfg.d_model, eps=cfg.norm_eps, rngs=rngs, dtype=dtype, param_dtype=param_dtype
            )

        mlp_kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.input_layernorm = norm()
        self.self_attn = Attention(
            cfg.d_model,
            cfg.attention[layer_type],
            norm_eps=cfg.norm_eps,
            rngs=rngs,
            dtype=dtype,
            param_dtype=param_dtype,
            # images seen bidirectionally open keys after a query (models.layer_inputs)
            causal=cfg.vision is None or not cfg.vision.bidirectional,
        )
        self.post_attention_layernorm = norm()
        dense = (
            MLP(cfg.d_model, cfg.d_ff, cfg.activation_config, use_bias=cfg.mlp_bias, **mlp_kw)
            if (cfg.moe is None or cfg.dense_mlp_with_moe)
            else None
        )
        moe = (
            MoEBlock(
                cfg.d_model,
                cfg.moe,
                cfg.activation_config,
                norm_eps=cfg.norm_eps,
                **mlp_kw,
            )
            if cfg.moe is not None
            else None
        )
        if cfg.dense_mlp_with_moe:
            self.mlp, self.moe = dense, moe
        else:
            self.mlp, self.moe = (dense if moe is None else moe), None
        if cfg.sandwich_norm:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()
        if cfg.dense_mlp_with_moe:
            self.post_feedforward_layernorm_1 = norm()
            self.pre_feedforward_layernorm_2 = norm()
            self.post_feedforward_layernorm_2 = norm()
        self.layer_scalar = (
            sharding.param(rngs, nnx.initializers.ones, (1,), (None,), param_dtype)
            if cfg.layer_scalar
            else None
        )
        # identity taps a distillation strategy may wrap (posttrain.models.taps)
        self.attention_output = AttentionOutput()
        self.layer_output = LayerOutput()

    def _mlp(self, h: jax.Array) -> tuple[jax.Array, jax.Array]:
        if isinstance(self.mlp, MoEBlock):
            return self.mlp(h)
        return self.mlp(h), jnp.zeros((), jnp.float32)

    def __call__(self, x, cos, sin, mask, cache=None):
        """``(out [B, T, D], moe_aux_loss)``; with a ``cache`` (this layer's KV cache,
        :mod:`posttrain.layers.kv_cache`) ``(out, moe_aux_loss, updated cache)``."""
        if cache is None:
            attn = self.attention_output(self.self_attn(self.input_layernorm(x), cos, sin, mask))
            out, aux = self._residual(x, attn)
            return self.layer_output(out), aux
        attn, cache = self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        return (*self._residual(x, attn), cache)

    def _residual(self, x, attn):
        if not self.sandwich:
            h = sharding.constrain(x + attn, sharding.ACTIVATION_AXES)
            y, aux = self._mlp(self.post_attention_layernorm(h))
            return sharding.constrain(h + y, sharding.ACTIVATION_AXES), aux
        r = sharding.constrain(x + self.post_attention_layernorm(attn), sharding.ACTIVATION_AXES)
        if self.has_dense_and_moe:
            d = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(r)))
            e, aux = self.moe(self.pre_feedforward_layernorm_2(r), router_input=r)
            y = d + self.post_feedforward_layernorm_2(e)
        else:
            y, aux = self._mlp(self.pre_feedforward_layernorm(r))
        out = r + self.post_feedforward_layernorm(y)
        if self.layer_scalar is not None:
            out = out * self.layer_scalar[...].astype(out.dtype)
        return sharding.constrain(out, sharding.ACTIVATION_AXES), aux
