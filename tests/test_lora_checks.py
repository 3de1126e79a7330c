"""What ``apply_lora`` refuses (:mod:`posttrain.lora.checks`), each check called on its own:
the config against the model and the mesh under the rules given, the rank at its edge
over the adapted weights' min(d_in, d_out) (stacked or not), the state Qwix may leave, and
the example paths an error message lists. Nothing here compiles: the models are abstract
(``nnx.eval_shape``) and the meshes only their axis sizes."""

from __future__ import annotations

import dataclasses
import re
import types

import jax.numpy as jnp
import pytest
from flax import nnx

from posttrain import sharding
from posttrain.lora import LoraConfig, checks
from posttrain.lora.abstract import abstract_lora
from posttrain.models import CausalLM, get_config

pytestmark = pytest.mark.host

LORA = LoraConfig(rank=2, alpha=2.0)


def _mesh(**sizes: int) -> types.SimpleNamespace:
    """A mesh as the checks read it: its axis sizes (every axis, 1 unless given)."""
    return types.SimpleNamespace(shape={axis: sizes.get(axis, 1) for axis in sharding.MESH_AXES})


def _model(cfg) -> types.SimpleNamespace:
    return types.SimpleNamespace(config=cfg)


def test_example_paths_leave_out_later_layers_and_cut_at_the_limit():
    """Layer and block 0 and the paths outside the layers are shown (layers 1 to 9 and
    so 10 and up not), 24 by default, with ' ...' only when some were cut."""
    kept = [f"model/layers/0/m{i}" for i in range(12)] + [f"model/blocks/0/m{i}" for i in range(12)]
    later = ["model/layers/1/m", "model/layers/10/m", "model/blocks/9/m"]
    assert checks.example_paths(kept + later) == ", ".join(kept)
    assert checks.example_paths([*kept, "lm_head"]) == ", ".join(kept) + " ..."
    assert checks.example_paths(["embed", "lm_head"], limit=1) == "embed ..."


def test_the_mesh_is_checked_under_the_rules_given():
    """kv heads over `data` (not a default rule) make data=8 refuse llama3-tiny's 4 kv
    heads; under the default rules the same mesh holds the model."""
    cfg = get_config("llama3-tiny")
    rules = tuple(
        (name, ("data",) if name == "kv_heads" else axes) for name, axes in sharding.DEFAULT_RULES
    )
    mesh = _mesh(data=8)
    checks.check_config(_model(cfg), LORA, mesh, sharding.DEFAULT_RULES, [])
    with pytest.raises(ValueError, match=r"^num_kv_heads=4 is not divisible by mesh axes data=8$"):
        checks.check_config(_model(cfg), LORA, mesh, rules, [])


def test_a_model_computing_in_another_dtype_takes_lora_without_quantisation():
    """dtype != param_dtype is refused only for QLoRA."""
    cfg = get_config("llama3-tiny", dtype="bfloat16")
    checks.check_config(_model(cfg), LORA, _mesh(), sharding.DEFAULT_RULES, [])


def test_routed_experts_are_checked_only_when_matched_and_named_by_the_first():
    sorted_moe = get_config("qwen3_moe-tiny")
    assert sorted_moe.moe.algorithm != "dense"
    attention = ["model/layers/0/self_attn/q_proj"]
    checks.check_config(_model(sorted_moe), LORA, _mesh(), sharding.DEFAULT_RULES, attention)
    experts = ["model/layers/0/mlp/experts", "model/layers/1/mlp/experts"]
    first = re.escape("LoRA on routed experts (model/layers/0/mlp/experts ...) needs")
    with pytest.raises(ValueError, match=f"^{first}"):
        checks.check_config(_model(sorted_moe), LORA, _mesh(), sharding.DEFAULT_RULES, experts)
    gemma = get_config("gemma4-tiny")
    fused = gemma.replace(
        moe=dataclasses.replace(gemma.moe, algorithm="dense", fuse_expert_scales=True)
    )
    with pytest.raises(ValueError) as caught:
        checks.check_config(_model(fused), LORA, _mesh(), sharding.DEFAULT_RULES, experts)
    assert str(caught.value) == (
        "LoRA on routed experts needs moe.fuse_expert_scales=False: the fused scale turns "
        "down_proj into a product Qwix adapts as if it were a weight"
    )


@pytest.mark.parametrize("scan_layers", [False, True], ids=["layers", "scanned-blocks"])
def test_the_rank_is_refused_just_over_the_smallest_adapted_min(scan_layers):
    """llama3-tiny: d_model 72, d_ff 88, 8 query and 4 kv heads of 10. The smallest
    min(d_in, d_out) is k_proj's (72 x 4 x 10 = 40; o_proj's d_in is 8 x 10 = 80): rank 40
    is accepted, 41 refused naming k_proj, the first such weight, and its two widths. A
    scanned model's layer axis is counted in neither."""
    cfg = get_config("llama3-tiny", scan_layers=scan_layers)
    abstract = nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)))
    mesh = sharding.make_mesh({})
    abstract_lora(abstract, mesh, LORA.replace(rank=40))
    k_proj = f"model.{'blocks' if scan_layers else 'layers'}.0.self_attn.k_proj.kernel"
    line = f"lora rank=41 exceeds min(d_in, d_out)=40 of {k_proj} (72 x 40); expected rank <= 40"
    with pytest.raises(ValueError, match=f"^{re.escape(line)}$"):
        abstract_lora(abstract, mesh, LORA.replace(rank=41))


class _Left(nnx.Module):
    def __init__(self, extra: type[nnx.Variable] | None):
        self.kernel = nnx.Param(jnp.ones((2, 3)))
        self.kernel_lora_a = nnx.LoRAParam(jnp.ones((2, 1)))
        if extra is not None:
            self.count = extra(jnp.zeros(()))


def test_state_other_than_params_and_adapters_is_named():
    checks.verify_state(_Left(None))
    with pytest.raises(ValueError) as caught:
        checks.verify_state(_Left(nnx.BatchStat))
    assert str(caught.value) == (
        "after apply_lora, count is a BatchStat; only Param and LoRAParam are expected (Qwix "
        "left state behind)"
    )
