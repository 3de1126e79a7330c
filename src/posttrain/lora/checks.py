"""What :func:`posttrain.lora.apply_lora` (and :func:`~posttrain.lora.abstract.abstract_lora`)
refuse: a LoRA config the model or the mesh cannot take, before Qwix traces anything; a rank
no adapted weight can use, before any adapter is allocated; state Qwix left behind, after.
"""

from __future__ import annotations

import math
import re

from flax import nnx
from jax.sharding import Mesh

from posttrain.lora import layout
from posttrain.lora.config import VISION_TOWER, LoraConfig
from posttrain.tree import path_name


def example_paths(paths: list[str], limit: int = 24) -> str:
    """Module paths of the first layer / block and outside the layers, for error messages."""
    shown = [p for p in paths if not re.search(r"/(layers|blocks)/[1-9]", p)]
    return ", ".join(shown[:limit]) + (" ..." if len(shown) > limit else "")


def check_config(model, lora_config: LoraConfig, mesh: Mesh, rules, matched: list[str]) -> None:
    """``lora_config`` against ``model`` and ``mesh``, ``matched`` the module paths its target
    matches: the mesh divides the model; no vision tower module; no dropout; QLoRA with
    ``dtype == param_dtype``; routed experts with the dense algorithm and unfused scales."""
    cfg = model.config
    cfg.check_mesh(dict(mesh.shape), rules)
    tower = [p for p in matched if p.startswith(VISION_TOWER)]
    if tower:
        raise ValueError(
            f"LoRA target {lora_config.target_regex!r} reaches the vision tower ({tower[0]} "
            f"...): Qwix traces the model without images, so the tower's modules would get "
            f"no adapters; target the text model's (model/...) or train the tower in full"
        )
    if lora_config.dropout:
        raise NotImplementedError(
            f"dropout={lora_config.dropout}: LoRA dropout needs an RNG stream inside the "
            f"decoder's split/merge layers, which is not implemented; use dropout=0.0"
        )
    if lora_config.weight_qtype and cfg.dtype != cfg.param_dtype:
        raise ValueError(
            f"QLoRA (weight_qtype={lora_config.weight_qtype!r}) needs dtype == "
            f"param_dtype, got {cfg.dtype} and {cfg.param_dtype}"
        )
    experts = [p for p in matched if p.endswith("/experts")]
    if experts and cfg.moe is not None:
        if cfg.moe.algorithm != "dense":
            raise ValueError(
                f"LoRA on routed experts ({experts[0]} ...) needs moe.algorithm='dense', the only "
                f"expert path Qwix can intercept; got {cfg.moe.algorithm!r} ('sorted' would get no "
                f"adapters, 'ragged' fails). Build the model with that algorithm or drop experts"
            )
        if cfg.moe.fuse_expert_scales:
            raise ValueError(
                "LoRA on routed experts needs moe.fuse_expert_scales=False: the "
                "fused scale turns down_proj into a product Qwix adapts as if it "
                "were a weight"
            )


def check_rank(abstract: nnx.Module, rank: int) -> None:
    """A rank above min(d_in, d_out) of an adapted weight adds parameters and no capacity
    (A.B has rank <= min(d_in, d_out)); refused before any adapter is allocated.

    d_in is the product of the weight dims A covers, d_out of the rest (per layer and,
    for routed experts, over the experts A or B spans).
    """
    for adapter in layout.iter_adapters(abstract):
        lead = int(adapter.stacked)
        d_in = math.prod(adapter.a.shape[lead:-1])
        d_out = math.prod(adapter.b.shape[lead + 1 :])
        if rank > min(d_in, d_out):
            raise ValueError(
                f"lora rank={rank} exceeds min(d_in, d_out)={min(d_in, d_out)} of "
                f"{adapter.key} ({d_in} x {d_out}); expected rank <= {min(d_in, d_out)}"
            )


def verify_state(model: nnx.Module) -> None:
    """Only Param / LoRAParam variables remain (no RNG or quant-stat state from Qwix)."""
    for path, var in nnx.to_flat_state(nnx.state(model)):
        if type(var) not in (nnx.Param, nnx.LoRAParam):
            raise ValueError(
                f"after apply_lora, {path_name(path)} is a {type(var).__name__}; "
                f"only Param and LoRAParam are expected (Qwix left state behind)"
            )
