"""A run's export: its final weights, native (LoRA merged) and its adapters."""

from __future__ import annotations

import pathlib

from posttrain import distributed
from posttrain.conversion.native import save_native
from posttrain.lora import lora_params, merge_lora, save_adapter
from posttrain.lora.adapters import adapter_arrays
from posttrain.models.params import flat_params
from posttrain.training.checks import check_exports, replace_empty


def export_final(model, out: pathlib.Path, step: int, *, formats=None) -> list[pathlib.Path]:
    """A run's final weights: ``out/model-step<step>`` (native safetensors, LoRA merged)
    and, for a LoRA model, ``out/adapter-step<step>``; an existing export is kept, an
    empty directory replaced, anything else refused (:func:`posttrain.training.checks.
    check_exports`).
    Returns the directories written (by this process).

    ``formats`` (:class:`posttrain.training.formats.RunFormats`): the model directory also
    gets the run's chat template, tokenizer and ``generation_config.json``, so
    ``posttrain generate`` on it prompts and stops in the format the run trained.

    Across processes every process gathers the weights (a collective) and process 0
    writes them; the others wait until it has.
    """
    writer = distributed.is_writer()
    written = []
    adapter = out / f"adapter-step{step}"
    lora = lora_model = None
    if lora_params(model):
        lora, lora_model = adapter_arrays(model), model  # gathered in every process
        model = merge_lora(model)
    native = out / f"model-step{step}"
    params = flat_params(model)
    # Process 0 writes; a failure there stops every process (no one waits for it).
    with distributed.together(f"export step {step}"):
        if writer:  # an empty directory is replaced; anything else but an export refused
            check_exports(out)
        if writer and lora is not None and replace_empty(adapter):
            written.append(save_adapter(lora_model, adapter, lora))
        if writer and replace_empty(native):
            written.append(save_native(params, model.config, native))
            if formats is not None:
                formats.write(native)
    return written
