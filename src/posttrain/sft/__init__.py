"""Supervised fine-tuning on Tunix's ``PeftTrainer``. The only package that imports Tunix.

Modules, in data-flow order:

* :mod:`posttrain.tokenizer` (every run's): an HF ``tokenizers`` JSON file, or the
  embedded byte tokenizer;
* :mod:`.default_data`: the embedded dataset (Q/A from CPython's ``pydoc_data``);
* :mod:`.data`: chat JSONL -> ChatML tokens + assistant loss mask -> padded or
  packed rows -> micro-batches carrying the step's target-token count;
* :mod:`.loss`: masked next-token NLL, packing masks, the step objective;
* :mod:`.tunix_compat`: what differs between Tunix releases: the train-step
  convention, the trainer base class, the optimizer state <= 0.1.5 does not checkpoint;
* :mod:`.trainer`: ``SFTTrainer`` (imports Tunix): the step and Tunix's hooks;
* :mod:`.metrics`: the per-step records (``metrics.jsonl``, the stdout line);
* :mod:`.options`: ``SFTConfig``, ``posttrain sft``'s options (on
  :mod:`posttrain.runs.options`, which every run shares);
* :mod:`.run`: ``run_sft``, what ``posttrain sft`` runs.
"""
