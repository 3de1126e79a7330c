"""What every training run shares: its options (:mod:`~posttrain.runs.options`), its run
directory and record (:mod:`~posttrain.runs.directory`, :mod:`~posttrain.runs.record`),
the data shards it reads (:mod:`~posttrain.runs.shards`), its model and tokenizer
(:mod:`~posttrain.runs.loading`), its optimizer and Tunix training fields
(:mod:`~posttrain.runs.training`) and its export (:mod:`~posttrain.runs.export`).
``sft``, ``preference`` and ``rl`` keep only their own parts."""
