"""The SFT loss: masked next-token NLL, packing isolation, global-token normalisation."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain.models import build_model, get_config
from posttrain.training import data, loss


@functools.cache
def model():
    return build_model(get_config("qwen3_moe-tiny"), seed=3)


# Jitted once for the module, the model an argument: a test that runs a program of the same
# shapes as an earlier one reuses its compile (on a chip each program is seconds).
terms_of = nnx.jit(lambda m, rows: loss.sft_terms(m, **rows))
eval_loss_of = nnx.jit(lambda m, rows: loss.eval_loss_fn(m, **rows))
packed_logits = nnx.jit(
    lambda m, tokens, positions, segments: m.forward(
        tokens, positions, loss.packed_attention_mask(segments)
    )[0]
)


def rows_for(lengths, row, seed=0, packing=True):
    rng = np.random.default_rng(seed)
    examples = [
        data.Example(rng.integers(1, 250, n).astype(np.int32), rng.random(n) < 0.6) for n in lengths
    ]
    return examples, data.to_rows(examples, row, packing=packing, pad_id=0)


def hand_nll(logits, rows):
    """Loop form: token t is a target iff masked and in the same non-pad segment as t-1."""
    total, count = 0.0, 0
    logits = np.asarray(logits, np.float64)
    for b in range(logits.shape[0]):
        for t in range(1, logits.shape[1]):
            seg = rows["segment_ids"][b]
            if rows["input_mask"][b, t] and seg[t] > 0 and seg[t] == seg[t - 1]:
                z = logits[b, t - 1]
                logp = z - (np.log(np.sum(np.exp(z - z.max()))) + z.max())
                total -= logp[rows["input_tokens"][b, t]]
                count += 1
    return total, count


def test_nll_matches_a_hand_computed_value():
    _, rows = rows_for([7, 9, 5, 12], 32)
    m = model()
    terms = terms_of(m, {k: jnp.asarray(v) for k, v in rows.items()})
    logits = packed_logits(m, rows["input_tokens"], rows["positions"], rows["segment_ids"])
    want, count = hand_nll(logits, rows)
    assert count == int(data.count_targets(rows).sum()) > 0
    assert float(terms["target_tokens"]) == count
    np.testing.assert_allclose(float(terms["nll_sum"]), want, rtol=1e-5)
    assert float(terms["moe_aux_loss"]) > 0  # qwen3_moe routes: the aux loss is carried


def test_packed_rows_equal_the_conversations_run_alone():
    """Segments do not see each other and positions restart: packing changes nothing."""
    examples, packed = rows_for([6, 11, 8], 32, seed=1)
    _, alone = rows_for([6, 11, 8], 16, seed=1, packing=False)
    assert len(packed["input_tokens"]) == 1 and len(alone["input_tokens"]) == 3
    m = model()
    a = terms_of(m, {k: jnp.asarray(v) for k, v in packed.items()})
    b = terms_of(m, {k: jnp.asarray(v) for k, v in alone.items()})
    assert float(a["target_tokens"]) == float(b["target_tokens"])
    np.testing.assert_allclose(float(a["nll_sum"]), float(b["nll_sum"]), rtol=2e-5)


def test_padding_never_contributes():
    _, rows = rows_for([5, 9], 24, packing=False)
    noisy = dict(rows)
    pad = rows["segment_ids"] == 0
    noisy["input_tokens"] = np.where(pad, 77, rows["input_tokens"]).astype(np.int32)
    noisy["input_mask"] = np.where(pad, 1, rows["input_mask"]).astype(np.int32)  # even masked in
    graphdef, params = nnx.split(model())

    @jax.jit
    def value_and_grad(r):
        return jax.value_and_grad(lambda p: loss.sft_terms(nnx.merge(graphdef, p), **r)["nll_sum"])(
            params
        )

    v1, g1 = value_and_grad({k: jnp.asarray(v) for k, v in rows.items()})
    v2, g2 = value_and_grad({k: jnp.asarray(v) for k, v in noisy.items()})
    assert float(v1) == pytest.approx(float(v2), rel=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-7)


def test_step_objective_is_one_large_batch_not_a_mean_of_means():
    """Micro-batches with different target counts: the mean of their objectives (what
    Tunix's accumulators average) is total NLL / total tokens."""
    terms = [
        {
            "nll_sum": jnp.float32(30.0),
            "target_tokens": jnp.float32(10.0),
            "moe_aux_loss": jnp.float32(0.5),
        },
        {
            "nll_sum": jnp.float32(4.0),
            "target_tokens": jnp.float32(2.0),
            "moe_aux_loss": jnp.float32(1.5),
        },
    ]
    step = jnp.full((4,), 12, jnp.int32)
    each = [loss.step_objective(t, step, moe_aux_weight=0.1, grad_accum_steps=2) for t in terms]
    mean = float(sum(each)) / 2
    assert mean == pytest.approx(34.0 / 12 + 0.1 * (0.5 + 1.5) / 2)
    mean_of_means = (30 / 10 + 4 / 2) / 2
    assert mean != pytest.approx(mean_of_means + 0.1)


def test_step_objective_edges():
    """Without the step count, a micro-batch's objective is its own NLL / its targets,
    whatever k; a single target token divides by 1 (the floor of the denominator only
    guards 0)."""
    terms = {
        "nll_sum": jnp.float32(6.0),
        "target_tokens": jnp.float32(3.0),
        "moe_aux_loss": jnp.float32(0.0),
    }
    assert float(
        loss.step_objective(terms, None, moe_aux_weight=0.0, grad_accum_steps=2)
    ) == pytest.approx(6.0 / 3.0)
    one = jnp.full((4,), 1, jnp.int32)
    assert float(
        loss.step_objective(terms, one, moe_aux_weight=0.0, grad_accum_steps=1)
    ) == pytest.approx(6.0)
    none = jnp.zeros((4,), jnp.int32)  # a step without targets: no division by zero
    assert float(
        loss.step_objective(terms, none, moe_aux_weight=0.0, grad_accum_steps=1)
    ) == pytest.approx(6.0)


@pytest.mark.parametrize("targets", ["many", "one", "none"])
def test_eval_loss_is_the_mean_nll_over_targets(targets):
    """Tunix's eval ``loss_fn(model, **batch)``: (summed NLL / target tokens, the terms),
    down to a batch of one target token; a batch without targets is 0, not NaN."""
    _, rows = rows_for([7, 9, 5, 12], 32)
    if targets != "many":  # keep the first target token only, or none
        seg = rows["segment_ids"]
        same = (seg[:, 1:] > 0) & (seg[:, 1:] == seg[:, :-1])  # t continues t-1's segment
        first = np.argwhere(rows["input_mask"][:, 1:] & same)[0]
        rows["input_mask"] = np.zeros_like(rows["input_mask"])
        rows["input_mask"][first[0], first[1] + 1] = targets == "one"
    m = model()
    batch = {k: jnp.asarray(v) for k, v in rows.items()}
    mean, terms = eval_loss_of(m, batch)
    want, count = hand_nll(
        packed_logits(m, batch["input_tokens"], batch["positions"], batch["segment_ids"]), rows
    )
    assert float(terms["target_tokens"]) == count == {"one": 1, "none": 0}.get(targets, count)
    assert count > 1 or targets != "many"
    assert float(mean) == pytest.approx(want / max(count, 1), rel=1e-5)


def test_without_segment_ids_every_token_is_one_segment():
    """``segment_ids`` omitted: the same terms as one segment covering every token."""
    _, rows = rows_for([30], 32, packing=False)
    m = model()
    batch = {k: jnp.asarray(v) for k, v in rows.items() if k != "segment_ids"}
    ones = {**batch, "segment_ids": np.ones_like(rows["input_tokens"])}
    a, b = terms_of(m, batch), terms_of(m, ones)
    assert float(a["target_tokens"]) == float(b["target_tokens"]) > 0
    assert float(a["nll_sum"]) == pytest.approx(float(b["nll_sum"]), rel=1e-6)
