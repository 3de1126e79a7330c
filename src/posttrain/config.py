"""Model configuration: frozen keyword-only dataclasses that validate themselves.

Dimension legend (STYLE.md): B batch, T seq, D d_model, N num_heads,
K num_kv_heads, H head_dim, F d_ff / moe_d_ff, E num_experts, R top_k,
V vocab_size, L num_layers.

HF names (``hidden_size``, ``intermediate_size``, ``num_local_experts`` ...)
are translated in one place, ``posttrain.conversion`` (``from_hf_config``); this
module only uses the field's standard terms.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Mapping
from typing import Literal

from posttrain.moe_config import MoEAlgorithm as MoEAlgorithm  # re-exported with MoEConfig
from posttrain.moe_config import MoEConfig as MoEConfig  # ModelConfig.moe's type
from posttrain.vision_config import VisionConfig as VisionConfig  # ModelConfig.vision's type

RopeKind = Literal["default", "llama3", "yarn", "proportional"]
LayerType = Literal["full", "sliding"]
Activation = Literal["silu", "gelu_tanh", "clamped_swiglu"]
RematPolicy = Literal["none", "full", "save_dots"]
#: the kernels a user picks (``--attention-kernel``); ``splash_interpret`` is for tests
AttentionKernelChoice = Literal["xla", "splash"]
AttentionKernel = Literal[AttentionKernelChoice, "splash_interpret"]

# The largest num_layers a config may name. The deepest published decoders have about
# 126 (Llama 3.1 405B); the bound keeps a malformed config (12,000,000,000 layers, found
# by tests/test_fuzz_inputs.py) from allocating its per-layer tables before any check.
MAX_NUM_LAYERS = 10_000
#: The largest model dimension: token ids, positions and gather indices are int32 (#56 7).
MAX_DIM = 2**31 - 1


def _fail(message: str) -> None:
    raise ValueError(message)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeConfig:
    """Rotary position embedding, half-split ("rotate_half", NeoX) layout.

    Attributes:
      kind: ``default`` (theta^(-2i/H)); ``llama3`` (Llama 3.1 band scaling,
        HF ``_compute_llama3_parameters``); ``yarn`` (YaRN, Peng et al. 2023,
        HF ``_compute_yarn_parameters``); ``proportional`` (Gemma 4: only the
        first ``floor(partial_rotary_factor * H / 2)`` frequencies rotate, HF
        ``_compute_proportional_rope_parameters``).
      theta: base of the frequencies.
      factor: context extension factor (llama3, yarn).
      low_freq_factor, high_freq_factor: llama3 band edges.
      original_max_position_embeddings: pre-extension context length (llama3, yarn).
      beta_fast, beta_slow: yarn correction range, in rotations.
      truncate: yarn rounds the correction range to integers when true.
      partial_rotary_factor: fraction of head_dim that rotates (proportional).
    """

    kind: RopeKind = "default"
    theta: float = 10_000.0
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    partial_rotary_factor: float = 1.0

    def __post_init__(self):
        if self.kind not in ("default", "llama3", "yarn", "proportional"):
            _fail(f"rope kind={self.kind!r} must be one of default, llama3, yarn, proportional")
        if self.theta <= 0:
            _fail(f"rope theta={self.theta} must be > 0")
        if self.factor <= 0:
            _fail(f"rope factor={self.factor} must be > 0")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            _fail(f"partial_rotary_factor={self.partial_rotary_factor} must be in (0, 1]")
        if self.partial_rotary_factor != 1.0 and self.kind != "proportional":
            _fail(
                f"partial_rotary_factor={self.partial_rotary_factor} is only supported "
                f"with kind='proportional', got kind={self.kind!r}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionConfig:
    """Grouped-query attention of one layer type.

    Attributes:
      num_heads: query heads N.
      num_kv_heads: key/value heads K; N must divide by K (query head h reads
        KV head h // (N/K), HF ``repeat_kv``).
      head_dim: H.
      rope: rotary embedding of q and k.
      sliding_window: W keys visible to each query, itself included (HF tests
        ``kv > q - W``); ``None`` for full attention.
      qk_norm: per-head RMSNorm with a learned scale on q and k before RoPE (Qwen3, Gemma 4).
      v_norm: RMSNorm without a scale on v (Gemma 4).
      k_eq_v: v is the k projection before k_norm and RoPE; no v_proj (Gemma 4 full layers).
      bias: biases on q/k/v/o projections (GPT-OSS).
      sinks: one learned sink logit per query head joins the softmax (GPT-OSS).
      scale: attention logit scale; ``None`` means head_dim^-1/2 (Gemma 4 uses 1.0).
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: RopeConfig = RopeConfig()
    sliding_window: int | None = None
    qk_norm: bool = False
    v_norm: bool = False
    k_eq_v: bool = False
    bias: bool = False
    sinks: bool = False
    scale: float | None = None

    def __post_init__(self):
        for name in ("num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                _fail(f"{name}={getattr(self, name)} must be >= 1")
        if self.num_heads % self.num_kv_heads:
            _fail(
                f"num_heads={self.num_heads} must be divisible by num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            _fail(f"head_dim={self.head_dim} must be even for half-split RoPE")
        if self.sliding_window is not None and self.sliding_window < 1:
            _fail(f"sliding_window={self.sliding_window} must be >= 1 or None")

    @property
    def logit_scale(self) -> float:
        return self.head_dim**-0.5 if self.scale is None else self.scale


def choices(literal) -> tuple[str, ...]:
    """The values of a ``Literal`` type, e.g. ``choices(RematPolicy)`` for a CLI's ``choices=``."""
    return typing.get_args(literal)


@dataclasses.dataclass(frozen=True)
class ActivationConfig:
    """The gated-MLP nonlinearity of the dense MLP and of the routed and shared experts
    (:func:`posttrain.layers.mlp.gated_activation`); built by
    :attr:`ModelConfig.activation_config`.

    Attributes:
      kind: ``silu`` (SwiGLU), ``gelu_tanh`` (GeGLU) or ``clamped_swiglu`` (GPT-OSS).
      swiglu_alpha, swiglu_limit: the clamped SwiGLU's constants (ignored by the others).

    Raises:
      ValueError: an unknown ``kind``.
    """

    kind: Activation
    swiglu_alpha: float
    swiglu_limit: float

    def __post_init__(self):
        if self.kind not in choices(Activation):
            _fail(f"activation={self.kind!r} must be one of {', '.join(choices(Activation))}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A decoder-only causal LM.

    Attributes:
      family: the family name (``posttrain.families``: presets, conversion table, messages).
      vocab_size: V.
      d_model: D.
      num_layers: L, 1 to :data:`MAX_NUM_LAYERS`.
      d_ff: dense MLP width F; ``0`` when layers have no dense MLP.
      layer_types: one of ``full``/``sliding`` per layer; defaults to all full.
        The period of this pattern is the unit of layer scanning.
      attention: attention config per layer type present in ``layer_types``.
      activation: ``silu`` (SwiGLU), ``gelu_tanh`` (GeGLU) or ``clamped_swiglu``
        (GPT-OSS: gate clamped above at ``swiglu_limit``, up clamped to
        +-limit, (up + 1) * gate * sigmoid(swiglu_alpha * gate)).
      swiglu_alpha, swiglu_limit: the clamped SwiGLU's constants; the defaults are
        HF ``GptOssExperts``' (``alpha = 1.702``, ``limit = 7.0``, transformers 5.12.1).
      mlp_bias: biases on dense MLP projections.
      moe: MoE config; ``None`` for a dense model.
      dense_mlp_with_moe: Gemma 4 layer: a dense MLP runs beside the experts,
        with sandwich norms (``post_feedforward_layernorm_1/2``).
      norm_eps: RMSNorm epsilon.
      sandwich_norm: normalise each sub-block's output before the residual add
        (Gemma 4 ``post_attention_layernorm`` / ``post_feedforward_layernorm``).
      layer_scalar: a learned scalar multiplying each layer's output (Gemma 4).
      embed_scale: multiply embeddings by sqrt(d_model) (Gemma).
      final_logit_softcap: c in c * tanh(logits / c); ``None`` for none.
      tie_word_embeddings: logits use the embedding table transposed.
      scan_layers: stack layers and run them with ``jax.lax.scan``.
      remat: ``none``, ``full`` (save nothing) or ``save_dots`` (save matmul
        outputs without batch dims, ``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``).
      attention_kernel: ``xla`` (scores materialised, any backend), ``splash`` (JAX's
        Pallas splash attention, a flash kernel: TPU only, :mod:`posttrain.layers.splash`)
        or ``splash_interpret`` (the same kernel run by Pallas' interpreter on any
        backend: tests on a CPU, slow).
      dtype: activation dtype name; param_dtype: parameter dtype name.
      vision: an image encoder and its projection into the embeddings (Gemma 4);
        ``None`` for a text-only model.
    """

    family: str = "custom"
    vocab_size: int
    d_model: int
    num_layers: int
    d_ff: int = 0
    layer_types: tuple[LayerType, ...] = ()
    attention: Mapping[LayerType, AttentionConfig]
    activation: Activation = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    mlp_bias: bool = False
    moe: MoEConfig | None = None
    dense_mlp_with_moe: bool = False
    norm_eps: float = 1e-6
    sandwich_norm: bool = False
    layer_scalar: bool = False
    embed_scale: bool = False
    final_logit_softcap: float | None = None
    tie_word_embeddings: bool = False
    scan_layers: bool = False
    remat: RematPolicy = "none"
    attention_kernel: AttentionKernel = "xla"
    dtype: str = "float32"
    param_dtype: str = "float32"
    vision: VisionConfig | None = None

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "num_layers"):
            if getattr(self, name) < 1:
                _fail(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("vocab_size", "d_model", "d_ff"):
            if getattr(self, name) > MAX_DIM:
                _fail(
                    f"{name}={getattr(self, name)}: expected at most {MAX_DIM} (2**31 - 1: int32)"
                )
        if not (math.isfinite(self.norm_eps) and self.norm_eps > 0):  # NaN: every norm NaN
            _fail(f"norm_eps={self.norm_eps}: expected a finite number > 0")
        if self.num_layers > MAX_NUM_LAYERS:
            _fail(f"num_layers={self.num_layers} must be at most {MAX_NUM_LAYERS}")
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full",) * self.num_layers)
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "attention", dict(self.attention))
        if len(self.layer_types) != self.num_layers:
            _fail(
                f"layer_types has {len(self.layer_types)} entries but num_layers={self.num_layers}"
            )
        for t in self.layer_types:
            if t not in ("full", "sliding"):
                _fail(f"layer type {t!r} must be full or sliding")
            if t not in self.attention:
                _fail(f"layer type {t!r} has no attention config; got {sorted(self.attention)}")
        if "sliding" in self.layer_types and self.attention["sliding"].sliding_window is None:
            _fail("sliding layers need attention['sliding'].sliding_window")
        if self.moe is None and self.d_ff < 1:
            _fail(f"d_ff={self.d_ff} must be >= 1 for a dense model")
        if self.dense_mlp_with_moe and (self.moe is None or self.d_ff < 1):
            _fail("dense_mlp_with_moe=True needs a moe config and d_ff >= 1")
        self.activation_config  # noqa: B018 (validates the activation)
        if self.remat not in choices(RematPolicy):
            _fail(f"remat={self.remat!r} must be one of {', '.join(choices(RematPolicy))}")
        if self.attention_kernel not in choices(AttentionKernel):
            kernels = ", ".join(choices(AttentionKernel))
            _fail(f"attention_kernel={self.attention_kernel!r} must be one of {kernels}")
        if self.final_logit_softcap is not None and self.final_logit_softcap <= 0:
            _fail(f"final_logit_softcap={self.final_logit_softcap} must be > 0 or None")
        if self.scan_layers and self.num_layers % self.layer_period:
            _fail(
                f"scan_layers=True needs num_layers={self.num_layers} divisible by the "
                f"layer_types period {self.layer_period}"
            )

    @property
    def layer_period(self) -> int:
        """Length of the shortest repeating block of ``layer_types``."""
        types = self.layer_types
        for p in range(1, len(types) + 1):
            if len(types) % p == 0 and types == types[:p] * (len(types) // p):
                return p
        return len(types)

    @property
    def activation_config(self) -> ActivationConfig:
        """The MLP nonlinearity every MLP and expert of the model uses."""
        return ActivationConfig(self.activation, self.swiglu_alpha, self.swiglu_limit)

    def replace(self, **changes) -> ModelConfig:
        """A copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)

    def check_mesh(self, mesh_shape: Mapping[str, int], rules=None) -> None:
        """Checks that every sharded model dimension divides by its mesh axes.

        The axes of each dimension are :func:`posttrain.sharding.logical_to_spec`'s, the
        function that shards the parameters, so the two agree under any ``rules``
        (default :data:`posttrain.sharding.DEFAULT_RULES`).

        Raises:
          ValueError: naming the dimension, e.g. "num_kv_heads=2 is not divisible
            by mesh axes tensor=4".
        """
        from posttrain import sharding  # here: it imports jax, this module does not

        rules = sharding.DEFAULT_RULES if rules is None else rules

        def check(label: str, size: int, logical: str) -> None:
            try:
                sharding.logical_to_spec((logical,), (size,), mesh_shape, rules)
            except ValueError:
                (entry,) = sharding.logical_to_spec((logical,), None, mesh_shape, rules)
                axes = (entry,) if isinstance(entry, str) else entry
                n = sharding.axis_product(mesh_shape, axes)
                _fail(f"{label}={size} is not divisible by mesh axes {'x'.join(axes)}={n}")

        check("vocab_size", self.vocab_size, "vocab")
        check("d_model", self.d_model, "embed")
        for t in sorted(set(self.layer_types)):
            attn = self.attention[t]
            check("num_heads", attn.num_heads, "heads")
            check("num_kv_heads", attn.num_kv_heads, "kv_heads")
        if self.d_ff:
            check("d_ff", self.d_ff, "mlp")
        if self.moe is not None:
            check("num_experts", self.moe.num_experts, "exp")
            check("moe_d_ff", self.moe.moe_d_ff, "mlp")
            if self.moe.shared_expert_d_ff:
                check("shared_expert_d_ff", self.moe.shared_expert_d_ff, "mlp")
        if self.vision is not None:
            check("vision d_model", self.vision.d_model, "embed")
            check("vision num_heads", self.vision.num_heads, "heads")
            check("vision num_kv_heads", self.vision.num_kv_heads, "kv_heads")
            check("vision d_ff", self.vision.d_ff, "mlp")
