"""A run's tokenizer and trainable model, from its options."""

from __future__ import annotations

import os

from posttrain.loading import load_trainable, recorded_tokenizer
from posttrain.tokenizer import load_tokenizer


def run_tokenizer_path(cfg, hf_dir: str | None) -> str | None:
    """Where a run's tokenizer comes from: ``cfg.tokenizer``; else the model directory's
    ``tokenizer.json``; else the tokenizer recorded by the run that exported it
    (``posttrain.loading.recorded_tokenizer``: ``posttrain dpo --model
    runs/sft/model-step60`` continues with the SFT run's); else None, the embedded byte
    tokenizer."""
    if cfg.tokenizer is not None or not hf_dir:
        return cfg.tokenizer
    if os.path.isfile(os.path.join(hf_dir, "tokenizer.json")):
        return hf_dir
    return recorded_tokenizer(hf_dir)


def run_tokenizer(cfg, hf_dir: str | None):
    """The tokenizer at :func:`run_tokenizer_path`."""
    return load_tokenizer(run_tokenizer_path(cfg, hf_dir))


def pad_id_of(tok) -> int:
    """The id padding is written with: the first of ``<|pad|>``, ``<|endoftext|>``,
    ``<pad>``, ``</s>`` the tokenizer has, else 0 (masks, not this id, mark padding)."""
    for name in ("<|pad|>", "<|endoftext|>", "<pad>", "</s>"):
        if tok.token_to_id(name) is not None:
            return tok.token_to_id(name)
    return 0


def load_run_model(cfg, mesh, tok):
    """:func:`posttrain.loading.load_trainable` with a run config's ``model``,
    ``lora_rank``, ``lora_alpha``, ``seed``, ``remat``, ``scan_layers`` and
    ``attention_kernel`` (an HF
    directory is converted beside ``output``); ``posttrain sft`` and ``dpo``."""
    return load_trainable(
        cfg.model,
        mesh,
        vocab_size=tok.get_vocab_size(),
        lora_rank=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        seed=cfg.seed,
        scratch=cfg.output,
        remat=cfg.remat,
        scan_layers=cfg.scan_layers,
        attention_kernel=cfg.attention_kernel,
    )
