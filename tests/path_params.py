"""Models whose parameters are drawn from their dotted paths (no init program to compile).

Two configs that share a parameter path and shape get the same values for it, so a
model and its perturbed or lower-precision twin can be compared on equal weights.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain import _compat
from posttrain.config import ModelConfig
from posttrain.models import CausalLM
from posttrain.tree import path_name


def is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def path_value(name: str, shape: tuple[int, ...], dtype) -> np.ndarray:
    """A parameter drawn from its dotted path: equal paths and shapes, equal values.

    Norm scales and per-expert scales sit around 1, clip bounds (``*_min`` / ``*_max``)
    around -2 / +2 (ordered, so a few values clamp), the rest around 0 (std 0.3), so no
    parameter keeps an initial zero or one that would hide the field reading it.
    """
    noise = np.random.default_rng(zlib.crc32(name.encode())).normal(0.0, 0.3, shape)
    if name.endswith(("_min", "_max")):  # clip bounds: about +-2, so a few values clamp
        sign = -1.0 if name.endswith("_min") else 1.0
        return (sign * (2.0 + np.abs(noise))).astype(dtype)
    around_one = name.endswith("scale") or "norm" in name or "layer_scalar" in name
    return (noise + 1.0 if around_one else noise).astype(dtype)


def model_with_path_values(cfg: ModelConfig, rounded_to: str | None = None) -> CausalLM:
    """``cfg``'s model (built abstractly: no init program to compile) with every
    parameter from :func:`path_value`, first rounded to ``rounded_to`` (e.g.
    ``"bfloat16"``) when given, so an fp32 twin holds exactly a bf16 model's values."""
    model = nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)))

    def fill(path, variable):
        name = path_name(path)
        abstract = _compat.variable_value(variable)
        value = path_value(name, abstract.shape, rounded_to or abstract.dtype)
        return variable.replace(jnp.asarray(value, abstract.dtype))

    state = jax.tree_util.tree_map_with_path(fill, nnx.state(model, nnx.Param), is_leaf=is_variable)
    nnx.update(model, state)
    return model
