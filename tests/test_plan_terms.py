"""``posttrain plan``'s memory and mesh arithmetic against figures counted by hand, each on
a mesh where the term's factor is not 1 (``tests/test_plan.py`` checks the plan against
its own compile; here no figure comes from the code under test).

The model is ``qwen3-tiny``: 2 layers, one attention type with 8 heads, 4 kv heads of
head_dim 10, float32 activations.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from posttrain import sharding
from posttrain.plan import PlanOptions, report, topology

#: qwen3-tiny's attention, read by hand from its preset: layers, kv heads, head_dim, itemsize
LAYERS, KV_HEADS, HEAD_DIM, F32 = 2, 4, 10, 4


def mesh_of(shape: dict[str, int]):
    count = 1
    for n in shape.values():
        count *= n
    return sharding.make_mesh(shape, devices=jax.devices()[:count])


@pytest.mark.devices(4)
def test_device_bytes_count_each_leafs_shard_not_the_whole_array():
    """On data=2 x tensor=2: a float32 [8, 6] split on both axes is 8*6*4 / 4 = 48 bytes
    a device, on the tensor axis only 96, replicated 192; an int8 [4] split on data, 2."""
    from posttrain.plan import abstract

    mesh = mesh_of({"data": 2, "tensor": 2})

    def leaf(shape, dtype, *spec):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P(*spec)))

    leaves = {
        "both": (leaf((8, 6), jnp.float32, "data", "tensor"), 48),
        "tensor": (leaf((8, 6), jnp.float32, None, "tensor"), 96),
        "replicated": (leaf((8, 6), jnp.float32), 192),
        "int8 on data": (leaf((4,), jnp.int8, "data"), 2),
    }
    for name, (value, want) in leaves.items():
        assert abstract.device_bytes([value]) == want, name
    assert abstract.device_bytes({k: v for k, (v, _) in leaves.items()}) == 48 + 96 + 192 + 2


@pytest.mark.devices(4)
@pytest.mark.parametrize(
    ("shape", "dp", "kv_shards"),
    [({"data": 2, "tensor": 2}, 2, 2), ({"fsdp": 2, "tensor": 2}, 2, 2), ({"tensor": 4}, 1, 4)],
    ids=["data2-tensor2", "fsdp2-tensor2", "tensor4"],
)
def test_the_kv_cache_term_is_split_over_the_batch_and_the_kv_heads(shape, dp, kv_shards):
    """Generation's KV cache per device, 4 rows x (8 prompt + 4 new) slots: each layer's
    keys and values [4 / dp, 12, 4 / kv_shards, 10] float32 (the kv heads split over the
    tensor axis, the rows over the data-parallel axes) and its int32 end_index [4], which
    no sharding constrains (counted whole), counted by hand."""
    from posttrain.models import get_config
    from posttrain.plan import abstract, steps

    cfg = get_config("qwen3-tiny")
    assert (cfg.num_layers, cfg.dtype) == (LAYERS, "float32")
    assert {(a.num_kv_heads, a.head_dim) for a in cfg.attention.values()} == {(KV_HEADS, HEAD_DIM)}
    batch, slots = 4, 8 + 4
    keys = (batch // dp) * slots * (KV_HEADS // kv_shards) * HEAD_DIM * F32
    want = LAYERS * (2 * keys + 4 * batch)
    program = steps.generate_program(
        abstract.abstract_model(cfg), mesh_of(shape), batch=batch, prompt=8, new_tokens=4
    )
    assert program.kinds["KV cache"] == want


@pytest.mark.aot
@pytest.mark.parametrize(
    ("mesh", "per_device", "rows"),
    [({"data": 2, "tensor": 2}, 3, 6), ({"fsdp": 2, "tensor": 2}, 3, 6), (None, 3, 12)],
    ids=["data2-tensor2", "fsdp2-tensor2", "fsdp4-default"],
)
def test_the_global_batch_counts_the_data_parallel_devices_only(mesh, per_device, rows):
    """On a v5p-8 (4 chips), ``--per-device-batch-size 3``: the global batch is 3 x the
    data-parallel devices (6 on data=2 x tensor=2, not 12 from every chip; 12 when every
    chip is on fsdp), and each device holds 3 rows of the SFT micro-batch: 4 int32
    [rows, 32] fields and the [rows] target counts, 3 * 32 * 4 * 4 + 3 * 4 bytes."""
    from posttrain.plan import compile as plan_compile

    options = PlanOptions(
        model="qwen3-tiny",
        topology="v5p-8",
        mesh=mesh,
        per_device_batch_size=per_device,
        seq=32,
        num_layers=1,
    )
    what, programs, _ = plan_compile.build_programs(options, topology.get("v5p-8"))
    assert f"batch {rows} x 32" in what
    assert programs["train step"].kinds["inputs"] == per_device * 32 * 4 * 4 + per_device * 4
    assert programs["train step"].model_flops > 0


def _figures(peak_gib: int) -> report.Figures:
    return report.Figures(
        arguments=peak_gib * topology.GIB,
        outputs=0,
        aliased=0,
        temporaries=0,
        code=0,
        kinds={},
        flops=1e12,
        bytes_accessed=1e9,
        model_flops=1e12,
        compile_seconds=0.0,
    )


def test_a_workflows_verdict_is_its_heaviest_program_not_its_main_one(monkeypatch):
    """A GRPO plan whose rollout peaks at 100 GiB and whose train step at 20 GiB, on a
    v5p-8 (95 GiB a chip): the plan does not fit, by 5 GiB, in the rollout; its main
    figures are still the train step's."""
    import posttrain.plan as plan_module
    from posttrain.plan import compile as plan_compile

    stages = {"rollout": _figures(100), "train step": _figures(20)}
    monkeypatch.setattr(plan_compile, "compile_stages", lambda options: ("grpo", dict(stages)))
    options = PlanOptions(
        model="qwen3-tiny",
        topology="v5p-8",
        workflow="grpo",
        batch=8,
        seq=32,
        new_tokens=16,
        scan_layers=False,
    )
    planned = plan_module.plan(options)
    hbm = topology.get("v5p-8").hbm_bytes
    assert hbm == 95 * topology.GIB
    assert not planned.verdict.fits
    assert planned.verdict.headroom == -5 * topology.GIB
    assert planned.verdict.stage == "rollout"
    assert planned.figures.peak == 20 * topology.GIB
    assert planned.record()["fits"] is False
