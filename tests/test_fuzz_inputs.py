"""Fuzzed inputs to every parser and loader of user input: each returns a value or raises
the one-line ``ValueError`` the CLIs print (exit 2), never anything else."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.matrix import entries
from posttrain import cli, sharding
from posttrain.conversion import ConversionError, from_hf_config, to_hf_config
from posttrain.conversion.errors import read_json_object
from posttrain.models import get_config
from posttrain.training import data
from tests.strategies import json_values

pytestmark = pytest.mark.host

ONE_LINE = settings(suppress_health_check=[HealthCheck.function_scoped_fixture])


def one_line(error: BaseException) -> None:
    assert str(error).strip() and "\n" not in str(error).strip(), repr(error)


@ONE_LINE
@given(lines=st.lists(st.one_of(st.binary(max_size=60), json_values().map(json.dumps)), max_size=4))
def test_chat_jsonl_lines(tmp_path, lines):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"\n".join(x if isinstance(x, bytes) else x.encode() for x in lines))
    try:
        data.read_chat_jsonl(path)
    except ValueError as error:
        one_line(error)


@ONE_LINE
@given(
    family=st.sampled_from(["llama3", "qwen3_moe", "gemma4", "gpt_oss"]),
    field=st.sampled_from(
        [
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "rms_norm_eps",
            "rope_parameters",
            "layer_types",
            "architectures",
            "num_experts",
            "num_local_experts",
            "sliding_window",
            "tie_word_embeddings",
        ]
    ),
    value=json_values(),
)
def test_hf_config_fields_of_any_value(family, field, value):
    """A valid tiny config.json with one field replaced by any JSON value."""
    config = to_hf_config(get_config(f"{family}-tiny"))
    config[field] = value
    try:
        from_hf_config(config)
    except ConversionError as error:
        one_line(error)


@given(text=st.binary(max_size=80))
def test_config_json_bytes(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    path.write_bytes(text)
    try:
        read_json_object(path)
    except ConversionError as error:
        one_line(error)


@given(spec=st.text(max_size=30))
def test_mesh_specs(spec):
    try:
        axes = sharding.parse_mesh_spec(spec)
    except ValueError as error:
        one_line(error)
        return
    assert axes and all(size >= 1 for size in axes.values()), axes  # never silently empty


@given(value=st.one_of(st.text(max_size=12), st.just("real"), st.integers(-3, 99).map(str)))
def test_device_counts(value):
    try:
        parsed = cli.parse_devices(value)
    except ValueError as error:
        one_line(error)
        return
    assert parsed == "real" or int(parsed) >= 1, parsed


@ONE_LINE
@given(text=st.text(max_size=200))
def test_matrix_entries_files(tmp_path, text):
    path = tmp_path / "entries.toml"
    path.write_text(text, encoding="utf-8")
    try:
        entries.load_entries(path)
    except ValueError as error:
        one_line(error)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("hidden_size", "64", "hidden_size"),
        ("num_hidden_layers", -1, "num_hidden_layers: -1, expected 1 to 10000"),
        ("num_hidden_layers", None, "num_hidden_layers: None, expected 1 to 10000"),
        # the fuzz test's find: a MemoryError building a per-layer table of this length
        ("num_hidden_layers", 12_000_000_000, "num_hidden_layers: 12000000000, expected 1 to"),
        ("rope_parameters", [], "rope_parameters"),
        # #56 7: an OverflowError (int32 token ids) where a command first used it
        ("vocab_size", 10**12, "vocab_size=1000000000000: expected at most 2147483647"),
        ("hidden_size", 2**31, "d_model=2147483648: expected at most 2147483647"),
        # #56 8: accepted before, every RMSNorm then NaN
        ("rms_norm_eps", float("nan"), "norm_eps=nan: expected a finite number > 0"),
        ("rms_norm_eps", float("inf"), "norm_eps=inf: expected a finite number > 0"),
        ("rms_norm_eps", 0, "norm_eps=0: expected a finite number > 0"),
        ("rms_norm_eps", -1e-6, "norm_eps=-1e-06: expected a finite number > 0"),
    ],
)
def test_wrong_field_types_name_the_field(field, value, message):
    config = to_hf_config(get_config("llama3-tiny"))
    config[field] = value
    with pytest.raises(ConversionError, match=message):
        from_hf_config(config)


def test_a_native_config_with_more_layers_than_the_bound_fails_before_building_them():
    """A native config.json (or a preset override) is checked the same way."""
    with pytest.raises(ValueError, match=r"^num_layers=12000000000 must be at most 10000$"):
        get_config("llama3-tiny").replace(num_layers=12_000_000_000, layer_types=())


def test_jax_platform_advice_stays_out_of_a_commands_one_line(capsys):
    """On a TPU VM without transparent hugepages JAX warns at import; a command's stderr
    is still its one line (issue 54: the advice stood before ``posttrain: error:``)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        status = cli.main(["plan", "--model", "no-such-model", "--topology", "v5e-1"])
        warnings.warn(f"{cli.PLATFORM_ADVICE}. TPU runtime ...", UserWarning, stacklevel=1)
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and err[0].startswith("posttrain: error: ")
    assert not [w for w in caught if cli.PLATFORM_ADVICE in str(w.message)]
