"""Training on images (``posttrain sft --vision``), on the training base
(:mod:`posttrain.training`); the tower's config is :mod:`posttrain.vision_config`, beside
:mod:`posttrain.config` which reads it.

- :mod:`.data`: TRL's vision chat JSONL -> images prepared as the tower takes them ->
  tokens with the image placeholders expanded;
- :mod:`.default_data`: the embedded set (drawn shapes and their questions);
- :mod:`.rows`: one conversation per row, images padded per row, the held-out scores;
- :mod:`.run`: what a vision run adds to the supervised run, and ``run_vision``.
"""
