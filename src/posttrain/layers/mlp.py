"""Gated feed-forward block and the gated activations shared with the MoE experts.

Reference: HF ``LlamaMLP`` (SiLU(gate) * up -> down), ``Gemma4TextMLP``
(GELU-tanh), ``GptOssExperts._apply_gate`` (clamped SwiGLU), transformers 5.24.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from flax import nnx

from posttrain import _compat, sharding
from posttrain.config import ActivationConfig

_KERNEL_INIT = nnx.initializers.lecun_normal()
_QWIX_PASS = contextvars.ContextVar("posttrain_qwix_pass", default=False)
CLIP_BOUNDS = ("input_min", "input_max", "output_min", "output_max")


def add_clip_bounds(module: nnx.Module, clipped: bool, rngs: nnx.Rngs, param_dtype) -> None:
    """Gives a projection HF ``Gemma4ClippableLinear``'s bounds: scalar params
    ``input_min``, ``input_max``, ``output_min``, ``output_max`` (-inf/+inf until loaded:
    no clamp), or ``None`` each when not ``clipped``."""
    for name in CLIP_BOUNDS:
        bound = -jnp.inf if name.endswith("min") else jnp.inf
        init = nnx.initializers.constant(bound)
        setattr(module, name, sharding.param(rngs, init, (), (), param_dtype) if clipped else None)


def clip(x: jax.Array, low, high) -> jax.Array:
    """``x`` clamped to the scalar params ``[low, high]``; unchanged when they are ``None``.

    Reference: ``Gemma4ClippableLinear.forward`` (transformers 5.12.1), which clamps the
    input before and the output after the matmul."""
    if low is None:
        return x
    return jnp.clip(x, low[...].astype(x.dtype), high[...].astype(x.dtype))


def kernel_value(kernel, dtype):
    """The value of weight ``kernel`` (an ``nnx.Param``) in ``dtype``, for a matmul.

    QLoRA replaces a quantised weight by Qwix's ``WithAux`` wrapper (not a
    ``Variable``); it is returned uncast (its ``astype`` fails), as the module holds
    it on qwix >= 0.1.6, which finds the weight by the wrapper's identity
    (same-shaped weights such as the experts' gate and up are otherwise ambiguous),
    and with unboxed leaves before (:func:`posttrain._compat.quantised_weight`). A
    value already in ``dtype`` is not cast. So QLoRA needs ``dtype == param_dtype``.
    """
    if not isinstance(kernel, nnx.Variable):
        return _compat.quantised_weight(kernel)
    value = kernel[...]
    return value if value.dtype == dtype else value.astype(dtype)


@contextlib.contextmanager
def qwix_pass() -> Iterator[None]:
    """Marks a Qwix pass (QLoRA's quantisation, LoRA's initialisation: ``posttrain.lora``),
    in which every projection hands Qwix its weight as the einsum's operand
    (:func:`qwix_may_intercept`)."""
    token = _QWIX_PASS.set(True)
    try:
        yield
    finally:
        _QWIX_PASS.reset(token)


def qwix_may_intercept(module: nnx.Module) -> bool:
    """Whether Qwix may intercept ``module``'s matmul, and so must find the weight itself as
    the operand of ``jnp.einsum`` (it matches operands to weights by identity): inside
    :func:`qwix_pass`, or once the module holds LoRA adapters (``nnx.LoRAParam``; a
    quantised weight is no array at all, :func:`kernel_value`)."""
    return _QWIX_PASS.get() or any(isinstance(v, nnx.LoRAParam) for v in vars(module).values())


def token_einsum(spec: str, x: jax.Array, kernel) -> jax.Array:
    """``jnp.einsum(spec, x, kernel)`` with ``x``'s token dims merged into one.

    ``spec`` begins its first operand and its output with ``...``, the token dims
    (``[B, T]`` or ``[T]``), e.g. ``"...d,dnh->...nh"``: ``x`` ``[B, T, *in]`` is reshaped
    to ``[B*T, *in]``, contracted with ``kernel``, and the result reshaped back to
    ``[B, T, *out]``; the einsum's dtype. The tokens are left as they are when the current
    mesh shards the sequence (:func:`posttrain.sharding.sequence_sharded`: merging an
    unsharded batch with a sharded sequence would reshard).

    Why: the weight gradient of an einsum over ``[B, T]`` contracts two token dims. XLA's
    CPU compiler lowers it through a transposing copy of the output gradient (``[F, B*T]``)
    with the activation's backward fused in, which reads its inputs strided by F; with one
    token dim the dot reads both operands in place. The dense training step was 0.75x as
    long with the merge (``benchmarks/model_ab.py --form tokens``, docs/benchmarks.md); the
    products are the same, summed in another order.
    """
    features = len(spec.partition(",")[0]) - 3  # the dims after "..."
    lead = x.shape[: x.ndim - features]
    if len(lead) < 2 or sharding.sequence_sharded():
        return jnp.einsum(spec, x, kernel)
    y = jnp.einsum(spec, x.reshape(-1, *x.shape[len(lead) :]), kernel)  # "..." is [B*T]
    return y.reshape(*lead, *y.shape[1:])


def gated_activation(gate: jax.Array, up: jax.Array, act: ActivationConfig) -> jax.Array:
    """Combines gate and up projections ``[..., d_ff]`` into the hidden ``[..., d_ff]``.

    Args:
      gate, up: same shape and dtype.
      act: ``act.kind`` ``silu`` -> silu(gate) * up; ``gelu_tanh`` -> gelu_tanh(gate) * up;
        ``clamped_swiglu`` (GPT-OSS, HF ``GptOssExperts._apply_gate``) -> gate clipped above
        at ``act.swiglu_limit``, up to [-limit, limit], then
        (up + 1) * gate * sigmoid(``act.swiglu_alpha`` * gate).
    """
    if act.kind == "silu":
        return jax.nn.silu(gate) * up
    if act.kind == "gelu_tanh":
        return jax.nn.gelu(gate, approximate=True) * up
    limit = act.swiglu_limit
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * gate * jax.nn.sigmoid(act.swiglu_alpha * gate)


class Linear(nnx.Module):
    """``y = x @ kernel (+ bias)`` with logical axes on both parameters.

    Args:
      in_dim, out_dim: kernel is ``[in_dim, out_dim]``.
      axes: logical names of (in, out).
      use_bias: adds ``bias`` ``[out_dim]`` with logical axis ``axes[1]``.
      clipped: clamps input and output to learned bounds (:func:`add_clip_bounds`).
    """

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        axes,
        *,
        use_bias: bool = False,
        rngs: nnx.Rngs,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        clipped: bool = False,
    ):
        self.dtype = dtype
        self.kernel = sharding.param(
            rngs, _KERNEL_INIT, (in_dim, out_dim), tuple(axes), param_dtype
        )
        add_clip_bounds(self, clipped, rngs, param_dtype)
        self.bias = (
            sharding.param(rngs, nnx.initializers.zeros, (out_dim,), (axes[1],), param_dtype)
            if use_bias
            else None
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        x = clip(x.astype(self.dtype), self.input_min, self.input_max)
        y = token_einsum("...i,io->...o", x, kernel_value(self.kernel, self.dtype))
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return clip(y, self.output_min, self.output_max)


class MLP(nnx.Module):
    """Gated MLP: ``down(act(gate(x), up(x)))``, ``[B, T, D] -> [B, T, D]``.

    Parameters ``gate_proj.kernel`` / ``up_proj.kernel`` ``[d_model, d_ff]``
    (embed, mlp) and ``down_proj.kernel`` ``[d_ff, d_model]`` (mlp, embed).
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        activation: ActivationConfig,
        *,
        use_bias: bool = False,
        rngs: nnx.Rngs,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        clipped: bool = False,
    ):
        self.activation = activation
        kw = dict(
            use_bias=use_bias, rngs=rngs, dtype=dtype, param_dtype=param_dtype, clipped=clipped
        )
        self.gate_proj = Linear(d_model, d_ff, ("embed", "mlp"), **kw)
        self.up_proj = Linear(d_model, d_ff, ("embed", "mlp"), **kw)
        self.down_proj = Linear(d_ff, d_model, ("mlp", "embed"), **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        hidden = gated_activation(self.gate_proj(x), self.up_proj(x), self.activation)
        hidden = sharding.constrain(
            hidden, ("activation_batch", "activation_length", "activation_mlp")
        )
        return self.down_proj(hidden)
