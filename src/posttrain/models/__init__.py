"""Decoder models and per-family presets."""

from posttrain.models.causal_lm import CausalLM
from posttrain.models.decoder import Decoder, stack_layers, unstack_layers
from posttrain.models.presets import PRESETS, get_config

__all__ = ["CausalLM", "Decoder", "PRESETS", "get_config", "stack_layers", "unstack_layers"]
from posttrain.models.params import build_model, flat_params, load_flat_params  # noqa: E402

__all__ += ["build_model", "flat_params", "load_flat_params"]
