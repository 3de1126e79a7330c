"""Supervised fine-tuning (``posttrain sft``) on the training base
(:mod:`posttrain.training`: the data, the trainer over Tunix's ``PeftTrainer``, the
supervised run):

* :mod:`.options`: ``SFTConfig``, ``posttrain sft``'s options (on
  :class:`~posttrain.training.options.SupervisedRunOptions`);
* :mod:`.run`: ``run_sft``, what ``posttrain sft`` runs;
* ``vision_*``: what ``--vision`` adds (images, their rows, the held-out figures).
"""
