"""The cases of ``python -m harness.tools.divergence --case NAME``: the tests' own float32
computations that a v5e failed (docs/testing.md, "The fourth session's runs"), each as
``(function, arguments)`` for :func:`harness.tools.divergence.divergence`.

* ``dpo-loss``: ``contracts/test_tunix_dpo.py``'s hand case at beta 0.1 without label
  smoothing (its ``(0.1, 0.0)`` case): the loss and the chosen and rejected summed
  log-probabilities of fixed logits ``[2, 3, 3]``.
* ``gemma4-routing``: ``tests/test_moe.py``'s ``test_gemma4_routing_matches_hf`` block
  and inputs: the block's output ``[1, 9, d_model]``.
* ``forward:PRESET``: the preset's logits ``[3, 16, vocab]`` on the conversion-parity
  tests' padded batch (:func:`posttrain.conversion.parity.make_batch`: a full row, a
  right- and a left-padded one), layers unscanned (a scan stays one equation), parameters
  initialised on the host.

Each case imports what it runs inside its function (Tunix with the DPO contract,
hypothesis with test_moe, the conversion package with a forward): naming the cases loads
none of them.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
from flax import nnx

from posttrain.models import PRESETS, build_model, get_config

CASES = ("dpo-loss", "gemma4-routing")
"""The cases without a parameter; ``forward:PRESET`` takes any of :data:`PRESETS`."""
FORWARD = "forward:"

Case = tuple[Callable, tuple]


def presets() -> tuple[str, ...]:
    """The presets a ``forward:PRESET`` case takes."""
    return tuple(PRESETS)


def dpo_loss() -> Case:
    """``(loss, chosen log-prob, rejected log-prob)`` of the hand case's logits."""
    from contracts import test_tunix_dpo as dpo

    logits, ids, mask, _, _ = dpo._hand_case()
    hyper = dpo.tunix_dpo._hyper(beta=0.1, label_smoothing=0.0, algorithm="dpo")
    example = dpo._example(ids, mask, (-1.3, -2.9))  # the contract's reference log-probs

    def loss(logits):
        value, metrics = dpo.tunix_dpo.loss_and_metrics(
            dpo.tunix_dpo.loss_fn()(dpo.FixedLogits(logits), train_example=example, **hyper)
        )
        return value, metrics["log_probs/chosen"], metrics["log_probs/rejected"]

    return loss, (logits,)


def gemma4_routing() -> Case:
    """The routing test's block output from its residual and router input."""
    from tests import test_moe as moe

    cfg = moe.MoEConfig(
        num_experts=6,
        top_k=2,
        moe_d_ff=moe.D_FF,
        router_input_norm=True,
        per_expert_scale=True,
        block_size=2,
    )
    graphdef, state = nnx.split(moe.build(cfg, "gelu_tanh", seed=4))
    shape = (1, 9, moe.D_MODEL)
    x, r = moe.inputs(shape, seed=4), moe.inputs(shape, seed=5, scale=3.0)
    return (lambda s, a, b: nnx.merge(graphdef, s)(a, b)[0]), (state, x, r)


def forward(preset: str) -> Case:
    """The preset's logits on the parity batch, keys that are padding masked."""
    from posttrain.conversion import parity

    cfg = get_config(preset, scan_layers=False)
    graphdef, state = nnx.split(build_model(cfg, host_init=True))
    tokens, mask = parity.make_batch(cfg.vocab_size)  # [3, 16] each
    keys = mask.astype(bool)[:, None, :]  # [B, 1, S]
    padding = np.broadcast_to(keys, (mask.shape[0], mask.shape[1], mask.shape[1]))  # [B, T, S]

    def logits(s, t, p, m):
        return nnx.merge(graphdef, s)(t, p, attention_mask=m)[0]

    return logits, (jax.device_get(state), tokens, parity.positions_for(mask), padding)


def case(name: str) -> Case:
    """The case ``name`` (one of :data:`CASES`, or ``forward:`` and a preset)."""
    if name.startswith(FORWARD):
        return forward(name.removeprefix(FORWARD))
    return {"dpo-loss": dpo_loss, "gemma4-routing": gemma4_routing}[name]()
