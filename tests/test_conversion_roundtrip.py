"""HF <-> native conversion round trips: properties over hypothesis-drawn tiny configs, no torch."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain import conversion
from posttrain.conversion import ConversionError, NativeMeta, from_hf_config, to_hf_config
from posttrain.conversion import safetensors_io as sio
from posttrain.conversion.hf_config import hf_view
from posttrain.models import get_config
from tests.checkpoints import (
    assert_bit_identical,
    hf_checkpoint,
    random_array,
    read_dir,
    write_hf_dir,
)
from tests.strategies import CONVERSION_FAMILIES, scaled, tiny_model_configs

pytestmark = pytest.mark.host  # host code only: left out of the TPU/GPU tier

# Each example converts files twice (~0.5 s); 3 per family and direction keeps the module
# near 30 s on 2 cores while every family, layout, scan and dtype choice still gets drawn.
FILE_EXAMPLES = scaled(3)


@pytest.mark.parametrize("family", CONVERSION_FAMILIES)
@settings(max_examples=scaled(40))
@given(data=st.data())
def test_hf_config_round_trip(family, data):
    """to_hf_config then from_hf_config gives back the config (native-only fields aside)."""
    cfg = data.draw(tiny_model_configs(family))
    assert hf_view(from_hf_config(to_hf_config(cfg))) == hf_view(cfg)


@pytest.mark.parametrize("family", CONVERSION_FAMILIES)
@settings(max_examples=FILE_EXAMPLES)
@given(data=st.data())
def test_hf_native_hf_is_bit_exact(family, data, tmp_path_factory):
    """HF dir -> native dir -> HF dir reproduces every tensor: names, dtypes, shapes, bytes."""
    cfg = data.draw(tiny_model_configs(family))
    layout = data.draw(st.sampled_from(("hub", "fused")))
    tmp = tmp_path_factory.mktemp("rt")
    tensors = hf_checkpoint(cfg, layout, seed=data.draw(st.integers(0, 2**16)))
    src = write_hf_dir(tmp / "hf", tensors, to_hf_config(cfg), max_shard_bytes=20_000)
    conversion.convert_hf_to_native(src, tmp / "native", scan_layers=cfg.scan_layers)
    conversion.convert_native_to_hf(tmp / "native", tmp / "back", layout=layout)
    assert_bit_identical(read_dir(src), read_dir(tmp / "back"))
    assert hf_view(NativeMeta.read(tmp / "native").cfg) == hf_view(cfg)


@pytest.mark.parametrize("family", CONVERSION_FAMILIES)
@settings(max_examples=FILE_EXAMPLES)
@given(data=st.data())
def test_native_hf_native_is_bit_exact(family, data, tmp_path_factory):
    """Native dir -> HF dir -> native dir reproduces every parameter bit for bit."""
    cfg = data.draw(tiny_model_configs(family))
    layout = data.draw(st.sampled_from(("hub", "fused")))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    params = {
        k: random_array(rng, v.shape, sio.CODES[np.dtype(v.dtype)])
        for k, v in conversion.abstract_params(cfg).items()
    }
    tmp = tmp_path_factory.mktemp("rt")
    conversion.save_native(params, cfg, tmp / "native", max_shard_bytes=30_000)
    conversion.convert_native_to_hf(tmp / "native", tmp / "hf", layout=layout)
    conversion.convert_hf_to_native(tmp / "hf", tmp / "back", scan_layers=cfg.scan_layers)
    assert_bit_identical(read_dir(tmp / "native", "params"), read_dir(tmp / "back", "params"))


@pytest.mark.parametrize("family", CONVERSION_FAMILIES)
def test_in_memory_and_file_conversions_agree(family, tmp_path):
    """hf_to_native_params / native_to_hf_params give what the streaming file path writes."""
    cfg = get_config(f"{family}-tiny", scan_layers=True)
    tensors = hf_checkpoint(cfg, "hub", seed=0)
    got_cfg, params = conversion.hf_to_native_params(tensors, to_hf_config(cfg), scan_layers=True)
    src = write_hf_dir(tmp_path / "hf", tensors, to_hf_config(cfg))
    conversion.convert_hf_to_native(src, tmp_path / "native", scan_layers=True)
    assert_bit_identical(params, read_dir(tmp_path / "native", "params"))
    assert_bit_identical(conversion.native_to_hf_params(params, got_cfg), tensors)


def test_scanned_round_trip_loads_into_the_model(tmp_path):
    """Scanned Gemma 4 params -> HF -> native load into ``CausalLM`` unchanged, and the
    engine's stacked names are exactly ``stack_layers``'s."""
    from posttrain.models import flat_params, stack_layers, unstack_layers

    cfg = get_config("gemma4-tiny", scan_layers=True)
    rng = np.random.default_rng(0)
    params = {
        k: random_array(rng, v.shape, "F32") for k, v in conversion.abstract_params(cfg).items()
    }
    conversion.save_native(params, cfg, tmp_path / "native")
    conversion.convert_native_to_hf(tmp_path / "native", tmp_path / "hf")
    conversion.convert_hf_to_native(tmp_path / "hf", tmp_path / "back", scan_layers=True)
    assert_bit_identical(params, flat_params(conversion.load_native(tmp_path / "back")))
    unscanned = flat_params(conversion.load_native(tmp_path / "back", scan_layers=False))
    assert_bit_identical(unscanned, unstack_layers(params, cfg))
    assert_bit_identical(stack_layers(unscanned, cfg), params)


def test_multimodal_prefix_reads_and_round_trips(tmp_path):
    """Gemma 4 text weights under ``model.language_model.`` beside vision weights: the
    vision weights are skipped, and native -> HF writes the text-only layout."""
    cfg = get_config("gemma4-tiny")
    tensors = hf_checkpoint(cfg, "hub", seed=1, prefix="model.language_model.")
    tensors["model.vision_tower.encoder.weight"] = np.ones((3, 4), np.float32)
    config = {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "text_config": to_hf_config(cfg),
        "vision_config": {"hidden_size": 4},
    }
    src = write_hf_dir(tmp_path / "hf", tensors, config)
    summary = conversion.convert_hf_to_native(src, tmp_path / "native")
    assert (summary.prefix, summary.ignored) == ("model.language_model.", 1)
    conversion.convert_native_to_hf(tmp_path / "native", tmp_path / "back")
    back = read_dir(tmp_path / "back")
    assert_bit_identical(
        back,
        {
            "model." + k[len("model.language_model.") :]: v
            for k, v in tensors.items()
            if "language_model" in k
        },
    )
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert written["architectures"] == ["Gemma4ForCausalLM"]


RELATIVE = {
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    },
    "gpt_oss": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 16,
    },
}


@pytest.mark.parametrize("family", ["llama3", "qwen3", "mixtral", "gpt_oss"])
def test_legacy_rope_theta_and_rope_scaling_load(family):
    """Top-level ``rope_theta`` + ``rope_scaling`` (older config.json) equal ``rope_parameters``."""
    new = to_hf_config(get_config(f"{family}-tiny"))
    old = dict(new)
    params = dict(old.pop("rope_parameters"))
    old["rope_theta"] = params.pop("rope_theta")
    old["rope_scaling"] = (
        {"type": params.pop("rope_type"), **params} if params["rope_type"] != "default" else None
    )
    assert from_hf_config(old) == from_hf_config(new)


def test_gemma4_per_layer_config_matches_global_fields():
    """``per_layer_config`` (newer Gemma 4 config.json) gives the full layers' shapes."""
    new = to_hf_config(get_config("gemma4-tiny"))
    full = from_hf_config(new).attention["full"]
    old = dict(
        new,
        global_head_dim=None,
        num_global_key_value_heads=None,
        per_layer_config={
            "1": {"head_dim": full.head_dim, "num_key_value_heads": full.num_kv_heads}
        },
    )
    assert from_hf_config(old) == from_hf_config(new)


@pytest.mark.parametrize(
    ("family", "field", "value"),
    [
        ("qwen3_moe", "mlp_only_layers", [1]),
        ("qwen3_moe", "decoder_sparse_step", 2),
        ("gemma4", "hidden_size_per_layer_input", 16),
        ("gemma4", "num_kv_shared_layers", 1),
        ("llama3", "hidden_act", "gelu"),
        ("gpt_oss", "quantization_config", {"quant_method": "mxfp4"}),
        ("llama3", "rope_parameters", {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
        (
            "gpt_oss",
            "rope_parameters",
            {
                "rope_type": "yarn",
                "factor": 32.0,
                "rope_theta": 1e4,
                "original_max_position_embeddings": 16,
                "mscale": 0.7,
            },
        ),
        ("llama3", "architectures", ["FalconForCausalLM"]),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_unsupported_config_is_rejected_by_name(family, field, value):
    """An unsupported HF feature is a one-line ConversionError naming its field."""
    config = dict(to_hf_config(get_config(f"{family}-tiny")), **{field: value})
    with pytest.raises(ConversionError, match=field) as info:
        from_hf_config(config)
    assert "\n" not in str(info.value)


def test_the_config_strategy_draws_square_attention():
    """The blind spot of distinct tiny dimensions, a square q/o kernel, is among the draws."""
    from hypothesis import find

    def square(cfg):
        attn = next(iter(cfg.attention.values()))
        return attn.num_heads * attn.head_dim == cfg.d_model

    assert square(find(tiny_model_configs("qwen3"), square))


# --- FP8 flavours -------------------------------------------------------------------

NAN = float("nan")

#: raw bytes of a safetensors FP8 tensor and their values, decoded by hand. F8_E4M3 is
#: OCP's E4M3FN (bias 7, no infinity, only S.1111.111 NaN: max 448 at 0x7E), not the IEEE
#: style ``float8_e4m3`` (bias 7, 0x78 infinity, 0x79..0x7F NaN, max 240), on which the
#: first four bytes read inf, nan, nan, -inf. F8_E5M2 is IEEE style (bias 15, 0x7C
#: infinity), not ``float8_e5m2fnuz`` (bias 16, no infinity), on which 0x3C reads 0.5.
FP8_FIXTURES = {
    "F8_E4M3": (
        [0x78, 0x7E, 0xFE, 0xF8, 0x77, 0x7F, 0x38, 0x01],
        [256.0, 448.0, -448.0, -256.0, 240.0, NAN, 1.0, 2.0**-9],
    ),
    "F8_E5M2": (
        [0x7B, 0x7C, 0xFC, 0x7E, 0x3C, 0x01],
        [57344.0, float("inf"), -float("inf"), NAN, 1.0, 2.0**-16],
    ),
}


@pytest.mark.parametrize("code", sorted(FP8_FIXTURES))
def test_fp8_bytes_read_and_write_as_their_flavour(code, tmp_path):
    """A hand-written safetensors file of FP8 bytes on which the flavours differ (E4M3FN's
    256 and 448 are the IEEE-style E4M3's inf and NaN) reads as the hand-decoded values,
    and writing those values back gives the same bytes under the same dtype code."""
    raw, want = FP8_FIXTURES[code]
    header = {"w": {"dtype": code, "shape": [len(raw)], "data_offsets": [0, len(raw)]}}
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    (tmp_path / "model.safetensors").write_bytes(
        len(head).to_bytes(8, "little") + head + bytes(raw)
    )
    with sio.CheckpointReader(tmp_path) as reader:
        got = reader.read("w")
    np.testing.assert_array_equal(got.astype(np.float64), np.asarray(want))
    out = tmp_path / "out"
    out.mkdir()
    writer = sio.CheckpointWriter(out, "model", [sio.OutputSpec("w", code, (len(raw),))])
    writer.write("w", np.asarray(want, np.float32).astype(got.dtype))
    writer.finish()
    data = (out / "model.safetensors").read_bytes()
    assert json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])["w"]["dtype"] == code
    assert list(data[-len(raw) :]) == raw
