"""``MoEConfig`` refuses each field it cannot run with one line naming the value, and
accepts each field at its edge."""

from __future__ import annotations

import re

import pytest

from posttrain.config import MoEConfig

pytestmark = pytest.mark.host

FIELDS = {"num_experts": 4, "top_k": 2, "moe_d_ff": 8}

REFUSED = {
    "no-experts": ({"num_experts": 0, "top_k": 0}, "num_experts=0 must be >= 1"),
    "top-k-0": ({"top_k": 0}, "top_k=0 must be in [1, num_experts=4]"),
    "top-k-over-experts": ({"top_k": 5}, "top_k=5 must be in [1, num_experts=4]"),
    "moe-d-ff-0": ({"moe_d_ff": 0}, "moe_d_ff=0 must be >= 1"),
    "scoring": ({"scoring": "relu"}, "scoring='relu' must be softmax or sigmoid"),
    "score-order": (
        {"score_order": "topk"},
        "score_order='topk' must be score_then_topk or topk_then_score",
    ),
    "algorithm": ({"algorithm": "fast"}, "algorithm='fast' must be dense, sorted or ragged"),
    "capacity-0": ({"capacity_factor": 0.0}, "capacity_factor=0.0 must be > 0 or None"),
    "fused-without-scale": (
        {"fuse_expert_scales": True},
        "fuse_expert_scales=True needs per_expert_scale=True",
    ),
    "block-size-0": ({"block_size": 0}, "block_size=0 must be >= 1 or None"),
}

ACCEPTED = {
    "one-expert": {"num_experts": 1, "top_k": 1},
    "top-k-all-experts": {"top_k": 4},
    "moe-d-ff-1": {"moe_d_ff": 1},
    "sigmoid-topk-then-score": {"scoring": "sigmoid", "score_order": "topk_then_score"},
    "dense": {"algorithm": "dense"},
    "ragged": {"algorithm": "ragged"},
    "small-capacity": {"capacity_factor": 0.01},
    "fused-with-scale": {"per_expert_scale": True, "fuse_expert_scales": True},
    "block-size-1": {"block_size": 1},
}


@pytest.mark.parametrize(("changes", "message"), REFUSED.values(), ids=REFUSED.keys())
def test_a_field_it_cannot_run_is_refused_naming_the_value(changes, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        MoEConfig(**(FIELDS | changes))


@pytest.mark.parametrize("changes", ACCEPTED.values(), ids=ACCEPTED.keys())
def test_each_field_at_its_edge_is_accepted(changes):
    config = MoEConfig(**(FIELDS | changes))
    assert all(getattr(config, name) == value for name, value in changes.items())
