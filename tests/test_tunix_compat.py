"""The train-step convention detector reads Tunix's own code, not a version string."""

from __future__ import annotations

import importlib.util
import re
import textwrap

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.training import tunix_compat, tunix_loss

pytestmark = pytest.mark.host

JIT_UNBOUND = """
def jit_train_and_eval_step(self, skip_jit=False):
    train_step = self.create_train_step_fn()
    self._jitted_train_step_fn = nnx.jit(train_step, donate_argnames=("optimizer",))
    return self._jitted_train_step_fn, None
"""

JIT_BOUND = """
def jit_train_and_eval_step(self, skip_jit=False, cache_nnx_graph=False):
    train_step = self.create_train_step_fn()
    self._jitted_train_step_fn = nnx.jit(train_step, donate_argnames=({donated}))
    self._jitted_train_step_fn = maybe_cache_and_partial(
        self._jitted_train_step_fn, {bound}
    )
    return self._jitted_train_step_fn, None
"""

TRAIN = """
def train(self, train_ds, eval_ds=None, skip_jit=False):
    train_step, eval_step = self.jit_train_and_eval_step(skip_jit)
    for train_example in train_ds:
        {call}
"""


def sources(call: str, bound: str | None, donated: str = '"optimizer",'):
    jit = JIT_UNBOUND if bound is None else JIT_BOUND.format(bound=bound, donated=donated)
    return textwrap.dedent(TRAIN.format(call=call)), textwrap.dedent(jit)


@pytest.mark.parametrize(
    ("call", "bound", "expected"),
    [
        (
            "train_loss, aux = train_step(self.model, self.optimizer, train_example)",
            None,
            "positional3",
        ),
        (
            "train_loss, aux, grad_norm = train_step(train_example)",
            "self.model, self.optimizer",
            "bound2",
        ),
        (
            "train_loss, aux, grad_norm = train_step(train_example, "
            "is_update_step=jnp.array(is_update, dtype=jnp.bool_))",
            "self.model, self.optimizer, self.grad_accumulator",
            "bound3_update",
        ),
    ],
    ids=["tunix-0.1.5-positional3", "tunix-0.1.7-bound2", "tunix-main-bound3-update"],
)
def test_known_shapes_are_recognised(call, bound, expected):
    """Each of the three documented call shapes maps to its convention name."""
    got = tunix_compat.detect_from_source(*sources(call, bound))
    assert got.name == expected


def test_main_convention_step_parameters():
    """On main the step needs parameters named optimizer and grad_accumulator (donated by name)."""
    got = tunix_compat.detect_from_source(
        *sources(
            "loss, aux, g = train_step(train_example, is_update_step=flag)",
            "self.model, self.optimizer, self.grad_accumulator",
        )
    )
    assert got.step_parameters == (
        "model",
        "optimizer",
        "grad_accumulator",
        "inputs",
        "is_update_step",
    )


@pytest.mark.parametrize(
    ("call", "bound", "found"),
    [
        (
            "loss, aux, g, extra = train_step(train_example)",
            "self.model, self.optimizer",
            "unpacks 4 values",
        ),
        (
            "loss, aux, g = train_step(train_example, micro_step=i)",
            "self.model, self.optimizer",
            "micro_step=...",
        ),
        ("loss, aux, g = train_step(train_example)", "self.model", "binds (model)"),
    ],
    ids=["four-returns", "new-keyword", "model-only-bound"],
)
def test_a_fourth_shape_is_an_error_naming_it(call, bound, found, tmp_path):
    """A shape outside the known table is reported with what was found, not a TypeError later."""
    convention = tunix_compat.detect_from_source(*sources(call, bound))
    assert convention.name == "unknown"
    assert found in convention.describe()

    train_src, jit_src = sources(call, bound)
    body = textwrap.indent(train_src + jit_src, "    ")
    path = tmp_path / "fake_tunix.py"
    path.write_text(f"class PeftTrainer:\n{body}\n")
    spec = importlib.util.spec_from_file_location("fake_tunix", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(tunix_compat.UnknownConventionError, match=re.escape(found)):
        tunix_compat.detect(module.PeftTrainer)


def test_source_without_a_step_call_is_an_error():
    """A train() that never calls train_step is reported, not guessed."""
    with pytest.raises(tunix_compat.UnknownConventionError, match="no `... = train_step"):
        tunix_compat.detect_from_source("def train(self):\n    pass\n", JIT_UNBOUND)


def test_the_convention_carries_what_the_step_donates():
    """main's jit donates the optimizer and the gradient accumulator: the convention says so
    (not the release default of the optimizer alone)."""
    got = tunix_compat.detect_from_source(
        *sources(
            "loss, aux, g = train_step(train_example, is_update_step=flag)",
            "self.model, self.optimizer, self.grad_accumulator",
            donated='"optimizer", "grad_accumulator"',
        )
    )
    assert (got.name, got.donated) == ("bound3_update", ("optimizer", "grad_accumulator"))


def test_a_bare_jit_with_donate_argnames_after_another_keyword_is_read():
    """``jit(train_step, static_argnames=..., donate_argnames="optimizer")`` (jit imported
    by name, the donation not the first keyword) then ``partial``: bound2, donating the
    optimizer."""
    jit = """
    def jit_train_and_eval_step(self):
        self._jitted_train_step_fn = jit(
            train_step, static_argnames=("config",), donate_argnames="optimizer"
        )
        self._jitted_train_step_fn = partial(self._jitted_train_step_fn, self.model, self.optimizer)
    """
    train, _ = sources("loss, aux, g = train_step(train_example)", "self.model, self.optimizer")
    got = tunix_compat.detect_from_source(train, jit)
    assert (got.name, got.bound, got.donated) == ("bound2", ("model", "optimizer"), ("optimizer",))


def test_a_step_jitted_through_a_callee_that_is_no_name_is_an_unknown_shape():
    """``self._compilers["jit"](train_step, ...)``: no jit is recognised, so nothing is read
    as bound or donated and the shape is unknown (reported, not an AttributeError)."""
    jit = """
    def jit_train_and_eval_step(self):
        self._jitted_train_step_fn = self._compilers["jit"](train_step, donate_argnames="x")
    """
    train, _ = sources("loss, aux, g = train_step(train_example)", "self.model, self.optimizer")
    got = tunix_compat.detect_from_source(train, jit)
    assert (got.name, got.bound, got.donated) == ("unknown", (), ())


@flax.struct.dataclass
class _WeightedMetric:
    """Tunix main's ``tunix.sft.utils.WeightedMetric`` (PT@c7d8950f:184), no installable
    release has it: a sum, its denominator, optional eps / min_denom, safe division."""

    unreduced_sum: jax.Array
    denominator: jax.Array
    eps: float | None = flax.struct.field(default=None, pytree_node=False)
    min_denom: float | None = flax.struct.field(default=None, pytree_node=False)

    def compute_scale(self):
        denom = self.denominator
        if self.eps is not None:
            denom = denom + self.eps
        if self.min_denom is not None:
            denom = jnp.maximum(denom, self.min_denom)
        safe = jnp.where(denom == 0, 1.0, denom)
        return jnp.where(denom == 0, 0.0, 1.0 / safe)

    def compute(self):
        return self.unreduced_sum * self.compute_scale()


@flax.struct.dataclass
class _LossOutput:
    """Tunix main's ``tunix.sft.utils.LossOutput`` (PT@c7d8950f:223)."""

    primary_loss: _WeightedMetric
    aux_metrics: dict


@pytest.mark.parametrize(
    ("total", "denominator", "options", "want"),
    [
        (6.0, 4.0, {}, 1.5 + 0.25),
        (6.0, 4.0, {"eps": 1.0, "min_denom": 8.0}, 0.75 + 0.25),
        (0.0, 0.0, {}, 0.0),  # no tokens: the metric stays 0, the term cannot enter
    ],
)
def test_a_term_added_to_mains_loss_output_moves_its_mean_by_the_term(
    total, denominator, options, want
):
    """add_to_loss on main's weighted LossOutput: the primary metric computes to its mean
    plus the term; the aux metrics are untouched; loss_and_metrics reduces both."""
    out = _LossOutput(
        _WeightedMetric(jnp.float32(total), jnp.float32(denominator), **options),
        {"kl": _WeightedMetric(jnp.float32(2.0), jnp.float32(4.0))},
    )
    added = tunix_loss.add_to_loss(out, jnp.float32(0.25))
    loss, metrics = tunix_loss.loss_and_metrics(added)
    np.testing.assert_allclose(float(loss), want, rtol=1e-6)
    assert float(metrics["kl"]) == 0.5
    # the older shapes
    loss, aux = tunix_loss.add_to_loss((jnp.float32(1.0), {"kl": 0.5}), 0.25)
    assert float(loss) == 1.25 and aux == {"kl": 0.5}
    assert float(tunix_loss.add_to_loss(jnp.float32(1.0), 0.25)) == 1.25
    with pytest.raises(tunix_loss.UnknownLossShapeError, match="returned list"):
        tunix_loss.add_to_loss([1.0], 0.25)
