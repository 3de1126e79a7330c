"""The distillation taps (``posttrain.models.taps``) cost the plain forward nothing: its
jaxpr is the one without them, and Tunix's wrapping leaves none of itself behind."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from posttrain.models import build_model, get_config, taps

TOKENS = jnp.ones((2, 8), jnp.int32)


def jaxpr(model) -> jax.core.ClosedJaxpr:
    graphdef, state = nnx.split(model)

    def forward(state, tokens):
        return nnx.merge(graphdef, state).forward(tokens)[0]

    return jax.make_jaxpr(forward)(state, TOKENS)


def remat_outputs(closed) -> list[int]:
    """The output count of each per-layer ``jax.checkpoint`` in the jaxpr."""
    return [
        len(e.outvars)
        for e in closed.jaxpr.eqns
        if "checkpoint" in e.primitive.name or "remat" in e.primitive.name
    ]


@pytest.mark.parametrize("remat", [pytest.param("none", marks=pytest.mark.slow), "full"])
def test_the_plain_forward_is_the_forward_without_taps(remat, monkeypatch):
    """The plain forward's jaxpr equals the one where the taps are skipped at their call
    sites and nothing is read back from the layer copies; under remat each layer's
    checkpoint returns only ``(out, moe_aux_loss)``."""
    model = build_model(get_config("llama3-tiny").replace(remat=remat), seed=0)
    plain = str(jaxpr(model))
    if remat == "full":
        assert remat_outputs(jaxpr(model)) == [2, 2]
    with monkeypatch.context() as patch:
        patch.setattr(taps.LayerOutput, "__call__", lambda self, x: x)
        patch.setattr(taps.AttentionOutput, "__call__", lambda self, x: x)
        patch.setattr(taps, "sown", lambda module: nnx.State({}))
        assert str(jaxpr(model)) == plain


def test_tunix_wrapping_round_trips_to_the_plain_forward():
    """Wrapped (Tunix's ``SowedModule``) the forward sows one feature per layer (the
    checkpoint returns it); unwrapped (``post_process_models``) its jaxpr is the plain one
    again, and no parameter path moved on the way."""
    pytest.importorskip("tunix.distillation", reason="the installed Tunix has no distillation")
    from tunix.distillation import feature_extraction

    model = build_model(get_config("llama3-tiny").replace(remat="full"), seed=0)
    plain = str(jaxpr(model))
    paths = {p for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    feature_extraction.wrap_model_with_sowed_modules(model, [taps.LayerOutput])
    assert remat_outputs(jaxpr(model)) == [3, 3]  # (out, aux) and the sown output
    assert {p for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))} == paths
    feature_extraction.unwrap_sowed_modules(model)
    assert str(jaxpr(model)) == plain
