"""Preference tuning through Tunix: DPO, and ORPO where the release has it, over our model.

- :mod:`posttrain.preference.data`: preference JSONL (TRL's two forms) -> Tunix's
  tokenized ``TrainingInput`` arrays.
- :mod:`posttrain.preference.default_data`: the embedded pairs.
- :mod:`posttrain.preference.tunix_dpo`: the adapter to Tunix's DPO trainer, config and
  loss (every release's drift, detected by feature).
- :mod:`posttrain.preference.trainer`: our step over Tunix's ``DPOTrainer``.
- :mod:`posttrain.preference.options`: ``DPORunConfig``, ``posttrain dpo``'s options.
- :mod:`posttrain.preference.run`: one run end to end (``posttrain dpo``).
"""
