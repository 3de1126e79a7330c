"""One SFT run end to end: the supervised run (:mod:`posttrain.training.supervised`) of
``posttrain sft``'s options; ``--vision`` runs are :func:`posttrain.vision.run.run_vision`'s
(``posttrain sft`` picks it).

``run_sft(SFTConfig())`` is what ``posttrain sft`` does with no arguments:
``qwen3-tiny`` on the embedded ``pydoc_data`` Q/A set and the embedded byte
tokenizer, on every device on ``fsdp``; the output directory is the supervised run's.
"""

from __future__ import annotations

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
      ValueError: a bad config, mesh, model, tokenizer or dataset (one line naming it);
        ``vision`` set (its images are :func:`posttrain.vision.run.run_vision`'s).
    """
    if cfg.vision:
        raise ValueError("run_sft: --vision runs are posttrain.vision.run.run_vision's")
    return run_supervised(cfg, trainer_class=trainer_class, on_built=on_built, log_every=log_every)
