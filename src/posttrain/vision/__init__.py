"""Training on images (``posttrain sft --vision``), on the training base
(:mod:`posttrain.training`); the tower's config is :mod:`posttrain.vision_config`, beside
:mod:`posttrain.config` which reads it.

- :mod:`.data`: TRL's vision chat JSONL -> images prepared as the tower takes them ->
  tokens with the image placeholders expanded;
- :mod:`.default_data`: the embedded set (drawn shapes and their questions);
- :mod:`.rows`: one conversation per row, images padded per row, the held-out scores;
- :mod:`.run`: what a vision run adds to the supervised run, and ``run_vision``.
"""

from __future__ import annotations

from posttrain.vision.default_data import write_dataset

#: The public entry points: the embedded set drawn to a directory (the matrix's vision cell).
__all__ = ["write_dataset"]
