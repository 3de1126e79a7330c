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

from posttrain import families

FAMILIES = families.NAMES
# save_pretrained's default writes the hub layout (per-expert keys where HF has a
# conversion mapping); save_original_format=False writes the fused in-memory layout;
# "multimodal" wraps the text model in the family's multimodal class (Gemma 4:
# Gemma4ForConditionalGeneration, the layout of real checkpoints, prefix model.language_model.).
LAYOUTS = {name: family.layouts for name, family in families.FAMILIES.items()}

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


def hf_config(family: str, **overrides) -> transformers.PretrainedConfig:
    """The tiny ``transformers`` config of ``family`` (its :class:`~posttrain.families.HFOracle`);
    ``overrides`` are constructor keywords (so the config's own defaults, e.g. Qwen3
    ``layer_types``, follow them)."""
    oracle = families.get(family).oracle
    cls = getattr(transformers, oracle.config_class)
    return cls(**{**_COMMON, **oracle.tiny_config, **overrides})


def _model_class(family: str, layout: str):
    fam = families.get(family)
    name = fam.read_architectures[0] if layout == "multimodal" else fam.oracle.model_class
    return getattr(transformers, name)


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
    if layout == "multimodal":
        config = _model_class(family, layout).config_class(
            text_config=config.to_dict(),
            vision_config=None,
            audio_config=None,
            tie_word_embeddings=config.tie_word_embeddings,
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


def build_vision(seed: int = 0, **vision_overrides) -> torch.nn.Module:
    """A tiny float32 ``Gemma4ForConditionalGeneration`` with a vision tower (no audio):
    gemma4-tiny's text model and :func:`posttrain.families.gemma4_vision.vision_tiny`'s
    tower, constants perturbed, ``std_bias`` / ``std_scale`` drawn (HF inits them 0 / 1)."""
    from posttrain.families.gemma4_vision import vision_tiny, vision_to_hf

    torch.manual_seed(seed)
    text = hf_config("gemma4")
    wrapper = vision_to_hf(vision_tiny())
    vision = dict(wrapper.pop("vision_config"), initializer_range=INIT_RANGE, **vision_overrides)
    config = transformers.Gemma4Config(
        text_config=text.to_dict(),
        vision_config=vision,
        audio_config=None,
        tie_word_embeddings=text.tie_word_embeddings,
        **wrapper,
    )
    model = transformers.Gemma4ForConditionalGeneration._from_config(
        config, dtype=torch.float32, attn_implementation="eager"
    )
    perturb_constants(model.eval(), seed + 1)
    gen = torch.Generator().manual_seed(seed + 2)
    tower = model.model.vision_tower
    with torch.no_grad():
        table = tower.patch_embedder.position_embedding_table
        table.copy_(INIT_RANGE * torch.randn(table.shape, generator=gen))
        for module in tower.modules():  # bounds the fixture's activations cross
            if getattr(module, "use_clipped_linears", False):
                for name, base in (("input", 1.5), ("output", 0.8)):
                    span = base + 0.3 * torch.rand((2,), generator=gen)
                    getattr(module, f"{name}_min").fill_(-float(span[0]))
                    getattr(module, f"{name}_max").fill_(float(span[1]))
        if tower.config.standardize:
            tower.std_bias.copy_(0.5 * torch.randn(tower.std_bias.shape, generator=gen))
            tower.std_scale.copy_(1 + 0.2 * torch.randn(tower.std_scale.shape, generator=gen))
    return model
