"""Tiny HF ``transformers`` models per family, built and saved by transformers itself.

Recipe (``../shared/research/hf-reference.md`` section 2): random init with a
fixed seed, float32, every constant-initialised tensor (norm weights, biases,
router scales, ``per_expert_scale``, ``layer_scalar``, sinks) perturbed away from
1 / 0 so a converter that drops or transposes one of them cannot pass a parity
test. Dimensions are distinct: d_model 72, d_ff 88, heads x head_dim 8 x 10 = 80,
kv heads 4, expert width 56 (2 x 56 = 112), 6 experts, vocab 264, so a missing
transpose or a swapped split is a shape error, not a silent scramble.

Importing this module imports torch and transformers; only tests marked
``reference`` may import it.
"""

from __future__ import annotations

import pathlib

import torch
import transformers

FAMILIES = ("llama3", "qwen3", "qwen3_moe", "mixtral", "gemma4", "gpt_oss")
# save_pretrained's default writes the hub layout (per-expert keys where HF has a
# conversion mapping); save_original_format=False writes the fused in-memory layout.
# gemma4 "multimodal" wraps the text model in Gemma4ForConditionalGeneration, the
# layout of real Gemma 4 checkpoints (prefix model.language_model.).
LAYOUTS = {family: ("hub", "fused") for family in FAMILIES} | {
    "gemma4": ("hub", "fused", "multimodal")
}

CLAMP_REACH = 12.0  # GPT-OSS expert gate_up scale that takes pre-activations past 7
INIT_RANGE = 0.08  # larger than HF's 0.02 so logits are O(1) and a wrong weight shows
_COMMON = dict(
    vocab_size=264,
    hidden_size=72,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=10,
    max_position_embeddings=512,
    initializer_range=INIT_RANGE,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def _kwargs(family: str) -> tuple[type, dict]:
    if family == "llama3":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500_000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        }  # head_dim 10's wavelengths 6.3, 87, 1197 ...: high, blended and low llama3 bands
        return transformers.LlamaConfig, dict(
            intermediate_size=88, rms_norm_eps=1e-5, rope_parameters=rope, tie_word_embeddings=False
        )
    if family == "qwen3":
        return transformers.Qwen3Config, dict(
            intermediate_size=88,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        )
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig, dict(
            intermediate_size=88,
            moe_intermediate_size=56,
            num_experts=6,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        )
    if family == "mixtral":
        return transformers.MixtralConfig, dict(
            intermediate_size=56,
            num_local_experts=6,
            num_experts_per_tok=2,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        )
    if family == "gemma4":
        rope = {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": 0.25,
                "rope_theta": 1_000_000.0,
            },
        }
        return transformers.Gemma4TextConfig, dict(
            intermediate_size=88,
            global_head_dim=12,
            num_global_key_value_heads=2,
            attention_k_eq_v=True,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=8,
            rope_parameters=rope,
            enable_moe_block=True,
            num_experts=6,
            top_k_experts=2,
            moe_intermediate_size=56,
            hidden_size_per_layer_input=0,
            final_logit_softcapping=30.0,
            hidden_activation="gelu_pytorch_tanh",
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        )
    if family == "gpt_oss":
        rope = {
            "rope_type": "yarn",
            "rope_theta": 150_000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        }  # YaRN's correction range at frequencies 1.26-2.72 of head_dim 10's five
        return transformers.GptOssConfig, dict(
            intermediate_size=56,
            num_local_experts=6,
            num_experts_per_tok=2,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters=rope,
            rms_norm_eps=1e-5,
            attention_bias=True,
            tie_word_embeddings=False,
        )
    raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")


def hf_config(family: str, **overrides) -> transformers.PretrainedConfig:
    """The tiny ``transformers`` config of ``family``; ``overrides`` are constructor keywords
    (so the config's own defaults, e.g. Qwen3 ``layer_types``, follow them)."""
    cls, kwargs = _kwargs(family)
    return cls(**{**_COMMON, **kwargs, **overrides})


def _model_class(family: str, layout: str):
    if family == "gemma4" and layout == "multimodal":
        return transformers.Gemma4ForConditionalGeneration
    return {
        "llama3": transformers.LlamaForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
        "qwen3_moe": transformers.Qwen3MoeForCausalLM,
        "mixtral": transformers.MixtralForCausalLM,
        "gemma4": transformers.Gemma4ForCausalLM,
        "gpt_oss": transformers.GptOssForCausalLM,
    }[family]


def perturb_constants(model: torch.nn.Module, seed: int = 1) -> None:
    """Overwrites every parameter or buffer whose values are all equal (norms at 1,
    biases at 0, scales ...) with ``1 + 0.1 N(0, 1)`` (was 1) or ``0.05 N(0, 1)``."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if not tensor.is_floating_point() or tensor.numel() < 1:
                continue
            flat = tensor.reshape(-1)
            if not bool(torch.all(flat == flat[0])):
                continue
            noise = torch.randn(tensor.shape, generator=gen, dtype=tensor.dtype)
            base = 1.0 if float(flat[0]) == 1.0 else 0.0
            tensor.copy_(base + (0.1 if base else 0.05) * noise)


def build(family: str, layout: str = "hub", seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny float32 ``family`` model in eval mode, constants perturbed; ``overrides``
    change its config (e.g. ``norm_topk_prob=False``)."""
    torch.manual_seed(seed)
    config = hf_config(family, **overrides)
    if family == "gemma4" and layout == "multimodal":
        config = transformers.Gemma4Config(
            text_config=config.to_dict(),
            vision_config=None,
            audio_config=None,
            tie_word_embeddings=True,
        )
    kwargs = {"attn_implementation": "eager"}
    model = _model_class(family, layout)._from_config(config, dtype=torch.float32, **kwargs)
    perturb_constants(model.eval(), seed + 1)
    if family == "gpt_oss":
        # Expert pre-activations of |x| ~ 0.7 never reach the SwiGLU clamp at 7: scaled 12x,
        # about a fifth of them do, so parity proves the clamp (tests/test_parity_fixtures.py).
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.experts.gate_up_proj.mul_(CLAMP_REACH)
    return model


def save(model: torch.nn.Module, directory: pathlib.Path, layout: str = "hub") -> pathlib.Path:
    """``save_pretrained`` in the hub layout (default) or the fused one."""
    model.save_pretrained(directory, save_original_format=(layout != "fused"))
    return directory
