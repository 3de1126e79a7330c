"""LoRA and QLoRA through Qwix: apply, merge / unmerge, adapter save / load, PEFT export.

The only package that imports Qwix (STYLE.md). Modules:

* :mod:`.config`: :class:`LoraConfig` and the default targets.
* :mod:`.apply`: :func:`apply_lora` on any mesh the model allows.
* :mod:`.checks`: what ``apply_lora`` refuses (config, rank, state left behind).
* :mod:`.layout`: where adapters live and how A and B factor each weight.
* :mod:`.merge`: :func:`lora_deltas`, :func:`merge_lora`, :func:`unmerge_lora`.
* :mod:`.adapters`: :func:`save_adapter`, :func:`load_adapter`, :func:`export_peft`.
"""

from posttrain.lora.adapters import export_peft, load_adapter, save_adapter
from posttrain.lora.apply import apply_lora, dummy_batch_shape, lora_params, module_paths
from posttrain.lora.config import LoraConfig, default_target
from posttrain.lora.merge import base_weights, lora_deltas, merge_lora, unmerge_lora

__all__ = [
    "LoraConfig",
    "apply_lora",
    "base_weights",
    "default_target",
    "dummy_batch_shape",
    "export_peft",
    "load_adapter",
    "lora_deltas",
    "lora_params",
    "merge_lora",
    "module_paths",
    "save_adapter",
    "unmerge_lora",
]
