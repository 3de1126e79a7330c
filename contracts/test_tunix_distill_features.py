"""Contracts on Tunix's feature and attention distillation strategies around our model's
taps (``posttrain.distill.features``, ``posttrain.models.taps``): each release row runs
them against its installed Tunix. Facts read from google-tunix 0.1.5 and 0.1.7's
``tunix/distillation/strategies`` and ``feature_extraction`` (the same in both and main):
the strategies wrap a module type in ``SowedModule`` (``pre_process_models``), stack what
it sowed in model order, average-pool (pooling, attention) or take the MSE (projection)
against the teacher's, and add ``(1 - alpha)`` x the cross-entropy."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

pytestmark = pytest.mark.matmul_precision("highest")

pytest.importorskip("tunix.distillation", reason="the installed Tunix has no tunix.distillation")

from posttrain import sharding  # noqa: E402
from posttrain.distill import features, tunix_distill  # noqa: E402
from posttrain.distill import loss as distill_loss  # noqa: E402
from posttrain.distill.trainer import (  # noqa: E402
    distill_trainer_class,
    labels_fn,
    model_logits,
    shallower,
)
from posttrain.models import build_model, get_config  # noqa: E402
from posttrain.models.taps import AttentionOutput, LayerOutput  # noqa: E402
from posttrain.training import data  # noqa: E402
from posttrain.training.trainer import SFTOptions  # noqa: E402
from tests.meshes import fitted  # noqa: E402

MESH = fitted({"fsdp": 4, "tensor": 2})
FEATURES = tuple(features.TAPS)


def strategy(name, alpha=0.3):
    return features.feature_strategy(name, model_logits, model_logits, labels_fn(264), alpha=alpha)


@pytest.mark.contract("tunix.distillation.strategies feature strategies: arguments")
def test_the_feature_strategies_take_the_arguments_we_pass():
    """Pooling: ``feature_layer``; attention transfer (a pooling subclass):
    ``attention_layer``; projection: ``feature_layer``, ``dummy_input``, ``rngs``."""
    for name in FEATURES:
        s = strategy(name, alpha=0.25)
        assert (s.feature_layer, s.alpha) == (features.TAPS[name], 0.25), name
        assert features.strategy_name(s) == name
    logit = tunix_distill.logit_strategy(
        model_logits, model_logits, labels_fn(264), temperature=1.0, alpha=0.5
    )
    assert features.strategy_name(logit) == "logit"
    with pytest.raises(ValueError, match="^object: not one of Tunix's strategies$"):
        features.strategy_name(object())
    pooling = tunix_distill.strategy_class("feature-pooling")
    assert issubclass(tunix_distill.strategy_class("attention-transfer"), pooling)


# --- the loss, by hand --------------------------------------------------------------


def batch(seed=0, b=2, t=6, v=11, student=(2, 6), teacher=(3, 8)):
    rng = np.random.default_rng(seed)
    logits = jnp.asarray(rng.normal(size=(b, t, v)) * 2, jnp.float32)
    s_feat = jnp.asarray(rng.normal(size=(student[0], b, t, student[1])), jnp.float32)
    t_feat = jnp.asarray(rng.normal(size=(teacher[0], b, t, teacher[1])), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, v, size=(b, t)), jnp.int32)
    mask = jnp.asarray([[0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0]], jnp.int32)
    segments = jnp.asarray([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]], jnp.int32)
    return logits, s_feat, t_feat, tokens, mask, segments


def pool(x, size):
    """Average pooling of one axis to ``size`` as Tunix's VALID pooling: stride
    ``n // size``, window ``n - (size - 1) * stride``."""
    n = x.shape[0]
    stride = n // size
    window = n - (size - 1) * stride
    return np.stack([x[i * stride : i * stride + window].mean(0) for i in range(size)])


def by_hand(logits, s_feat, t_feat, tokens, mask, segments, *, alpha, kind):
    """sum over targets of alpha feature_loss + (1 - alpha) CE(student, next token), in
    float64: pooled cosine distance (mean over the student's layers) or MSE."""
    lg, sf, tf, y = (np.asarray(x, np.float64) for x in (logits, s_feat, t_feat, tokens))
    total = 0.0
    for i in range(lg.shape[0]):
        for t in range(lg.shape[1] - 1):
            target = mask[i, t + 1] and segments[i, t + 1] == segments[i, t] and segments[i, t + 1]
            if not target:
                continue
            s, te = sf[:, i, t], tf[:, i, t]  # [L_s, D_s], [L_t, D_t]
            if kind == "pooled":
                te = pool(pool(te, s.shape[0]).T, s.shape[1]).T  # layers, then d_model
                cos = np.sum(s * te, -1) / np.linalg.norm(s, axis=-1) / np.linalg.norm(te, axis=-1)
                feature = np.mean(1 - cos)
            else:
                feature = np.mean((s - te) ** 2)
            ce = -(lg[i, t, int(y[i, t + 1])] - np.logaddexp.reduce(lg[i, t]))
            total += alpha * feature + (1 - alpha) * ce
    return total


@functools.cache
def jitted_distill_sum(name, alpha):
    """The summed objective of ``name``'s strategy as one jitted program (as the trainer
    runs it; on a chip each eager op is a compile of its own)."""
    st = strategy(name, alpha)

    @jax.jit
    def distill_sum(logits, s_feat, t_feat, tokens, mask, segments):
        student = {"logits": logits, "features": s_feat}
        return distill_loss.distill_terms(st, student, t_feat, tokens, mask, segments)[
            "distill_sum"
        ]

    return distill_sum


def ours(name, logits, s_feat, t_feat, tokens, mask, segments, alpha=0.3):
    return float(jitted_distill_sum(name, alpha)(logits, s_feat, t_feat, tokens, mask, segments))


@pytest.mark.contract("tunix.distillation.strategies feature strategies: compute_loss")
@pytest.mark.parametrize("name", FEATURES)
def test_the_masked_feature_loss_is_the_hand_computed_one(name):
    """Alpha 0.3: Tunix's per-position feature loss, summed over target positions, equals
    the hand computation (pooling: a teacher 3 layers deep and 8 wide pooled to 2 x 6);
    each broken variant does not."""
    kind = "mse" if name == "feature-projection" else "pooled"
    shapes = {"student": (3, 8)} if kind == "mse" else {}  # the projection already ran
    logits, s_feat, t_feat, tokens, mask, segments = batch(**shapes)
    want = by_hand(logits, s_feat, t_feat, tokens, mask, segments, alpha=0.3, kind=kind)
    got = ours(name, logits, s_feat, t_feat, tokens, mask, segments)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    broken = {
        "the teacher's layers reversed": ours(
            name, logits, s_feat, np.asarray(t_feat)[::-1], tokens, mask, segments
        ),
        "features one position late": ours(
            name, logits, s_feat, np.roll(t_feat, 1, axis=2), tokens, mask, segments
        ),
        "prompt and padding in": ours(
            name, logits, s_feat, t_feat, tokens, np.ones_like(mask), np.ones_like(segments)
        ),
    }
    for what, value in broken.items():
        assert not np.isclose(value, want, rtol=1e-3), what


@pytest.mark.parametrize("name", FEATURES)
def test_no_gradient_reaches_the_teacher_features(name, monkeypatch):
    shapes = {"student": (3, 8)} if name == "feature-projection" else {}
    logits, s_feat, t_feat, tokens, mask, segments = batch(**shapes)
    s = strategy(name, alpha=0.5)

    def grad_wrt_teacher():
        def f(teacher):
            student = {"logits": logits, "features": s_feat}
            terms = distill_loss.distill_terms(s, student, teacher, tokens, mask, segments)
            return terms["distill_sum"]

        return np.abs(np.asarray(jax.jit(jax.grad(f))(t_feat))).max()

    assert grad_wrt_teacher() == 0.0
    monkeypatch.setattr(distill_loss, "frozen", lambda x: x)  # broken: not stopped
    assert grad_wrt_teacher() > 1e-4


# --- the features our model gives Tunix ----------------------------------------------


def by_layer_calls(model, tokens):
    """``(layer outputs, attention outputs)``, each ``[L, B, T, D]``: the decoder's layers
    called one by one on the embeddings (the hand reference for the taps)."""
    decoder = model.model
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    tables = decoder._tables(positions, None)
    x = decoder.embed_tokens(tokens)
    outs, attns = [], []
    for layer, kind in zip(decoder.layers, decoder.cfg.layer_types, strict=True):
        cos, sin, mask = tables[kind]
        attns.append(layer.self_attn(layer.input_layernorm(x), cos, sin, mask))
        x, _ = layer(x, cos, sin, mask)
        outs.append(x)
    return jnp.stack(outs), jnp.stack(attns)


@pytest.mark.contract("tunix.distillation.feature_extraction sow and pop")
@pytest.mark.parametrize("remat", [pytest.param("none", marks=pytest.mark.slow), "full"])
def test_the_taps_give_each_layers_output_in_layer_order(remat):
    """Three layers, wrapped by Tunix's ``wrap_model_with_sowed_modules``, run through
    Tunix's jitted forward (``nnx.jit``; under remat too): the stacked features are each
    layer's output (``LayerOutput``) and attention output (``AttentionOutput``) in order,
    popped (a second forward gives three again, not six)."""
    from tunix.distillation import feature_extraction

    config = get_config("llama3-tiny").replace(num_layers=3, layer_types=("full",) * 3, remat=remat)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 264, (2, 7)), jnp.int32)
    # both references in one program (jitted: eager ops are slow)
    wants = nnx.jit(by_layer_calls)(build_model(config, seed=3), tokens)
    for tap, index in ((LayerOutput, 0), (AttentionOutput, 1)):
        model = build_model(config, seed=3)
        want = wants[index]
        feature_extraction.wrap_model_with_sowed_modules(model, [tap])
        forward = nnx.jit(model_logits)
        for read in (features.stacked, features.student_features):  # a bare student's
            forward(model, tokens)
            got = read(model)
            assert got.shape == want.shape, tap
            np.testing.assert_allclose(got, want, atol=1e-5, err_msg=tap.__name__)
        feature_extraction.unwrap_sowed_modules(model)
        assert not jax.tree.leaves(nnx.state(model, nnx.Intermediate))


def test_the_projection_maps_each_token_by_hand():
    rngs = nnx.Rngs(0)
    projection = features.FeatureProjection((2, 5), (3, 7), rngs=rngs)
    x = np.random.default_rng(1).normal(size=(2, 4, 6, 5)).astype(np.float32)
    kernel, bias = np.asarray(projection.kernel[...]), np.asarray(projection.bias[...])
    want = np.einsum("lbtd,ldme->mbte", x, kernel) + bias[:, None, None, :]
    np.testing.assert_allclose(projection(jnp.asarray(x)), want, rtol=1e-5, atol=1e-6)
    assert kernel.shape == (2, 5, 3, 7) and np.abs(kernel).max() > 0


# --- refusals -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "student", "teacher", "message"),
    [
        ("feature-pooling", {"num_layers": 3}, {}, "expected a student no deeper and no wider"),
        (
            "attention-transfer",
            {"d_model": 96},
            {},
            r"\[2 layers, d_model 72\] to the student's \[2, 96\]",
        ),
        ("feature-projection", {"scan_layers": True}, {}, "the student's layers are scanned"),
        ("feature-pooling", {}, {"scan_layers": True}, "the teacher's layers are scanned"),
    ],
)
def test_what_a_strategy_cannot_read_is_refused_in_one_line(name, student, teacher, message):
    base = get_config("llama3-tiny")
    if "num_layers" in student:
        student = {**student, "layer_types": ("full",) * student["num_layers"]}
    with pytest.raises(ValueError, match=f"^--strategy '{name}'.*{message}") as error:
        features.check_models(name, base.replace(**student), base.replace(**teacher))
    assert "\n" not in str(error.value)
    deeper = base.replace(num_layers=3, layer_types=("full",) * 3)
    features.check_models("feature-projection", deeper, base)  # the projection maps any shape
    for name in features.TAPS:  # a student as deep and as wide as its teacher
        features.check_models(name, base, base)


# --- a real run -----------------------------------------------------------------------


def params(model, kind=nnx.Param) -> dict[str, np.ndarray]:
    return {
        "/".join(map(str, p)): np.asarray(v[...])
        for p, v in nnx.to_flat_state(nnx.state(model, kind))
    }


def feature_trainer(name, *, lora=False, steps=3):
    mesh = sharding.make_mesh(MESH)
    student = build_model(shallower(get_config("qwen3-tiny"), 1), mesh, seed=0)
    if lora:
        from posttrain.lora import LoraConfig, apply_lora

        student = apply_lora(student, mesh, LoraConfig(rank=4, alpha=8.0))
    teacher = build_model(get_config("llama3-tiny"), mesh, seed=1)
    config = tunix_distill.config_class()(eval_every_n_steps=1000, max_steps=steps)
    return distill_trainer_class()(
        student,
        teacher,
        strategy(name, alpha=0.9),
        optax.adam(1e-2),
        config,
        options=SFTOptions(mesh=mesh),
    )


def eight_rows():
    """8 packed rows of 64 tokens of the embedded data: every step trains on the same
    batch, so its logged loss is comparable across steps."""
    from posttrain import tokenizer
    from posttrain.training import default_data

    conversations = [
        [{"role": "user", "content": user["content"][: 8 + 4 * (i % 7)]}, assistant]
        for i, (user, assistant) in enumerate(default_data.pydoc_conversations()[:40])
    ]
    examples = data.encode_dataset(conversations, tokenizer.byte_tokenizer(), 64)
    return {k: v[:8] for k, v in data.to_rows(examples, 64, packing=True).items()}


# In the gate: the projection on a full student (the most machinery: Tunix's pre- and
# post-processing, the wrapper, the trained projection; ~4 s); the rest in the slow tier.
REAL_RUNS = [
    pytest.param(
        name,
        lora,
        id=f"{name}-{'lora' if lora else 'full'}",
        marks=() if (name, lora) == ("feature-projection", False) else pytest.mark.slow,
    )
    for name in FEATURES
    for lora in (False, True)
]


@pytest.mark.contract("tunix.distillation.DistillationTrainer feature strategies")
@pytest.mark.parametrize(("name", "lora"), REAL_RUNS)
def test_a_real_run_lowers_the_feature_loss_not_the_teacher(name, lora):
    """4 steps on one batch (alpha 0.9: mostly the features): the objective falls; the
    teacher is bit-identical; Tunix's ``close()`` hands back the bare student (taps
    unwrapped, no projection); the projection trains, with LoRA's adapters too."""
    from tunix.distillation.feature_extraction import SowedModule

    trainer = feature_trainer(name, lora=lora, steps=4)
    wrapper = trainer.model
    assert isinstance(wrapper, features.ProjectedStudent) == (name == "feature-projection")
    projection = (
        params(wrapper.projection, nnx.LoRAParam if lora else nnx.Param)
        if (name == "feature-projection")
        else {}
    )
    teacher = params(trainer.teacher_model)
    trainer.train(data.batches(eight_rows(), 8, 1))
    losses = [r["loss"] for r in trainer.history]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    assert all(r["kl"] is None for r in trainer.history)
    student = trainer.model
    assert not isinstance(student, features.ProjectedStudent)
    assert not any(isinstance(m, SowedModule) for _, m in nnx.iter_graph(student))
    assert not any(isinstance(m, SowedModule) for _, m in nnx.iter_graph(trainer.teacher_model))
    after = params(trainer.teacher_model)
    assert all(np.array_equal(v, after[k]) for k, v in teacher.items())  # bit-identical
    kind = nnx.LoRAParam if lora else nnx.Param
    trained = params(wrapper.projection, kind) if projection else {}
    assert all(not np.array_equal(v, trained[k]) for k, v in projection.items())
