"""One SFT run end to end: the supervised run (:mod:`posttrain.training.supervised`) of
``posttrain sft``'s options, with ``--vision``'s images (:mod:`posttrain.sft.vision_run`).

``run_sft(SFTConfig())`` is what ``posttrain sft`` does with no arguments:
``qwen3-tiny`` on the embedded ``pydoc_data`` Q/A set and the embedded byte
tokenizer, on every device on ``fsdp``; the output directory is the supervised run's.
"""

from __future__ import annotations

from posttrain.sft import vision_run
from posttrain.sft.options import SFTConfig
from posttrain.training.supervised import SFTResult, run_supervised

__all__ = ["SFTConfig", "SFTResult", "run_sft"]


def run_sft(
    cfg: SFTConfig,
    *,
    trainer_class: type | None = None,
    on_built=None,
    log_every: int | None = None,
) -> SFTResult:
    """Runs (or resumes) one SFT run (:func:`~posttrain.training.supervised.run_supervised`).

    Raises:
      ValueError: a bad config, mesh, model, tokenizer or dataset (one line naming it).
    """
    return run_supervised(
        cfg,
        trainer_class=trainer_class,
        on_built=on_built,
        log_every=log_every,
        prepare_images=vision_run.prepare if cfg.vision else None,
    )
