"""What :mod:`posttrain.training.supervised` computes and prints around a run, without a
run: the first progress line, the summary, the global batch and its refusal, the
parameter counts (the runs themselves: tests/test_sft_run.py)."""

from __future__ import annotations

import dataclasses
import pathlib
import types

import jax
import pytest
from flax import nnx

from posttrain import sharding
from posttrain.sft.options import SFTConfig
from posttrain.training import supervised
from posttrain.training.supervised import SFTResult

FACTS = {
    "rows": 12345,
    "data_shards": 4,
    "global_batch": 16,
    "convention": "bound2",
    "replica_parallel_saves_resolved": False,
}


def test_the_start_line_names_each_figure_with_thousands_separators():
    """Every figure of the first line in its place, the saves' resolved choice beside
    the option."""
    cfg = SFTConfig(max_target_length=128, grad_accum=3, replica_parallel_saves="off")
    assert supervised._start_line(cfg, FACTS, 1234567, 89012, 3456) == (
        "model qwen3-tiny: 1,234,567 params, 89,012 trained; 12,345 rows of 128 in 4 data "
        "shard(s), 3,456 read here; global batch 16 x grad_accum 3; Tunix convention "
        "bound2; replica-parallel saves off (off)"
    )
    on = {**FACTS, "replica_parallel_saves_resolved": True}
    line = supervised._start_line(SFTConfig(), on, 1, 1, 1)
    assert line.endswith("replica-parallel saves on (auto)")


HISTORY = [
    {"step": 3, "loss": 2.0, "perplexity": 7.389, "tokens_per_s": 100.0},
    {"step": 4, "loss": 1.0, "perplexity": 2.718, "tokens_per_s": 300.0},
]


def test_the_summary_is_the_steps_line_with_the_perplexity_then_the_held_out_line():
    result = SFTResult(HISTORY, pathlib.Path("out"), 4, [], "bound2", 8, 10, 5)
    steps = "steps 3-4: loss 2.000 -> 1.000 (perplexity 2.7), 200 tokens/s"
    assert result.summary() == steps
    held = dataclasses.replace(result, held_out="held-out answers: 1 of 8 -> 7 of 8")
    assert held.summary() == steps + "\nheld-out answers: 1 of 8 -> 7 of 8"
    resumed = dataclasses.replace(result, history=[], checkpoint_step=7)
    assert resumed.summary() == "no steps run (already at step 7)"


@pytest.mark.devices(8)
def test_the_global_batch_is_the_per_device_rows_times_the_data_parallel_devices():
    """data=2 x fsdp=2 (tensor_sequence=2 does not count): 3 rows a device -> 12; a row
    length the sequence axis does not divide is refused naming both."""
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor_sequence": 2})
    cfg = SFTConfig(per_device_batch_size=3, max_target_length=64)
    assert supervised._global_batch(cfg, mesh) == 12
    with pytest.raises(ValueError) as refused:
        supervised._global_batch(dataclasses.replace(cfg, max_target_length=63), mesh)
    assert str(refused.value) == (
        "max_target_length=63 is not divisible by the sequence-parallel size 2 of the mesh"
    )


def test_the_parameter_counts_are_every_parameter_and_the_learned_ones():
    """Two linears, 3 -> 4 (16 parameters) and 4 -> 2 (10): the second alone learned."""

    class Two(nnx.Module):
        def __init__(self):
            self.a = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
            self.b = nnx.Linear(4, 2, rngs=nnx.Rngs(0))

    learned = nnx.All(nnx.Param, nnx.PathContains("b"))
    trainer = types.SimpleNamespace(model=Two(), learned=learned)
    assert supervised._parameter_counts(trainer) == (26, 10)


def test_a_row_holds_at_least_two_tokens():
    """An input and its target: ``max_target_length=2`` is a run, 1 is refused naming
    the flag."""
    SFTConfig(max_target_length=2).check_fields()
    with pytest.raises(ValueError) as refused:
        SFTConfig(max_target_length=1).check_fields()
    assert str(refused.value) == "max_target_length=1 (--max-target-length): expected >= 2"


@pytest.mark.host  # the CPU backend's resolution
def test_replica_parallel_saves_resolve_off_only_for_auto_in_one_cpu_process():
    """``auto`` is off in one process on the CPU (this one), ``on`` and ``off`` as given."""
    assert jax.default_backend() == "cpu" and jax.process_count() == 1
    resolved = {
        choice: SFTConfig(replica_parallel_saves=choice).resolved_replica_parallel_saves()
        for choice in ("auto", "on", "off")
    }
    assert resolved == {"auto": False, "on": True, "off": False}
