"""Routed Mixture-of-Experts, in stages: router -> dispatch -> experts -> combine.

* :mod:`.router`: ``Router`` (logits), ``route`` (top-k weights),
  ``load_balancing_loss``.
* :mod:`.dispatch`: ``capacity_mask``, sorting assignments by expert, the
  block layout and its chunks, ``combine_rows``.
* :mod:`.experts`: ``Experts`` with the ``dense``, ``sorted`` and ``ragged``
  algorithms; :mod:`.grouped`: the sorted algorithm's grouped matmul and its
  backward.
* :mod:`.block`: ``MoEBlock`` wiring the stages together.

Importing this package changes no global state.
"""

from posttrain.layers.moe.block import MoEBlock
from posttrain.layers.moe.dispatch import (
    BlockLayout,
    SortedAssignments,
    block_layout,
    capacity_mask,
    chunk_blocks,
    combine_rows,
    default_block_size,
    expert_capacity,
    num_blocks_bound,
    sort_by_expert,
)
from posttrain.layers.moe.experts import Experts
from posttrain.layers.moe.router import Router, Routing, load_balancing_loss, route

__all__ = [
    "BlockLayout",
    "Experts",
    "MoEBlock",
    "Router",
    "Routing",
    "SortedAssignments",
    "block_layout",
    "capacity_mask",
    "chunk_blocks",
    "combine_rows",
    "default_block_size",
    "expert_capacity",
    "load_balancing_loss",
    "num_blocks_bound",
    "route",
    "sort_by_expert",
]
