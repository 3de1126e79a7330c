"""Every loader refuses a missing key, an unexpected key and a mis-shaped tensor, and names it.

Nothing may silently keep its initial value (a missing key), drop data (an unexpected key)
or broadcast (a mis-shaped tensor). Loaders: native directories (``load_native``), flat
params into a model (``load_flat_params``), saving flat params as a native directory
(``save_native``), LoRA adapter directories (``load_adapter``). HF checkpoints are covered
in ``test_conversion_errors.py``; Orbax trainer and optimizer state by the trainer tests.
"""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
import safetensors.numpy

from posttrain import conversion, sharding
from posttrain.conversion import ConversionError
from posttrain.lora import LoraConfig, apply_lora, load_adapter, save_adapter
from posttrain.models import build_model, flat_params, get_config, load_flat_params

KINDS = ("missing", "unexpected", "misshaped")
VICTIM = "model.layers.1.self_attn.k_proj.kernel"


@functools.cache
def tiny_params() -> dict[str, np.ndarray]:
    return flat_params(build_model(get_config("qwen3-tiny"), seed=1))


def tampered(params: dict[str, np.ndarray], kind: str, victim: str) -> dict[str, np.ndarray]:
    params = dict(params)
    if kind == "missing":
        del params[victim]
    elif kind == "unexpected":
        params[victim.replace("k_proj", "extra_proj")] = params[victim]
    else:
        params[victim] = params[victim].reshape(params[victim].shape[0], -1)[:, :-1]
    return params


def named(kind: str, victim: str) -> str:
    return victim if kind != "unexpected" else victim.replace("k_proj", "extra_proj")


@pytest.mark.parametrize("kind", KINDS)
def test_load_native_refuses(tmp_path, kind):
    cfg = get_config("qwen3-tiny")
    dst = conversion.save_native(tiny_params(), cfg, tmp_path / "native")
    safetensors.numpy.save_file(
        tampered(tiny_params(), kind, VICTIM), str(dst / "params.safetensors")
    )
    with pytest.raises(ConversionError, match=named(kind, VICTIM).replace(".", r"\.")):
        conversion.load_native(dst)


@pytest.mark.parametrize("kind", KINDS)
def test_load_flat_params_refuses(kind):
    model = build_model(get_config("qwen3-tiny"), seed=2)
    before = flat_params(model)
    with pytest.raises(ValueError, match=named(kind, VICTIM).replace(".", r"\.")):
        load_flat_params(model, tampered(tiny_params(), kind, VICTIM))
    after = flat_params(model)
    assert all(np.array_equal(before[k], after[k]) for k in before)  # nothing half-loaded


@pytest.mark.parametrize("kind", KINDS)
def test_save_native_refuses(tmp_path, kind):
    with pytest.raises(ConversionError, match=named(kind, VICTIM).replace(".", r"\.")):
        conversion.save_native(
            tampered(tiny_params(), kind, VICTIM), get_config("qwen3-tiny"), tmp_path / "n"
        )
    assert not (tmp_path / "n").exists()


@functools.cache
def lora_model_and_adapter(directory):
    mesh = sharding.make_mesh()  # every device on fsdp (8 by default)
    model = apply_lora(
        build_model(get_config("qwen3-tiny"), mesh), mesh, LoraConfig(rank=4, alpha=8.0)
    )
    save_adapter(model, directory)
    return model, mesh


@pytest.mark.parametrize("kind", KINDS)
def test_load_adapter_refuses(tmp_path_factory, kind):
    directory = tmp_path_factory.getbasetemp() / "adapter-source"
    model, _ = lora_model_and_adapter(directory)
    tensors = safetensors.numpy.load_file(str(directory / "lora_adapter.safetensors"))
    victim = sorted(k for k in tensors if "k_proj" in k)[0]
    work = tmp_path_factory.mktemp(f"adapter-{kind}")
    (work / "lora_config.json").write_text((directory / "lora_config.json").read_text())
    safetensors.numpy.save_file(
        tampered(tensors, kind, victim), str(work / "lora_adapter.safetensors")
    )
    with pytest.raises(ValueError, match=named(kind, victim).replace(".", r"\.")):
        load_adapter(model, work)


def test_load_adapter_refuses_a_config_of_another_format(tmp_path_factory):
    """A directory whose lora_config.json is not ours (a PEFT adapter_config.json renamed,
    say) is refused naming the file, before any tensor is read."""
    directory = tmp_path_factory.getbasetemp() / "adapter-source"
    model, _ = lora_model_and_adapter(directory)
    work = tmp_path_factory.mktemp("adapter-format")
    config = json.loads((directory / "lora_config.json").read_text())
    (work / "lora_config.json").write_text(json.dumps({**config, "format": "peft"}))
    with pytest.raises(ValueError, match=r"lora_config\.json is not a posttrain-lora config$"):
        load_adapter(model, work)


def test_load_adapter_refuses_a_config_of_another_version(tmp_path_factory):
    """A lora_config.json of another layout version (a later release's, say) is refused
    naming the file and both versions, before any tensor is read: read as this layout it
    could misload without a word."""
    directory = tmp_path_factory.getbasetemp() / "adapter-source"
    model, _ = lora_model_and_adapter(directory)
    config = json.loads((directory / "lora_config.json").read_text())
    assert config["version"] == 1  # the layout save_adapter writes
    for version in (2, None):
        work = tmp_path_factory.mktemp("adapter-version")
        (work / "lora_config.json").write_text(json.dumps({**config, "version": version}))
        with pytest.raises(ValueError) as error:
            load_adapter(model, work)
        assert str(error.value) == (
            f"{work / 'lora_config.json'} has posttrain-lora version {version!r}; "
            "this release reads version 1"
        )


def test_adapter_files_refuse_a_model_apply_lora_did_not_build(tmp_path, tmp_path_factory):
    """save_adapter, load_adapter (of a good adapter) and export_peft of a plain model
    name the fix, and write nothing."""
    from posttrain.lora import export_peft

    directory = tmp_path_factory.getbasetemp() / "adapter-source"
    lora_model_and_adapter(directory)
    plain = build_model(get_config("qwen3-tiny"))  # the adapter's family: no new compile
    for name, call in [
        ("save", lambda: save_adapter(plain, tmp_path / "save")),
        ("load", lambda: load_adapter(plain, directory)),
        ("export", lambda: export_peft(plain, tmp_path / "export")),
    ]:
        with pytest.raises(ValueError) as error:
            call()
        assert str(error.value) == (
            "model has no lora_config; build it with posttrain.lora.apply_lora"
        ), name
    assert list(tmp_path.iterdir()) == []


def test_load_adapter_lists_the_first_four_names_of_each_kind_and_counts_all(
    tmp_path_factory,
):
    """Many wrong tensors (a layer's adapters renamed): the one-line message names the
    first 4 missing and the first 4 unexpected, and counts every one."""
    directory = tmp_path_factory.getbasetemp() / "adapter-source"
    model, _ = lora_model_and_adapter(directory)
    tensors = safetensors.numpy.load_file(str(directory / "lora_adapter.safetensors"))
    layer = sorted(k for k in tensors if ".layers.1." in k)
    assert len(layer) > 4
    renamed = {
        k.replace(".layers.1.", ".layers.9.") if k in layer else k: v for k, v in tensors.items()
    }
    work = tmp_path_factory.mktemp("adapter-many")
    (work / "lora_config.json").write_text((directory / "lora_config.json").read_text())
    safetensors.numpy.save_file(renamed, str(work / "lora_adapter.safetensors"))
    with pytest.raises(ValueError) as error:
        load_adapter(model, work)
    extra = sorted(k.replace(".layers.1.", ".layers.9.") for k in layer)
    assert str(error.value) == (
        f"adapter {work}: missing {layer[:4]}, unexpected {extra[:4]} "
        f"({len(layer)} missing, {len(layer)} unexpected)"
    )
