"""Converted checkpoints give transformers' logits (fp32, CPU), and the parity check has teeth.

Every model here is built by transformers itself (``tests/hf_tiny.py``: fixed
seed, float32, constant tensors perturbed away from 1 / 0, distinct dims),
saved with ``save_pretrained`` in each on-disk layout, converted, and run on
one batch with a full row, a right-padded row and a left-padded row
(``attention_mask``). Nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from posttrain import cli, conversion, families
from posttrain.conversion import parity
from posttrain.hf_schema import transforms as tf
from tests import transcendentals
from tests.checkpoints import patch_rows

pytestmark = [pytest.mark.reference, pytest.mark.matmul_precision("highest")]

# float32 on both sides: observed mean KL <= 2e-13 and max |delta logit| <= 5e-6 on logits
# of magnitude ~3 (reassociation noise), and top-1 agreement 1.0, so MoE routing is the
# same on every token (no near-ties on this batch). The bounds leave ~20x headroom.
MAX_KL = 1e-6
MAX_ABS = 1e-4
# logits of magnitude ~3 (at most 4 here) through float32 softmax (exp) and activations
# (tanh, logistic): on a TPU v2-v5e those are within 1,365.5 ulp (tests/transcendentals.py;
# the Gemma 4 cases measured 1.0e-4 to 1.1e-4 there, 2026-12-06), on the CPU a few
LOGIT_SCALE = 4.0


def max_abs() -> float:
    """:data:`MAX_ABS`, or the backend's bound of its transcendentals at the logits' scale."""
    return max(MAX_ABS, transcendentals.bound("exp", "tanh", "logistic") * LOGIT_SCALE)


FAMILIES = families.NAMES
CASES = [(name, layout) for name, f in families.FAMILIES.items() for layout in f.layouts]


def saved(hf_tiny, tmp_path, family, layout, **overrides):
    model = hf_tiny.build(family, layout, **overrides)
    return hf_tiny.save(model, tmp_path / f"hf-{layout}", "fused" if layout == "fused" else "hub")


def read(directory, stem="model"):
    with conversion.safetensors_io.CheckpointReader(directory, stem) as reader:
        return {k: reader.read(k) for k in reader.tensors}


@pytest.mark.parametrize(("family", "layout"), CASES, ids=[f"{f}-{lay}" for f, lay in CASES])
# on a chip: each family's forward once (a hub layout differs in what the converter reads)
@pytest.mark.chip_sample(
    "gemma4-fused",
    "gemma4-multimodal",
    "gpt_oss-fused",
    "llama3-fused",
    "mixtral-fused",
    "qwen3-fused",
    "qwen3_moe-fused",
)
def test_converted_logits_match_transformers(hf_tiny, tmp_path, family, layout):
    """HF -> native logits match transformers (KL <= 1e-6, |delta| <= 1e-4, padded batch), and
    native -> HF writes the source's tensors bit for bit in a directory transformers loads."""
    src = saved(hf_tiny, tmp_path, family, layout)
    scan = layout == "fused"  # both layer layouts, without doubling the cases
    summary = conversion.convert_hf_to_native(src, tmp_path / "native", scan_layers=scan)
    assert summary.layout == (
        "fused" if layout == "fused" and family in ("mixtral", "qwen3_moe") else "hub"
    )
    tokens, mask = parity.make_batch(264)
    reference = parity.hf_logits(src, tokens, mask)
    model = parity.load_checked(src, tmp_path / "native")
    result = parity.compare(reference, parity.native_logits(model, tokens, mask), mask)
    assert result.tokens == 36
    assert result.mean_kl <= MAX_KL, result.line()
    assert result.max_abs <= max_abs(), result.line()
    assert np.abs(reference).max() <= LOGIT_SCALE  # the scale max_abs() assumes
    assert result.top1 == 1.0, result.line()

    conversion.convert_native_to_hf(tmp_path / "native", tmp_path / "back", layout=summary.layout)
    source, back = read(src), read(tmp_path / "back")
    assert sorted(source) == sorted(back)
    assert all(source[k].tobytes() == back[k].tobytes() for k in source)
    np.testing.assert_array_equal(parity.hf_logits(tmp_path / "back", tokens, mask), reference)


def _yarn(**overrides) -> dict:
    """gpt_oss-tiny's YaRN parameters with ``overrides`` (``beta_fast``, ``factor``, ...)."""
    return {
        "rope_type": "yarn",
        "rope_theta": 150_000.0,
        "factor": 32.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
        **overrides,
    }


def _gemma4_rope(**changes) -> dict:
    """gemma4-tiny's per-layer-type RoPE parameters, each type's dict updated with
    ``changes[type]``."""
    ropes = families.get("gemma4").oracle.tiny_config["rope_parameters"]
    return {t: {**p, **changes.get(t, {})} for t, p in ropes.items()}


VARIANTS = {  # config features the default tiny models leave off
    "qwen3_moe-no-renorm": ("qwen3_moe", dict(norm_topk_prob=False)),
    "gemma4-separate-v": ("gemma4", dict(attention_k_eq_v=False)),
    "gemma4-dense": ("gemma4", dict(enable_moe_block=False)),
    "llama3-biases-tied": (
        "llama3",
        dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
    ),
    "qwen3-sliding": (
        "qwen3",
        dict(use_sliding_window=True, sliding_window=6, max_window_layers=1),
    ),
    "mixtral-sliding": ("mixtral", dict(sliding_window=6)),
    # Llama 3's published factors are low 1 / high 4, where old / low == old * low. With
    # 2 / 6, theta 1e4 and an original context of 128, llama3-tiny's 5 wavelengths (6.3,
    # 40, 250, 1578, 9958) fall in all three bands: kept (< 21.3), interpolated, scaled
    # (> 64). Mutation testing found a multiplied low_freq_factor surviving.
    "llama3-rope-bands": (
        "llama3",
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10_000.0,
                "factor": 4.0,
                "low_freq_factor": 2.0,
                "high_freq_factor": 6.0,
                "original_max_position_embeddings": 128,
            }
        ),
    ),
    # YaRN's correction range clamped at both ends of head_dim 10's five frequencies
    # (beta_fast so large the low dim is negative, beta_slow so small the high one is
    # past 9; factor 2, where the attention factor's log term is small but not 0), and
    # collapsed to a point (beta_fast == beta_slow: HF's 0.001 guard)
    "gpt_oss-yarn-clamped": (
        "gpt_oss",
        dict(rope_parameters=_yarn(beta_fast=1e4, beta_slow=1e-8, factor=2.0)),
    ),
    "gpt_oss-yarn-point": ("gpt_oss", dict(rope_parameters=_yarn(beta_fast=8.0, beta_slow=8.0))),
    # Gemma 4's proportional RoPE on half of the full layers' head_dim 12 (6 rotated
    # dims, where 6 // 2 != 6 // 3; the preset's 0.25 gives 3, where they agree)
    "gemma4-half-rotary": (
        "gemma4",
        dict(rope_parameters=_gemma4_rope(full_attention={"partial_rotary_factor": 0.5})),
    ),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
# on a chip: a value projection, YaRN, Llama 3's bands and a sliding window
@pytest.mark.chip_sample(
    "gemma4-separate-v", "gpt_oss-yarn-point", "llama3-rope-bands", "qwen3-sliding"
)
def test_config_variants_match_transformers(hf_tiny, tmp_path, variant):
    """Optional features (biases, tying, sliding windows, no renormalisation, separate v,
    dense Gemma 4) convert and match transformers."""
    family, overrides = VARIANTS[variant]
    src = saved(hf_tiny, tmp_path, family, "hub", **overrides)
    conversion.convert_hf_to_native(src, tmp_path / "native")
    result = parity.check_logits(src, tmp_path / "native")
    assert result.ok(MAX_KL, max_abs()) and result.top1 == 1.0, result.line()


def test_dropping_per_expert_scale_fails_parity(hf_tiny, tmp_path, capsys):
    """Teeth: a Gemma 4 native checkpoint whose per_expert_scale is reset to 1 fails
    check-logits (exit 1), while the faithful one passes (exit 0)."""
    src = saved(hf_tiny, tmp_path, "gemma4", "hub")
    assert (
        cli.main(["convert", "--from", "hf", "--to", "native", str(src), str(tmp_path / "native")])
        == 0
    )
    assert cli.main(["check-logits", str(src), str(tmp_path / "native"), "--atol", "1e-4"]) == 0
    meta, params = conversion.read_native_params(tmp_path / "native")
    dropped = {
        k: np.ones_like(v) if k.endswith("per_expert_scale") else v for k, v in params.items()
    }
    assert sum(k.endswith("per_expert_scale") for k in dropped) == 2
    conversion.save_native(dropped, meta.cfg, tmp_path / "dropped", hf_config=meta.hf_config)
    capsys.readouterr()
    assert cli.main(["check-logits", str(src), str(tmp_path / "dropped")]) == 1
    out = capsys.readouterr()
    assert "FAILED" in out.err
    kl = float(out.out.split("mean KL(HF||native) ")[1].split(",")[0])
    assert kl > 1e3 * MAX_KL, out.out  # observed 4e-3


def test_interleaved_split_on_a_concatenated_checkpoint_fails_parity(
    hf_tiny, tmp_path, monkeypatch
):
    """Teeth: splitting Mixtral's concatenated gate_up_proj as if interleaved has the right
    shapes, so only parity can catch it; it does."""
    src = saved(hf_tiny, tmp_path, "mixtral", "fused")
    interleaved = dataclasses.replace(  # [E, 2F, D] -> [E, D, 2F] -> even / odd columns
        tf.GATE_UP_CONCAT_T,
        name="wrong_split",
        to_native_fn=lambda a, s: [
            np.swapaxes(a[0], 1, 2)[..., 0::2],
            np.swapaxes(a[0], 1, 2)[..., 1::2],
        ],
    )
    patch_rows(
        monkeypatch,
        "mixtral",
        lambda r: (
            dataclasses.replace(r, transform=interleaved)
            if r.transform is tf.GATE_UP_CONCAT_T
            else r
        ),
    )
    conversion.convert_hf_to_native(src, tmp_path / "native")
    result = parity.check_logits(src, tmp_path / "native")
    assert not result.ok(MAX_KL, max_abs()), result.line()


def test_check_logits_refuses_a_different_model(hf_tiny, tmp_path, capsys):
    """check-logits on an HF dir and a native dir of different models: exit 2, one line."""
    src = saved(hf_tiny, tmp_path, "llama3", "hub")
    (tmp_path / "other").mkdir()
    other = saved(hf_tiny, tmp_path / "other", "qwen3", "hub")
    conversion.convert_hf_to_native(other, tmp_path / "native")
    capsys.readouterr()
    assert cli.main(["check-logits", str(src), str(tmp_path / "native")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not describe the model" in err
    assert json.loads((src / "config.json").read_text())["model_type"] == "llama"


# Square expert kernels: with d_model == moe_d_ff (and 2 x moe_d_ff == d_model for a fused
# gate_up) a wrong orientation is no longer a shape error, only a value one. HF's expert
# width is moe_intermediate_size (Qwen3-MoE, Gemma 4) or intermediate_size (Mixtral, GPT-OSS).
_EXPERT_WIDTH = {
    "qwen3_moe": "moe_intermediate_size",
    "gemma4": "moe_intermediate_size",
    "mixtral": "intermediate_size",
    "gpt_oss": "intermediate_size",
}
SQUARE_CASES = [
    pytest.param(
        family,
        layout,
        width,
        id=f"{family}-{layout}-{'d_model' if width == 72 else 'half-d_model'}",
        # in the gate: the fused 3-D layouts, where a transpose is one swapaxes away
        marks=()
        if (layout == "fused" or family == "gpt_oss") and width == 72
        else pytest.mark.slow,
    )
    for family in _EXPERT_WIDTH
    for layout in ("hub", "fused")
    for width in (72, 36)  # d_model == moe_d_ff; 2 x moe_d_ff == d_model
    if not (family == "gpt_oss" and layout == "fused")  # GPT-OSS has one layout
]


@pytest.mark.parametrize(("family", "layout", "width"), SQUARE_CASES)
# the transposes are the converter's (host) work: one on a chip
@pytest.mark.chip_sample("gpt_oss-hub-d_model")
def test_square_expert_kernels_convert_by_value(hf_tiny, tmp_path, family, layout, width):
    """Square expert kernels: converted logits still match transformers by value, and the
    round trip writes the source tensors back bit for bit."""
    src = saved(hf_tiny, tmp_path, family, layout, **{_EXPERT_WIDTH[family]: width})
    summary = conversion.convert_hf_to_native(src, tmp_path / "native")
    meta, _ = conversion.read_native_params(tmp_path / "native")
    assert meta.cfg.moe.moe_d_ff == width and meta.cfg.d_model == 72
    result = parity.check_logits(src, tmp_path / "native")
    assert result.ok(MAX_KL, max_abs()) and result.top1 == 1.0, result.line()
    conversion.convert_native_to_hf(tmp_path / "native", tmp_path / "back", layout=summary.layout)
    source, back = read(src), read(tmp_path / "back")
    assert sorted(source) == sorted(back)
    assert all(source[k].tobytes() == back[k].tobytes() for k in source)


def test_check_logits_refuses_a_sequence_past_the_model_positions(hf_tiny, tmp_path, capsys):
    """--seq beyond max_position_embeddings is refused up front (it once allocated 30 GB)."""
    src = saved(hf_tiny, tmp_path, "qwen3", "hub")
    conversion.convert_hf_to_native(src, tmp_path / "native")
    capsys.readouterr()
    status = cli.main(["check-logits", str(src), str(tmp_path / "native"), "--seq", "100000"])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1, err
    assert "--seq 100000 exceeds the model's max_position_embeddings=512" in err
