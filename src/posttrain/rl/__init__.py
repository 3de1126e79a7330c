"""RL through Tunix: GRPO (DAPO, DrGRPO where the release has them) over our model.

- :mod:`posttrain.training.policy`: the model as Tunix's RL stack takes it, and its reference.
- :mod:`posttrain.rl.tunix_rl`: the adapter to Tunix's cluster, learners and configs
  (every release's drift, detected by feature).
- :mod:`posttrain.rl.tunix_cluster`: what a run does to Tunix's cluster once built.
- :mod:`posttrain.rl.rewards`: built-in reward functions and ``module:function``.
- :mod:`posttrain.rl.arithmetic`: the embedded task.
- :mod:`posttrain.rl.options`: ``GRPORunConfig``, ``posttrain grpo``'s options.
- :mod:`posttrain.rl.metrics`: one ``metrics.jsonl`` record per step, the progress line.
- :mod:`posttrain.rl.run`: one run end to end (``posttrain grpo``).
"""
