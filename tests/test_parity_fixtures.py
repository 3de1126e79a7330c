"""The HF-parity fixtures reach every family quirk they claim to prove.

A parity test proves a quirk only if its fixture enters the quirk's code path: a RoPE
band, a sliding-window boundary, a softcap region, a clamp limit. For each quirk of the
README's family list, the converted tiny model is run again with that quirk switched off
or perturbed in our config (parameters that only the quirk has are dropped), and the
logits must then fail parity with transformers. A quirk whose fixture never reaches it
would pass here, and the test names it.

The value-region quirks (bands, windows, caps, clamps, YaRN's ramp) run in the gate; the
switch-off cases of parameterised quirks, whose reach is not in doubt, in the slow tier.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import pytest

from posttrain import conversion
from posttrain.config import ModelConfig
from posttrain.conversion import parity
from posttrain.conversion.native import abstract_params
from tests.test_conversion_parity import MAX_ABS, MAX_KL

pytestmark = pytest.mark.reference


class Quirk(NamedTuple):
    family: str
    change: Callable[[ModelConfig], ModelConfig]
    gate: bool = False  # value-region quirks: in the gate; the rest in the slow tier
    zero: str | None = None  # instead of a config change: zero the params ending so


def attention(layer_type: str | None = None, **changes):
    def change(cfg):
        return cfg.replace(
            attention={
                t: dataclasses.replace(a, **changes) if layer_type in (None, t) else a
                for t, a in cfg.attention.items()
            }
        )

    return change


def rope(layer_type: str | None = None, **changes):
    def change(cfg):
        return cfg.replace(
            attention={
                t: dataclasses.replace(a, rope=dataclasses.replace(a.rope, **changes))
                if layer_type in (None, t)
                else a
                for t, a in cfg.attention.items()
            }
        )

    return change


def moe(**changes):
    return lambda cfg: cfg.replace(moe=dataclasses.replace(cfg.moe, **changes))


def top(**changes):
    return lambda cfg: cfg.replace(**changes)


QUIRKS: dict[str, Quirk] = {
    # Llama 3: RoPE band scaling, the blended band included
    "llama3-rope-bands-off": Quirk("llama3", rope(kind="default"), gate=True),
    "llama3-blended-band": Quirk("llama3", rope(low_freq_factor=1.5), gate=True),
    # Qwen3
    "qwen3-qk-norm-off": Quirk("qwen3", attention(qk_norm=False)),
    # Qwen3-MoE and Mixtral routing
    "qwen3_moe-renormalize-off": Quirk("qwen3_moe", moe(renormalize=False)),
    "mixtral-renormalize-off": Quirk("mixtral", moe(renormalize=False)),
    # Gemma 4
    "gemma4-sliding-window-wider": Quirk(
        "gemma4", attention("sliding", sliding_window=12), gate=True
    ),
    "gemma4-v-norm-off": Quirk("gemma4", attention(v_norm=False)),
    "gemma4-proportional-rope": Quirk("gemma4", rope("full", partial_rotary_factor=0.5), gate=True),
    "gemma4-scale-default": Quirk("gemma4", attention(scale=None)),
    "gemma4-sandwich-norm-off": Quirk("gemma4", top(sandwich_norm=False)),
    # the dense MLP beside the experts, silenced (its output is 0 after the sandwich norm)
    "gemma4-dense-mlp-off": Quirk("gemma4", top(), zero="mlp.down_proj.kernel"),
    "gemma4-router-input-norm-off": Quirk("gemma4", moe(router_input_norm=False)),
    "gemma4-per-expert-scale-off": Quirk("gemma4", moe(per_expert_scale=False)),
    "gemma4-layer-scalar-off": Quirk("gemma4", top(layer_scalar=False)),
    "gemma4-embed-scale-off": Quirk("gemma4", top(embed_scale=False)),
    "gemma4-softcap-off": Quirk("gemma4", top(final_logit_softcap=None), gate=True),
    # GPT-OSS
    "gpt_oss-sinks-off": Quirk("gpt_oss", attention(sinks=False)),
    "gpt_oss-attention-bias-off": Quirk("gpt_oss", attention(bias=False)),
    "gpt_oss-sliding-window-wider": Quirk(
        "gpt_oss", attention("sliding", sliding_window=12), gate=True
    ),
    "gpt_oss-yarn-off": Quirk("gpt_oss", rope(kind="default"), gate=True),
    "gpt_oss-yarn-ramp": Quirk("gpt_oss", rope(beta_fast=8.0), gate=True),
    "gpt_oss-router-bias-off": Quirk("gpt_oss", moe(router_bias=False)),
    "gpt_oss-softmax-over-all": Quirk("gpt_oss", moe(score_order="score_then_topk")),
    "gpt_oss-swiglu-clamp-off": Quirk("gpt_oss", top(swiglu_limit=1e9), gate=True),
    "gpt_oss-swiglu-alpha": Quirk("gpt_oss", top(swiglu_alpha=1.0)),
    "gpt_oss-expert-bias-off": Quirk("gpt_oss", moe(expert_bias=False)),
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """family -> (HF dir, native metadata, native params), converted once per module."""
    import torch

    from tests import hf_tiny

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("quirks")

    @functools.cache
    def one(family: str):
        src = hf_tiny.save(hf_tiny.build(family), root / f"hf-{family}")
        conversion.convert_hf_to_native(src, root / f"native-{family}")
        meta, params = conversion.read_native_params(root / f"native-{family}")
        return src, meta, params

    return one


CASES = [
    pytest.param(name, id=name, marks=() if quirk.gate else pytest.mark.slow)
    for name, quirk in QUIRKS.items()
]


@pytest.mark.parametrize("name", CASES)
@pytest.mark.wiring
def test_switching_the_quirk_off_fails_parity(converted, tmp_path, name):
    quirk = QUIRKS[name]
    src, meta, params = converted(quirk.family)
    cfg = quirk.change(meta.cfg)
    if quirk.zero is None:
        assert cfg != meta.cfg, f"{name} changes nothing in {quirk.family}'s config"
    else:
        params = {k: v * 0 if k.endswith(quirk.zero) else v for k, v in params.items()}
        assert any(k.endswith(quirk.zero) for k in params), f"{name}: no {quirk.zero} params"
    wanted = abstract_params(cfg)
    missing = sorted(set(wanted) - set(params))
    assert not missing, f"{name} needs parameters the checkpoint lacks: {missing[:3]}"
    kept = {k: v for k, v in params.items() if k in wanted}
    conversion.save_native(kept, cfg, tmp_path / "changed", hf_config=meta.hf_config)
    tokens, mask = parity.make_batch(cfg.vocab_size)
    result = parity.compare(
        parity.hf_logits(src, tokens, mask),
        parity.native_logits(conversion.load_native(tmp_path / "changed"), tokens, mask),
        mask,
    )
    assert not result.ok(MAX_KL, MAX_ABS), (
        f"{name}: the {quirk.family} fixture still matches transformers with the quirk "
        f"off ({result.line()}): it never reaches the quirk"
    )
