"""Supervised fine-tuning (``posttrain sft``) on the training base
(:mod:`posttrain.training`: the data, the trainer over Tunix's ``PeftTrainer``, the
supervised run):

* :mod:`.options`: ``SFTConfig``, ``posttrain sft``'s options (on
  :class:`~posttrain.training.options.SupervisedRunOptions`);
* :mod:`.run`: ``run_sft``, what ``posttrain sft`` runs;
* ``vision_*``: what ``--vision`` adds (images, their rows, the held-out figures).
"""

from __future__ import annotations

from posttrain.sft.options import SFTConfig

#: The public entry points (what the harness's matrix runs): the options, the run, and the
#: SFT trainer over a given Tunix ``PeftTrainer`` base (an emulated convention's).
__all__ = ["SFTConfig", "run_sft", "sft_trainer_class"]


def __getattr__(name: str):
    """``run_sft`` and ``sft_trainer_class``, imported when first read: ``posttrain.cli``
    imports this package (for :class:`SFTConfig`) in the base environment, before the
    devices are set, and the run's stack needs Tunix and JAX."""
    if name == "run_sft":
        from posttrain.sft.run import run_sft

        return run_sft
    if name == "sft_trainer_class":
        from posttrain.training.trainer import sft_trainer_class

        return sft_trainer_class
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
