"""Bad input to ``posttrain convert``: one-line errors naming the tensor or file, exit 2,
nothing written, input untouched; and transform misuse caught by construction (no torch)."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np
import pytest

from posttrain import cli, conversion
from posttrain.conversion import ConversionError, to_hf_config
from posttrain.families.gemma4_vision import vision_from_hf
from posttrain.hf_schema import transforms as tf
from posttrain.models import get_config
from tests.checkpoints import hf_checkpoint, patch_rows, read_dir, write_hf_dir

pytestmark = pytest.mark.host

FAMILY = "qwen3_moe"  # MoE: router, experts and per-expert keys are all in play


def digest(directory) -> str:
    h = hashlib.sha256()
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()


@pytest.fixture
def hf_dir(tmp_path):
    """A valid two-shard hub-layout Qwen3-MoE checkpoint directory."""
    cfg = get_config(f"{FAMILY}-tiny")
    return write_hf_dir(
        tmp_path / "hf",
        hf_checkpoint(cfg, "hub", seed=0),
        to_hf_config(cfg),
        max_shard_bytes=400_000,
    )


def shard_of(directory, key) -> str:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    return index["weight_map"][key]


def replace_checkpoint(directory, tensors) -> None:
    """Rewrites the checkpoint in ``directory`` with ``tensors``, same config."""
    config = json.loads((directory / "config.json").read_text())
    for path in directory.iterdir():
        path.unlink()
    directory.rmdir()
    write_hf_dir(directory, tensors, config, max_shard_bytes=400_000)


def rewrite(directory, drop=(), add=None, change=None) -> None:
    """Rewrites the checkpoint in ``directory`` without ``drop``, with ``add`` / ``change``."""
    tensors = read_dir(directory)
    for key in drop:
        del tensors[key]
    tensors.update(add or {})
    tensors.update(change or {})
    replace_checkpoint(directory, tensors)


EXPERT_KEY = "model.layers.1.mlp.experts.3.up_proj.weight"


def corrupt(kind):
    def apply(directory):
        if kind == "missing":
            rewrite(directory, drop=[EXPERT_KEY])
        elif kind == "unexpected":
            rewrite(
                directory,
                add={"model.layers.0.mlp.shared_expert.weight": np.zeros((3, 3), np.float32)},
            )
        elif kind == "shape":
            rewrite(directory, change={EXPERT_KEY: np.zeros((72, 56), np.float32)})
        elif kind == "architecture":
            config = json.loads((directory / "config.json").read_text())
            config["architectures"] = ["DeepseekV3ForCausalLM"]
            (directory / "config.json").write_text(json.dumps(config))
        elif kind == "truncated":
            path = directory / shard_of(directory, EXPERT_KEY)
            path.write_bytes(path.read_bytes()[:-100])
        elif kind == "corrupted":
            path = directory / shard_of(directory, EXPERT_KEY)
            data = bytearray(path.read_bytes())
            data[8:40] = b"\xff" * 32  # inside the JSON header
            path.write_bytes(bytes(data))
        elif kind == "prefix":  # a wrong prefix must never load as random weights
            replace_checkpoint(
                directory,
                {
                    k.replace("model.", "language_model.model.", 1): v
                    for k, v in read_dir(directory).items()
                },
            )
        elif kind == "mxfp4":
            rewrite(
                directory,
                add={"model.layers.0.mlp.experts.gate_up_proj_blocks": np.zeros((2, 2), np.uint8)},
            )
        elif kind == "missing_shard":
            (directory / shard_of(directory, EXPERT_KEY)).unlink()
        elif kind == "config_list":
            (directory / "config.json").write_text("[1, 2]\n")
        elif kind == "config_dir":
            (directory / "config.json").unlink()
            (directory / "config.json").mkdir()
        elif kind == "config_latin1":
            (directory / "config.json").write_bytes('{"a": "caf\u00e9"}'.encode("latin-1"))
        elif kind == "config_nested":
            (directory / "config.json").write_text("[" * 100_000 + "]" * 100_000)
        elif kind == "config_layers":  # found by the fuzz test: a MemoryError, not exit 2
            config = json.loads((directory / "config.json").read_text())
            config["num_hidden_layers"] = 12_000_000_000
            (directory / "config.json").write_text(json.dumps(config))
        elif kind == "int64":
            rewrite(directory, change={"model.embed_tokens.weight": np.zeros((264, 72), np.int64)})

    return apply


# (corruption, what the one-line message must name)
BAD_INPUTS = {
    "missing": "missing tensor model.layers.1.mlp.experts.3.up_proj.weight",
    "unexpected": "unexpected tensor model.layers.0.mlp.shared_expert.weight",
    "shape": "model.layers.1.mlp.experts.3.up_proj.weight in model-0000",
    "architecture": "unknown architecture 'DeepseekV3ForCausalLM'",
    "truncated": "not a readable safetensors file",
    "corrupted": "not a readable safetensors file",
    "prefix": "missing tensor model.embed_tokens.weight",
    "mxfp4": "MXFP4",
    "missing_shard": "does not exist",
    "config_list": "config.json: expected a JSON object, got list",
    "config_dir": "config.json is a directory; expected a JSON file",
    "config_latin1": "config.json: not UTF-8 text",
    "config_nested": "config.json: not valid JSON",
    "int64": "dtype I64, expected a floating-point weight",
    "config_layers": "config.json num_hidden_layers: 12000000000, expected 1 to 10000",
}


@pytest.mark.parametrize("kind", sorted(BAD_INPUTS))
def test_bad_hf_input_is_one_line_exit_2_nothing_written(kind, hf_dir, capsys):
    """A bad checkpoint: exit status 2, one stderr line naming the problem, no output dir,
    no temporary dir left, input unchanged."""
    corrupt(kind)(hf_dir)
    before = digest(hf_dir)
    dst = hf_dir.parent / "native"
    status = cli.main(["convert", "--from", "hf", "--to", "native", str(hf_dir), str(dst)])
    err = capsys.readouterr().err
    assert status == 2
    assert err.count("\n") == 1 and err.startswith("posttrain: error: ")
    assert BAD_INPUTS[kind] in err
    if kind == "shape":
        assert "expected [56, 72]" in err
    assert sorted(p.name for p in hf_dir.parent.iterdir()) == ["hf"]
    assert digest(hf_dir) == before


@pytest.mark.parametrize("direction", ["hf", "native"])
@pytest.mark.parametrize("case", ["source-file", "source-missing", "parent-file", "config-list"])
def test_bad_paths_are_one_line_exit_2(tmp_path, capsys, direction, case):
    """Bad source or destination paths, both directions: one line naming the path, exit 2."""
    src, dst = tmp_path / "src", tmp_path / "out" / "dst"
    (tmp_path / "out").mkdir()
    if case == "source-file":
        src.write_text("x")
    elif case == "parent-file":
        src.mkdir()
        (src / "config.json").write_text("{}")
        dst = tmp_path / "a-file" / "dst"
        (tmp_path / "a-file").write_text("x")
    elif case == "config-list":
        src.mkdir()
        (src / "config.json").write_text('"a string"')
    target = "native" if direction == "hf" else "hf"
    status = cli.main(["convert", "--from", direction, "--to", target, str(src), str(dst)])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and err.startswith("posttrain: error: "), err
    want = {
        "source-file": "is a file; expected a checkpoint directory",
        "source-missing": "does not exist",
        "parent-file": "is a file; expected a directory",
        "config-list": "expected a JSON object, got str",
    }[case]
    assert want in err, err
    assert not dst.exists() and not any((tmp_path / "out").iterdir())


def test_existing_output_directory_is_refused(hf_dir, capsys):
    """An existing destination is an error before anything is read or written."""
    dst = hf_dir.parent / "native"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    status = cli.main(["convert", "--from", "hf", "--to", "native", str(hf_dir), str(dst)])
    assert status == 2
    assert f"output directory {dst} exists" in capsys.readouterr().err
    assert [p.name for p in dst.iterdir()] == ["keep.txt"]


def test_bad_native_input_names_the_parameter(hf_dir, capsys):
    """native -> HF with a parameter missing from the native dir: exit 2 naming it."""
    native = hf_dir.parent / "native"
    assert cli.main(["convert", "--from", "hf", "--to", "native", str(hf_dir), str(native)]) == 0
    meta, params = conversion.read_native_params(native)
    del params["model.layers.1.mlp.router.kernel"]
    broken = hf_dir.parent / "broken"
    broken.mkdir()
    from posttrain.conversion import safetensors_io as sio

    specs = [sio.OutputSpec(k, "F32", v.shape) for k, v in sorted(params.items())]
    writer = sio.CheckpointWriter(broken, "params", specs)
    for spec in specs:
        writer.write(spec.name, params[spec.name])
    writer.finish()
    meta.write(broken)
    capsys.readouterr()
    status = cli.main(
        ["convert", "--from", "native", "--to", "hf", str(broken), str(hf_dir.parent / "out")]
    )
    assert status == 2
    assert "missing tensor model.layers.1.mlp.router.kernel" in capsys.readouterr().err
    assert not (hf_dir.parent / "out").exists()


# Mixtral rows per layout: (experts down_proj key, router key)
DOWN = {"hub": "experts.{j}.w2.weight", "fused": "mlp.experts.down_proj"}
ROUTER = {"hub": "block_sparse_moe.gate.weight", "fused": "mlp.gate.weight"}
SWAPS = {  # name -> (row keys per layout, wrong transform, error per layout)
    "experts-as-2d-transpose": (
        DOWN,
        tf.TRANSPOSE,
        {
            "hub": "needs a per-expert transform, got transpose",
            "fused": "transform transpose needs 2-D native tensors",
        },
    ),
    "router-as-expert-transpose": (
        ROUTER,
        tf.EXPERTS_T,
        {
            "hub": "transform experts_transpose needs 3-D native tensors",
            "fused": "transform experts_transpose needs 3-D native tensors",
        },
    ),
    "router-as-expert-stack": (
        ROUTER,
        tf.EXPERTS_STACK_T,
        {"hub": "per-expert transform needs {j}", "fused": "per-expert transform needs {j}"},
    ),
}


@pytest.mark.parametrize("swap", sorted(SWAPS))
@pytest.mark.parametrize("layout", ["hub", "fused"])
def test_expert_and_router_transforms_cannot_be_swapped(swap, layout, monkeypatch):
    """Teeth: a table that gives experts the 2-D transpose, or the router an expert
    transform, fails to plan (ndim and arity checked by every transform), in both layouts."""
    keys, transform, messages = SWAPS[swap]
    cfg = get_config("mixtral-tiny")
    tensors = hf_checkpoint(cfg, layout, seed=0)
    patch_rows(
        monkeypatch,
        "mixtral",
        lambda r: dataclasses.replace(r, transform=transform) if r.hf.endswith(keys[layout]) else r,
    )
    with pytest.raises(ConversionError) as info:
        conversion.hf_to_native_params(tensors, to_hf_config(cfg))
    assert messages[layout] in str(info.value)


@pytest.mark.parametrize("array_shape", [(6, 72), (6, 72, 56)])
def test_transforms_check_ndim_at_call_time(array_shape):
    """Belt and braces: the transforms themselves refuse arrays of the wrong ndim."""
    wrong = tf.EXPERTS_T if len(array_shape) == 2 else tf.TRANSPOSE
    with pytest.raises(ConversionError, match=f"needs {wrong.hf_ndim}-D HF tensors"):
        wrong.to_native([np.zeros(array_shape, np.float32)], [array_shape[::-1]], ["x"])


def test_transforms_check_ndim_in_every_direction():
    """to_hf and the per-expert path refuse a wrong ndim too, naming the side; a transform
    without a per-expert form says so (mutmut survivors of transforms.py)."""
    with pytest.raises(ConversionError, match=r"experts_transpose needs 3-D native tensors; w "):
        tf.EXPERTS_T.to_hf([np.zeros((72, 56), np.float32)], ["w"])
    with pytest.raises(ConversionError, match=r"needs 2-D per-expert tensors; e is 3-D"):
        tf.EXPERTS_STACK_T.expert(np.zeros((2, 72, 56), np.float32), "e")
    with pytest.raises(ConversionError, match=r"transform transpose is not per-expert \(k\)"):
        tf.TRANSPOSE.expert(np.zeros((72, 56), np.float32), "k")
    np.testing.assert_array_equal(
        tf.EXPERTS_STACK_T.expert(np.arange(6.0).reshape(2, 3), "e"), np.arange(6.0).reshape(2, 3).T
    )


def test_transform_shape_planning_names_what_is_wrong():
    """hf_shapes refuses the wrong number of native tensors and a per-expert count that is
    not num_experts; hf_shapes and to_native check their own results (broken functions)."""
    with pytest.raises(
        ConversionError, match=r"gate_up_concat_transpose takes 2 native tensors, got \['g'\]"
    ):
        tf.GATE_UP_CONCAT_T.hf_shapes([(6, 72, 56)], ["g"])
    with pytest.raises(ConversionError, match=r"\['d'\] has 6 experts, expected 4"):
        tf.EXPERTS_STACK_T.hf_shapes([(6, 72, 56)], ["d"], num_experts=4)
    assert tf.EXPERTS_STACK_T.hf_shapes([(6, 72, 56)], ["d"]) == [(56, 72)] * 6  # count unknown
    flat = dataclasses.replace(tf.TRANSPOSE, hf_shapes_fn=lambda s: [(s[0][0] * s[0][1],)])
    with pytest.raises(ConversionError, match=r"needs 2-D HF tensors; HF tensor for k is 1-D"):
        flat.hf_shapes([(3, 2)], ["k"])
    broken = dataclasses.replace(tf.TRANSPOSE, to_native_fn=lambda a, s: [a[0][None]])
    with pytest.raises(ConversionError, match=r"transpose needs 2-D native tensors; output is 3-D"):
        broken.to_native([np.zeros((3, 2), np.float32)], [(2, 3)], ["w"])


@pytest.mark.parametrize("rope_type", ["default", "axial"])
def test_the_vision_tower_s_rope_reads_by_both_of_its_names(rope_type):
    """transformers 5.12 writes the tower's 2-D rope as "default", 5.25 as "axial" (the
    TPU image's release; its tiny vision model failed to convert there): one rope."""

    def config(kind):
        rope = {"rope_type": kind, "rope_theta": 100.0}
        return {"vision_config": {"rope_parameters": rope, "head_dim": 8}, "text_config": {}}

    assert vision_from_hf(config(rope_type)) == vision_from_hf(config("default"))
    with pytest.raises(ConversionError, match="rope_type 'linear': one of default, axial only"):
        vision_from_hf(config("linear"))
