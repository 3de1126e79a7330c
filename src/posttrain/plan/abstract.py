"""The model of a plan, abstract: shapes, dtypes and shardings, never values.

``nnx.eval_shape`` of the model's constructor gives every variable as a
``jax.ShapeDtypeStruct`` with its ``logical_axes`` metadata; :func:`place` turns each
into a ``ShapeDtypeStruct`` carrying its ``NamedSharding`` on the plan's mesh (the same
:func:`posttrain.sharding.state_shardings` that places real models), which is what
``jit(...).lower`` needs to compile the partitioned program. Nothing is allocated: a 70B
model's plan fits in this process's memory.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from posttrain import sharding
from posttrain.config import ModelConfig
from posttrain.models.causal_lm import CausalLM


def with_depth(cfg: ModelConfig, num_layers: int) -> ModelConfig:
    """``cfg`` with its first ``num_layers`` layers (their types kept).

    Raises:
      ValueError: ``num_layers`` outside 1..cfg.num_layers, or not a multiple of the
        layer-type period of a scanned model (from the config's own check).
    """
    if not 1 <= num_layers <= cfg.num_layers:
        raise ValueError(f"num_layers={num_layers} must be in 1..{cfg.num_layers}")
    return cfg.replace(num_layers=num_layers, layer_types=cfg.layer_types[:num_layers])


def abstract_model(cfg: ModelConfig) -> CausalLM:
    """``CausalLM(cfg)`` with ``jax.ShapeDtypeStruct`` values (``nnx.eval_shape``)."""
    return nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)))


def place(obj, mesh: Mesh, rules: sharding.Rules = sharding.DEFAULT_RULES) -> None:
    """Gives every variable of ``obj`` (a model, an optimizer) a ``ShapeDtypeStruct`` value
    with its ``NamedSharding`` on ``mesh`` from its logical axes, in place.

    Raises:
      ValueError: a dimension its mesh axes do not divide (from
        :func:`posttrain.sharding.state_shardings`, naming the variable).
    """
    state = nnx.state(obj)
    shardings = sharding.state_shardings(state, mesh, rules)

    def one(variable, where):
        value = variable.get_value()
        return variable.replace(
            jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=where.get_value())
        )

    placed = jax.tree.map(one, state, shardings, is_leaf=lambda x: isinstance(x, nnx.Variable))
    nnx.update(obj, placed)


def device_bytes(tree) -> int:
    """Bytes one device holds of the placed ``ShapeDtypeStruct`` leaves of ``tree``
    (each leaf's shard shape x itemsize; a replicated leaf counts whole)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return total


def count(tree) -> int:
    """Elements of the array leaves of ``tree`` (the whole arrays, not a device's share)."""
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tree))


def active_matmul_params(model: CausalLM) -> float:
    """Parameters one token multiplies with: every parameter but the input embedding
    (a lookup, unless tied to the output) and, of the routed experts, ``top_k /
    num_experts``. The ``N`` of the ``2 N`` forward FLOPs per token (Kaplan et al. 2020,
    "Scaling laws", table 1; attention's own FLOPs left out)."""
    cfg = model.config
    total = 0.0
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        n = math.prod(variable.get_value().shape)
        names = [str(p) for p in path]
        if "embed_tokens" in names and not cfg.tie_word_embeddings:
            continue
        if "experts" in names and cfg.moe is not None:
            n *= cfg.moe.top_k / cfg.moe.num_experts
        total += n
    return total


def attention_flops(cfg: ModelConfig, rows: int, seq: int, *, backward: bool) -> float:
    """Attention's own matmul FLOPs over ``[rows, seq]`` tokens (whole slice): per layer
    and token, ``q k^T`` and ``p v`` over the keys it attends, ``4 x num_heads x head_dim x
    keys`` forward and twice that backward, with ``keys`` = ``seq`` (a full layer; the
    causal mask's unseen half counted, as PaLM's ``12 L H Q T`` counts it: Chowdhery et
    al. 2022, appendix B) or ``min(seq, sliding_window)`` (a local layer). The term
    :func:`active_matmul_params`' ``6 N`` leaves out; the plan's step estimate runs both
    at the chip's rate (:func:`posttrain.plan.report.judge`).

    Args:
      cfg: the model (its ``layer_types`` and each type's ``attention``).
      rows, seq: the step's rows and tokens per row.
      backward: a train step (forward and backward, 3x); else a forward.

    Raises:
      ValueError: ``rows`` or ``seq`` < 1.
    """
    if rows < 1 or seq < 1:
        raise ValueError(f"rows={rows} and seq={seq} must be >= 1")
    per_token = 0.0
    for layer_type in cfg.layer_types:
        attn = cfg.attention[layer_type]
        keys = seq if attn.sliding_window is None else min(seq, attn.sliding_window)
        per_token += 4.0 * attn.num_heads * attn.head_dim * keys
    return per_token * (3 if backward else 1) * rows * seq
