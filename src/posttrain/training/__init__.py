"""The training base: what every workflow (``sft``, its ``--vision`` runs, ``preference``,
``rl``, ``distill``) stands on; no module here imports a workflow.

- The run: its options (:mod:`.options`), directory and record (:mod:`.directory`,
  :mod:`.record`, :mod:`.checks`, :mod:`.stops`), data shards (:mod:`.shards`), model and
  tokenizer (:mod:`.loading`, :mod:`.formats`), optimizer and Tunix training fields
  (:mod:`.optimizer`), export (:mod:`.export`).
- The data: chat JSONL -> template tokens + assistant loss mask -> padded or packed rows
  -> micro-batches (:mod:`.data`); the embedded ``pydoc_data`` Q/A set
  (:mod:`.default_data`).
- The step: masked next-token NLL and the step objective (:mod:`.loss`), the trainer over
  Tunix's ``PeftTrainer`` (:mod:`.trainer`), what differs between Tunix releases
  (:mod:`.tunix_compat`, :mod:`.tunix_loss`), the per-step records (:mod:`.metrics`), the
  model as Tunix's RL and DPO stacks take it (:mod:`.policy`).
- One supervised run end to end (:mod:`.supervised`): ``posttrain sft``, its ``--vision``
  runs, ``distill`` and GRPO's warm-up.
"""

from __future__ import annotations

#: The public entry points: the names of the Tunix train-step conventions the trainer runs
#: under (:data:`.tunix_compat.KNOWN`'s, in its order), what the matrix's entries name.
__all__ = ["CONVENTIONS"]


def __getattr__(name: str):
    """``CONVENTIONS``, read from :mod:`.tunix_compat` when first asked for: every module of
    this package (``posttrain.cli`` imports :mod:`.options`) runs this file first."""
    if name == "CONVENTIONS":
        from posttrain.training.tunix_compat import KNOWN

        return tuple(KNOWN.values())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
