"""What splash attention's kernels cost, as ``posttrain plan`` counts it
(:mod:`posttrain.layers.splash_costs`, issue 54): the blocks the kernel visits against
JAX's own masks, the passes by hand, the shards, and the costs landing in the programs a
plan compiles."""

from __future__ import annotations

import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu import splash_attention as sa

from posttrain import sharding
from posttrain.layers import splash, splash_costs
from posttrain.models.presets import get_config
from posttrain.plan import PlanOptions, topology


def _upstream_density(seq: int, window: int | None) -> float:
    """The share of blocks holding a visible pair in JAX's own static mask, the one
    :func:`posttrain.layers.splash.call_kernel` builds, in the kernel's blocks."""
    padded = -(-seq // splash.LANES) * splash.LANES
    shape = (padded, padded)
    if window is None:
        mask = sa.CausalMask(shape)
    else:
        mask = sa.LocalMask(shape, window_size=(window - 1, 0), offset=0)
    dense = np.asarray(mask[0:padded, 0:padded])
    block = splash.block_sizes(padded).block_q
    n = padded // block
    blocks = dense.reshape(n, block, n, block).any(axis=(1, 3))
    return blocks.sum() / n**2


@pytest.mark.parametrize("seq", [1, 128, 300, 1536, 2048, 4096])
@pytest.mark.parametrize("window", [None, 1, 2, 8, 128, 130, 513, 1024, 5000])
def test_the_density_is_the_share_of_blocks_jaxs_mask_makes_visible(seq, window):
    assert splash_costs.block_density(seq, window) == _upstream_density(seq, window)


def test_the_density_by_hand():
    assert splash_costs.block_density(2048, None) == 10 / 16  # blocks of 512: 1+2+3+4
    assert splash_costs.block_density(300, None) == 6 / 9  # padded to 384, blocks of 128
    assert splash_costs.block_density(2048, 8) == 7 / 16  # 1, then 2 a query block
    assert splash_costs.block_density(2048, 4096) == 10 / 16  # a window past T is causal


@pytest.mark.parametrize(("seq", "window"), [(0, None), (128, 0), (-1, 8)])
def test_the_density_refuses_an_empty_sequence_or_window(seq, window):
    with pytest.raises(ValueError, match=f"seq={seq} and window={window} must be >= 1"):
        splash_costs.block_density(seq, window)


@pytest.mark.parametrize(
    ("remat", "backward", "passes"),
    [("none", False, 2), ("full", False, 2), ("none", True, 9), ("full", True, 11)],
)
def test_the_passes_by_hand(remat, backward, passes):
    """qwen3-tiny: 2 layers of 8 query heads, 4 kv heads, head_dim 10, float32; 2 rows of
    128 tokens (one block, all of it visited). One pass is 2 x 2 x 8 x 128^2 x 10 FLOPs.
    Bytes a layer: the forward reads q, k, v and writes o (8 + 4 + 4 + 8 heads of [2, 128,
    10] float32: 10,240 bytes each), again under remat; dq reads q, k, v, do and writes dq
    (8 + 4 + 4 + 8 + 8), dkv reads q, k, v, do and writes dk, dv (8 + 4 + 4 + 8 + 4 + 4)."""
    cfg = get_config("qwen3-tiny", attention_kernel="splash", remat=remat)
    flops, moved = splash_costs.uncounted_costs(
        cfg, 2, 128, {}, sharding.DEFAULT_RULES, backward=backward
    )
    assert flops == passes * 2 * (2 * 2 * 8 * 128**2 * 10)
    forward = 24 * 10_240 * (2 if backward and remat == "full" else 1)
    assert moved == 2 * (forward + (64 * 10_240 if backward else 0))


def test_sliding_layers_count_their_window_and_their_own_heads():
    """gemma4-tiny: a sliding layer (head_dim 10, window 8) and a full one (head_dim 12)."""
    cfg = get_config("gemma4-tiny", attention_kernel="splash")
    flops, _ = splash_costs.uncounted_costs(
        cfg, 1, 2048, {}, sharding.DEFAULT_RULES, backward=False
    )
    one_pass = 2 * 1 * 8 * 2048**2
    assert flops == 2 * one_pass * (10 * 7 / 16 + 12 * 10 / 16)


def test_the_xla_path_and_the_interpreter_cost_nothing_here():
    for kernel in ("xla", "splash_interpret"):
        cfg = get_config("qwen3-tiny", attention_kernel=kernel)
        assert splash_costs.uncounted_costs(
            cfg, 2, 128, {}, sharding.DEFAULT_RULES, backward=True
        ) == (0.0, 0.0)


@pytest.mark.parametrize(("batch", "seq"), [(0, 128), (2, 0)])
def test_an_empty_batch_is_refused(batch, seq):
    cfg = get_config("qwen3-tiny", attention_kernel="splash")
    with pytest.raises(ValueError, match=f"batch={batch} and seq={seq} must be >= 1"):
        splash_costs.uncounted_costs(cfg, batch, seq, {}, sharding.DEFAULT_RULES, backward=True)


def test_a_sequence_off_the_lanes_is_padded_and_one_token_counts():
    """300 tokens run as 384 (blocks of 128, 6 of 9 visited); one token as 128."""
    cfg = get_config("qwen3-tiny", attention_kernel="splash")
    flops, _ = splash_costs.uncounted_costs(cfg, 1, 300, {}, sharding.DEFAULT_RULES, backward=False)
    assert flops == 2 * 2 * (2 * 8 * 384**2 * 10) * 6 / 9
    one, _ = splash_costs.uncounted_costs(cfg, 1, 1, {}, sharding.DEFAULT_RULES, backward=False)
    assert one == 2 * 2 * (2 * 8 * 128**2 * 10)


def test_heads_round_up_per_device_and_rules_without_the_axes_split_nothing():
    """8 query heads and 4 kv heads over tensor=3: 3 and 2 a device (the last shard
    padded), so the FLOPs are 3/8 and the bytes (3 q/o, 2 k/v heads) not 3/8; rules
    naming neither activation axis leave every row and head on each device."""
    cfg = get_config("qwen3-tiny", attention_kernel="splash")
    whole = splash_costs.uncounted_costs(cfg, 2, 128, {}, sharding.DEFAULT_RULES, backward=False)
    three = splash_costs.uncounted_costs(
        cfg, 2, 128, {"tensor": 3}, sharding.DEFAULT_RULES, backward=False
    )
    assert three[0] == whole[0] * 3 / 8
    assert three[1] == whole[1] * (2 * 3 + 2 * 2) / (2 * 8 + 2 * 4)
    bare = splash_costs.uncounted_costs(cfg, 2, 128, {"fsdp": 2, "tensor": 2}, (), backward=False)
    assert bare == whole


def test_a_device_counts_its_rows_and_its_query_heads():
    """fsdp 2 x tensor 2 (activation_batch over fsdp, heads over tensor): a quarter of the
    FLOPs per device; rows round up (3 rows over 2: 2 a device)."""
    cfg = get_config("qwen3-tiny", attention_kernel="splash")
    whole = splash_costs.uncounted_costs(cfg, 4, 128, {}, sharding.DEFAULT_RULES, backward=True)
    mesh = {"fsdp": 2, "tensor": 2}
    part = splash_costs.uncounted_costs(cfg, 4, 128, mesh, sharding.DEFAULT_RULES, backward=True)
    assert part[0] == whole[0] / 4 and part[1] == whole[1] / 4
    odd = splash_costs.uncounted_costs(cfg, 3, 128, mesh, sharding.DEFAULT_RULES, backward=True)
    assert odd == part


@pytest.mark.aot
@pytest.mark.parametrize("workflow", ["sft", "dpo"])
def test_a_splash_plans_programs_carry_the_kernels_costs(workflow):
    """Where the option lands: the programs ``posttrain plan --attention-kernel splash``
    builds for a v5e (deviceless, nothing compiled) carry the kernels' costs as uncounted,
    beyond the XLA plan's, and say so in their cost source. qwen3-tiny SFT, one row of
    2048, remat save_dots: 11 passes of 2 x 8 x 2048^2 x 10 FLOPs at 10/16 of the blocks,
    2 layers; DPO: a pair of 2 rows of 2048, its reference forward 2 passes."""
    from posttrain.plan.compile import build_programs

    def programs(kernel: str) -> dict:
        options = PlanOptions(
            model="qwen3-tiny",
            topology="v5e-1",
            workflow=workflow,
            attention_kernel=kernel,
            remat="save_dots",
            batch=1,
            seq=2048 if workflow == "sft" else 1920,
            new_tokens=128,
        )
        return build_programs(options, topology.get("v5e-1"))[1]

    xla, kernel = programs("xla"), programs("splash")
    one_pass = 2 * 8 * 2048**2 * 10 * 10 / 16 * 2  # a row, both layers
    rows = 1 if workflow == "sft" else 2
    expected = {"train step": 11 * rows * one_pass, "reference forward": 2 * rows * one_pass}
    for name, program in kernel.items():
        assert program.uncounted[0] - xla[name].uncounted[0] == expected[name], name
        assert "splash's kernels analytic" in program.cost_source
