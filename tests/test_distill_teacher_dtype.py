"""``--teacher-dtype bfloat16``: the teacher's parameters cast once after loading, on
the student's mesh, and what that rounding may do to the distillation loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("tunix.distillation", reason="the installed Tunix has no tunix.distillation")

from posttrain import (
    sharding,  # noqa: E402
    tokenizer,  # noqa: E402
)
from posttrain.distill import loss as distill_loss  # noqa: E402
from posttrain.distill import tunix_distill  # noqa: E402
from posttrain.distill.trainer import (  # noqa: E402
    cast_params,
    labels_fn,
    model_logits,
    shallower,
)
from posttrain.models import build_model, get_config  # noqa: E402
from posttrain.training import data, default_data  # noqa: E402
from tests.meshes import fitted  # noqa: E402

#: bfloat16's unit roundoff: 8 significand bits (7 stored), round to nearest, so a
#: weight w is stored as w (1 + e) with |e| <= 2^-8 (Higham, Accuracy and Stability of
#: Numerical Algorithms, 2nd ed., section 2.1; IEEE-style formats).
BF16_UNIT_ROUNDOFF = 2.0**-8
#: standard deviations of the probabilistic bound below (Hoeffding: a miss has
#: probability <= 2 exp(-LAMBDA^2 / 2) = 3e-8 for independent rounding errors)
LAMBDA = 6.0


def teacher_params(model) -> dict[str, jax.Array]:
    return {
        "/".join(map(str, p)): v[...] for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


def one_batch(rows: int = 4, length: int = 64) -> dict[str, np.ndarray]:
    conversations = [  # short prompts, so each row holds completion tokens
        [{"role": "user", "content": user["content"][:16]}, assistant]
        for user, assistant in default_data.pydoc_conversations()[:16]
    ]
    examples = data.encode_dataset(conversations, tokenizer.byte_tokenizer(), length)
    return {k: v[:rows] for k, v in data.to_rows(examples, length, packing=True).items()}


def test_cast_params_keeps_every_sharding_and_rounds_to_nearest():
    """Each parameter is its float32 value rounded to bfloat16 (relative error <= 2^-8),
    on the same sharding as before the cast."""
    mesh = sharding.make_mesh(fitted({"fsdp": 4, "tensor": 2}))
    model = build_model(get_config("llama3-tiny"), mesh, seed=1)
    before = teacher_params(model)
    after = teacher_params(cast_params(model, "bfloat16"))
    for name, old in before.items():
        new = after[name]
        assert new.dtype == jnp.bfloat16, name
        assert new.sharding.is_equivalent_to(old.sharding, old.ndim), name
        old64, new64 = np.asarray(old, np.float64), np.asarray(new.astype(jnp.float32), np.float64)
        assert np.all(np.abs(new64 - old64) <= BF16_UNIT_ROUNDOFF * np.abs(old64)), name


def objective(teacher, student_logits, batch, strategy):
    """The distillation objective per target token (our masked sum of Tunix's
    per-position loss) with ``teacher``'s logits."""
    tokens, positions, segments = (
        jnp.asarray(batch[k]) for k in ("input_tokens", "positions", "segment_ids")
    )
    terms = distill_loss.distill_terms(
        strategy,
        student_logits,
        model_logits(teacher, tokens, positions, segments),
        tokens,
        jnp.asarray(batch["input_mask"]),
        segments,
    )
    return terms["distill_sum"] / terms["target_tokens"]


@pytest.mark.slow  # ~19 s on a loaded 2-core machine (three models, one gradient)
def test_a_bf16_teacher_moves_the_loss_within_the_rounding_bound(monkeypatch):
    """The loss with the teacher's parameters in bfloat16 is within a bound derived from
    the rounding, of the float32 teacher's loss on the same batch and student.

    Derivation. Casting rounds each teacher weight w_i to w_i + d_i with |d_i| <= u |w_i|,
    u = 2^-8 (the forward then computes in float32, so the rounding of the weights is the
    only change). To first order the loss moves by sum_i g_i d_i, g = d loss / d w at the
    float32 teacher. Modelling the d_i as independent, zero-mean (round to nearest; the
    probabilistic model of Higham & Mary, SIAM J. Sci. Comput. 41(5), 2019), each term is
    bounded by c_i = u |w_i g_i|, and Hoeffding gives |sum_i g_i d_i| <= LAMBDA *
    sqrt(sum_i c_i^2) = LAMBDA u ||w * g||_2 except with probability 2 exp(-LAMBDA^2/2).
    The second-order remainder is O(u^2) against this O(u sqrt(n)) term: neglected.
    Seen failing with the teacher cast to float8_e4m3fn instead (u = 2^-4: the loss moved
    2.9e-3 against a bound of 2.1e-3; bfloat16 moves it 6.3e-5)."""
    mesh = sharding.make_mesh(fitted({"fsdp": 4, "tensor": 2}))
    batch = one_batch()
    student = build_model(shallower(get_config("qwen3-tiny"), 1), mesh, seed=0)
    teacher32 = build_model(get_config("llama3-tiny"), mesh, seed=1)
    teacher16 = cast_params(build_model(get_config("llama3-tiny"), mesh, seed=1), "bfloat16")
    strategy = tunix_distill.logit_strategy(
        model_logits, model_logits, labels_fn(264), temperature=2.0, alpha=0.5
    )
    student_logits = model_logits(
        student,
        *(jnp.asarray(batch[k]) for k in ("input_tokens", "positions", "segment_ids")),
    )
    loss16 = objective(teacher16, student_logits, batch, strategy)
    monkeypatch.setattr(distill_loss, "frozen", lambda x: x)  # g reaches the teacher here
    loss32, grads = nnx.value_and_grad(objective)(teacher32, student_logits, batch, strategy)
    weights = teacher_params(teacher32)
    grads = {"/".join(map(str, p)): v[...] for p, v in nnx.to_flat_state(grads)}
    wg = np.sqrt(sum(float(jnp.sum((weights[k] * grads[k]) ** 2)) for k in weights))
    bound = LAMBDA * BF16_UNIT_ROUNDOFF * wg
    moved = abs(float(loss16) - float(loss32))
    assert 0 < moved <= bound, (moved, bound, float(loss32))
