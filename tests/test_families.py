"""Every registered family has every part (README, "Adding a family").

A family is one module in ``posttrain/families/``; this test is what tells its author
that a part is missing: the presets (a ``-tiny`` one within the gate's budget), a table
that covers the model in every layout, an HF config that round-trips, HF names that
resolve back to the family, and the transformers classes of its test oracle.
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest

from posttrain import conversion, families
from posttrain.conversion import NativeMeta, hf_config
from posttrain.conversion import safetensors_io as sio
from posttrain.models import presets

pytestmark = pytest.mark.host

# The gate runs every tiny preset in dozens of tests: the budget that keeps it fast.
MAX_TINY_PARAMS = 300_000
MAX_TINY_LAYERS = 2


@contextlib.contextmanager
def registered(family: families.Family):
    """``family`` in the registry (replacing its namesake) for the ``with`` block."""
    saved = families.FAMILIES
    families.FAMILIES = {**saved, family.name: family}
    try:
        yield
    finally:
        families.FAMILIES = saved


def missing_parts(family: families.Family) -> list[str]:
    """What ``family`` lacks or gets wrong, one phrase per problem (empty when whole)."""
    with registered(family):
        return _missing_parts(family)


def _missing_parts(family: families.Family) -> list[str]:
    problems = []
    if family.tiny not in family.presets:
        return [f"no {family.tiny!r} preset"]
    for name, factory in family.presets.items():
        if not name.startswith(f"{family.name}-"):
            problems.append(f"preset {name!r} does not start with {family.name!r}")
        if factory().family != family.name:
            problems.append(f"preset {name!r} has family {factory().family!r}")
    cfg = family.presets[family.tiny]()
    n_params = sum(int(np.prod(v.shape)) for v in conversion.abstract_params(cfg).values())
    if n_params > MAX_TINY_PARAMS or cfg.num_layers > MAX_TINY_LAYERS:
        problems.append(f"{family.tiny} has {n_params} params in {cfg.num_layers} layers")
    try:
        written = hf_config.to_hf_config(cfg)
        if hf_config.hf_view(hf_config.from_hf_config(written)) != hf_config.hf_view(cfg):
            problems.append("its HF config does not read back as the preset")
        if hf_config.family_of(written) != family.name:
            problems.append(f"its HF config reads as {hf_config.family_of(written)!r}")
    except conversion.ConversionError as error:
        problems.append(f"HF config: {error}")
    infos = {
        k: sio.OutputSpec(k, sio.CODES[np.dtype(v.dtype)], tuple(v.shape))
        for k, v in conversion.abstract_params(cfg).items()
    }
    for layout in family.table.layouts:
        for prefix in family.table.prefixes:
            try:
                conversion.plan_to_hf(NativeMeta(cfg), infos, layout=layout, prefix=prefix)
            except conversion.ConversionError as error:
                problems.append(f"table, {layout} layout, prefix {prefix!r}: {error}")
    if family.wrap_hf is None and len(family.table.prefixes) > 1:
        problems.append("more than one key prefix but no multimodal wrapper (wrap_hf)")
    return problems


@pytest.mark.parametrize("name", families.NAMES)
def test_every_family_has_every_part(name):
    assert missing_parts(families.get(name)) == []


def test_a_family_without_its_parts_is_told_what_is_missing():
    """Teeth: the check names a missing tiny preset, a misnamed preset, a table that does
    not cover the model and a config writer that loses a field."""
    llama = families.get("llama3")
    assert missing_parts(dataclasses.replace(llama, presets={})) == ["no 'llama3-tiny' preset"]
    renamed = dict(llama.presets, **{"tiny-llama": llama.presets["llama3-tiny"]})
    assert "preset 'tiny-llama' does not start with 'llama3'" in missing_parts(
        dataclasses.replace(llama, presets=renamed)
    )
    moe = families.get("mixtral")
    dense_table = dataclasses.replace(moe, table=llama.table)
    assert any("table, hub layout" in p for p in missing_parts(dense_table))


def test_a_to_hf_hook_that_drops_a_field_is_caught():
    qwen3 = families.get("qwen3")

    def lossy(cfg):
        out = qwen3.to_hf(cfg)
        out["rope_parameters"] = {"rope_type": "default"}  # theta lost
        return out

    broken = dataclasses.replace(qwen3, to_hf=lossy)
    assert any("cannot be written as an HF config" in p for p in missing_parts(broken))


def test_every_consumer_reads_the_registry():
    """The presets, the HF names and the test strategies list exactly the registered
    families (a family added to the registry reaches all of them)."""
    from tests import strategies

    assert presets.FAMILIES == families.NAMES == strategies.CONVERSION_FAMILIES
    assert set(presets.PRESETS) == {p for f in families.FAMILIES.values() for p in f.presets}
    assert tuple(f"{n}-tiny" for n in families.NAMES) == presets.TINY_PRESETS
    for family in families.FAMILIES.values():
        for arch in (family.architecture, *family.read_architectures):
            assert hf_config.family_of({"architectures": [arch]}) == family.name
        for model_type in (family.model_type, *family.read_model_types):
            assert hf_config.family_of({"model_type": model_type}) == family.name


def test_every_family_has_an_hf_parity_case_in_the_gate():
    """Each registered family is a case of the gate's HF parity test (its oracle builds
    the tiny transformers model; docs/families.md): the family tests above pass on a
    family with the right parts for the wrong architecture, only parity catches it. A
    filter on the cases, or the test moved to the slow tier, fails here."""
    from tests import test_conversion_parity as parity_tests

    covered = {family for family, _ in parity_tests.CASES}
    for name in families.NAMES:
        assert name in covered, (
            f"family {name!r} has no HF parity case: give it an oracle (families.HFOracle "
            "naming transformers' config and model classes) and the layouts it reads "
            "(docs/families.md, 'Adding a family')"
        )
    test = parity_tests.test_converted_logits_match_transformers
    assert "slow" not in {mark.name for mark in getattr(test, "pytestmark", [])}


@pytest.mark.reference
@pytest.mark.parametrize("name", families.NAMES)
def test_the_oracle_names_transformers_classes(name):
    """The reference tests build each family's tiny model from these names."""
    import transformers

    family = families.get(name)
    config_class = getattr(transformers, family.oracle.config_class)
    model_class = getattr(transformers, family.oracle.model_class)
    assert model_class.__name__ == family.architecture
    assert model_class.config_class is config_class
    assert config_class.model_type == family.model_type
    for arch in family.read_architectures:
        assert getattr(transformers, arch).__name__ == arch


# every preset but the CPU-sized ones (each family's <family>-tiny, and gemma4-vision-tiny)
FULL_SIZE = [n for n in presets.PRESETS if not n.endswith("-tiny")]
# Published parameter counts: the full-size presets' dimensions are real only if they add up
# to them. The HF hub's safetensors totals of meta-llama/Llama-3.1-8B and -70B,
# Qwen/Qwen3-0.6B and Qwen3-30B-A3B and mistralai/Mixtral-8x7B-v0.1; the gpt-oss model
# card's 20.9B (its checkpoint holds MXFP4 experts, so the hub's total counts packed bytes);
# the Gemma 4 26B-A4B model card's 25.2B total.
PUBLISHED_PARAMS = {
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "qwen3-0.6b": 596_049_920,
    "qwen3_moe-30b-a3b": 30_532_122_624,
    "mixtral-8x7b": 46_702_792_704,
    "gpt_oss-20b": 20.9e9,
    "gemma4-26b-a4b": 25.2e9,
}
# gpt-oss's card rounds to 3 figures; one layer of Llama 3.1 70B is 1.2% of it, a d_ff off
# by 672 (28000) 1.9%.
PARAM_COUNT_RTOL = 0.005


@pytest.mark.parametrize("name", FULL_SIZE)
def test_full_size_presets_convert_both_ways_abstractly(name):
    """Each full-size preset's HF config reads back as itself, and its conversion plans
    (native -> HF -> native) cover every tensor from shapes alone; no weight is made."""
    cfg = presets.get_config(name)
    written = hf_config.to_hf_config(cfg)
    assert hf_config.hf_view(hf_config.from_hf_config(written)) == hf_config.hf_view(cfg)
    abstract = conversion.abstract_params(cfg)
    infos = {
        k: sio.OutputSpec(k, sio.CODES[np.dtype(v.dtype)], tuple(v.shape))
        for k, v in abstract.items()
    }
    to_hf = conversion.plan_to_hf(NativeMeta(cfg), infos)
    back = conversion.plan_to_native(written, {s.name: s for s in to_hf.outputs})
    assert {s.name for s in back.outputs} == set(abstract)
    params = sum(int(np.prod(v.shape)) for v in abstract.values())
    assert params == pytest.approx(PUBLISHED_PARAMS[name], rel=PARAM_COUNT_RTOL)


def test_every_full_size_preset_has_a_published_count():
    assert sorted(FULL_SIZE) == sorted(PUBLISHED_PARAMS)


def test_gemma4_26b_a4b_is_its_released_text_config():
    """The preset reads the same as the text_config of google/gemma-4-26B-A4B-it's
    config.json (as quoted in public code; the family module says which fields the sources
    disagree on and which were taken)."""
    layer_types = (["sliding_attention"] * 5 + ["full_attention"]) * 5
    text_config = {
        "model_type": "gemma4_text",
        "hidden_size": 2816,
        "num_hidden_layers": 30,
        "intermediate_size": 2112,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "num_global_key_value_heads": 2,
        "head_dim": 256,
        "global_head_dim": 512,
        "attention_k_eq_v": True,
        "vocab_size": 262144,
        "rms_norm_eps": 1e-6,
        "sliding_window": 1024,
        "final_logit_softcapping": 30.0,
        "enable_moe_block": True,
        "num_experts": 128,
        "top_k_experts": 8,
        "moe_intermediate_size": 704,
        "tie_word_embeddings": True,
        "layer_types": layer_types,
        "rope_parameters": {
            "full_attention": {
                "partial_rotary_factor": 0.25,
                "rope_theta": 1000000.0,
                "rope_type": "proportional",
            },
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        },
    }
    released = hf_config.from_hf_config(text_config)
    assert hf_config.hf_view(presets.get_config("gemma4-26b-a4b")) == hf_config.hf_view(released)


def test_a_family_with_a_multimodal_wrapper_lists_that_layout_last():
    """``Family.layouts``: the table's layouts, then ``multimodal`` for a family that
    writes a wrapper (gemma4), and never for one that does not (llama3, qwen3)."""
    gemma4 = families.get("gemma4")
    assert gemma4.wrap_hf is not None
    assert gemma4.layouts == (*gemma4.table.layouts, "multimodal")
    for name in ("llama3", "qwen3"):
        family = families.get(name)
        assert family.wrap_hf is None and family.layouts == family.table.layouts
        assert "multimodal" not in family.layouts
    assert families.get("qwen3").tiny == "qwen3-tiny"
