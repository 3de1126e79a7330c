"""Gemma 4's vision tower: HF parity with images, placement of the soft tokens, and what
images may and may not change.

The reference is transformers' own ``Gemma4ForConditionalGeneration`` (``tests/hf_tiny.py``
``build_vision``: gemma4-tiny's text model, a 2-layer tower of width 40, 4 x 4 patches,
2 x 2 pooling, standardised), saved, converted and run on two rows: a 16 x 16 image (16
patches, 4 soft tokens) and an 8 x 16 one padded to 16 patches (2 soft tokens), each
between the template's begin- and end-of-image tokens. Nothing is downloaded.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain import conversion
from posttrain.conversion import parity
from posttrain.conversion.native import load_native
from posttrain.families.gemma4 import gemma4_tiny
from posttrain.families.gemma4_vision import vision_tiny
from posttrain.layers.mlp import CLIP_BOUNDS
from posttrain.layers.vision import ImageBatch, patchify
from posttrain.models import flat_params, load_flat_params
from tests.path_params import model_with_path_values
from tests.test_bf16 import MAX_MEAN_DELTA_PER_STD, MAX_NLL_DELTA, MIN_TOP1_AGREEMENT
from tests.test_conversion_parity import MAX_ABS, MAX_KL

pytestmark = pytest.mark.matmul_precision("highest")

VISION = vision_tiny()
IMG, BOI, EOI = VISION.image_token_id, VISION.boi_token_id, VISION.eoi_token_id
PATCHES = 16  # per image, after padding
SHAPES = ((16, 16), (8, 16))  # (height, width): 4 and 2 soft tokens
SOFT = (4, 2)
TOKENS = np.array(
    [
        [2, 5, BOI, *[IMG] * 4, EOI, 7, 8, 9, 10, 11, 12, 13, 14],
        [2, 20, 21, BOI, *[IMG] * 2, EOI, 30, 31, 32, 33, 34, 35, 36, 37, 38],
    ],
    np.int32,
)


def images(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.random((h, w, 3), dtype=np.float32) for h, w in SHAPES]


def native_images(pictures, patch=patchify) -> ImageBatch:
    """One image per row, patches padded to ``PATCHES`` (pixels 0, positions -1)."""
    pixels, positions = [], []
    for picture in pictures:
        p, pos = patch(picture, VISION.patch_size)
        pad = PATCHES - len(p)
        pixels.append(np.pad(p, ((0, pad), (0, 0))))
        positions.append(np.pad(pos, ((0, pad), (0, 0)), constant_values=-1))
    return ImageBatch(
        jnp.asarray(np.stack(pixels))[:, None], jnp.asarray(np.stack(positions))[:, None]
    )


def hf_images(pictures):
    """HF's own patches and positions (``image_processing_pil_gemma4``), independent of ours."""
    import torch
    from transformers.models.gemma4 import image_processing_pil_gemma4 as proc

    pixels, positions = [], []
    for picture in pictures:
        patches = proc.convert_image_to_patches(picture.transpose(2, 0, 1), VISION.patch_size)
        rows, cols = (s // VISION.patch_size for s in picture.shape[:2])
        x, y = np.meshgrid(np.arange(cols), np.arange(rows), indexing="xy")
        pos = np.stack([x, y], axis=-1).reshape(-1, 2)
        patches, pos = proc.pad_along_first_dim(patches, pos, PATCHES)
        pixels.append(patches)
        positions.append(pos)
    return torch.tensor(np.stack(pixels)), torch.tensor(np.stack(positions)).long()


def hf_logits(model, pictures, tokens=TOKENS) -> np.ndarray:
    import torch

    kwargs = {}
    if pictures is not None:
        pixel_values, position_ids = hf_images(pictures)
        kwargs = dict(pixel_values=pixel_values, image_position_ids=position_ids)
    with torch.no_grad():
        out = model(input_ids=torch.tensor(tokens).long(), **kwargs)
    return out.logits.float().numpy()


@nnx.jit
def forward(model, tokens, batch):
    return model.forward(tokens, images=batch)[0]


@pytest.fixture(scope="module")
def converted(hf_tiny, tmp_path_factory):
    """``(HF model, its directory, the native directory converted from it)``; the model is
    read back from disk, as its in-memory twin holds perturbed non-persistent buffers
    (``embed_scale``) that ``save_pretrained`` does not write."""
    import torch
    import transformers

    tmp = tmp_path_factory.mktemp("vision")
    src = hf_tiny.save(hf_tiny.build_vision(), tmp / "hf")
    conversion.convert_hf_to_native(src, tmp / "native", vision=True)
    model = transformers.Gemma4ForConditionalGeneration.from_pretrained(
        src, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval(), src, tmp / "native"


@pytest.mark.reference
def test_patchify_matches_transformers():
    """Our patches and positions are HF's, value for value, in the same order."""
    for picture in images():
        pixels, positions = hf_images([picture])
        ours, ours_pos = patchify(picture, VISION.patch_size)
        n = len(ours)
        np.testing.assert_array_equal(ours, pixels[0, :n].numpy())
        np.testing.assert_array_equal(ours_pos, positions[0, :n].numpy())


@pytest.mark.reference
def test_vision_logits_match_transformers(converted, tmp_path):
    """HF -> native logits with images match transformers (fp32, the text families' bounds),
    and native -> HF writes the source's tensors bit for bit, tower included."""
    hf, src, native_dir = converted
    pictures = images()
    reference = hf_logits(hf, pictures)
    model = load_native(native_dir, dtype="float32", param_dtype="float32")
    args = jnp.asarray(TOKENS), native_images(pictures)
    got = np.asarray(forward(model, *args))
    result = parity.compare(reference, got, np.ones(TOKENS.shape, np.int32))
    assert result.mean_kl <= MAX_KL, result.line()
    assert result.max_abs <= MAX_ABS, result.line()
    assert result.top1 == 1.0, result.line()
    print(result.line())
    # the fixture reaches its quirks: other pixels, or the clip bounds opened, move the
    # logits far beyond the bound
    assert np.abs(reference - hf_logits(hf, images(seed=1))).max() > 100 * MAX_ABS
    params = flat_params(model)
    opened = {
        k: np.full_like(v, np.inf if "max" in k else -np.inf)
        for k, v in params.items()
        if k.endswith(CLIP_BOUNDS)
    }
    assert len(opened) == 7 * 4 * VISION.num_layers
    unclipped = np.asarray(forward(load_flat_params(model, {**params, **opened}), *args))
    assert np.abs(unclipped - reference).max() > 100 * MAX_ABS

    back = conversion.convert_native_to_hf(native_dir, tmp_path / "back")
    assert back.prefix == "model.language_model."
    reader = conversion.safetensors_io.CheckpointReader
    with reader(src, "model") as a, reader(tmp_path / "back", "model") as b:
        assert sorted(a.tensors) == sorted(b.tensors)
        assert any(k.startswith("model.vision_tower.encoder.layers.1.") for k in a.tensors)
        for key in a.tensors:
            assert a.read(key).tobytes() == b.read(key).tobytes(), key


@pytest.mark.reference
@pytest.mark.slow
def test_vision_bf16_logits_stay_within_the_bf16_bounds(converted):
    """The converted model in bfloat16 against transformers in float32: the bounds
    ``tests/test_bf16.py`` holds the text families to."""
    hf, _, native_dir = converted
    pictures = images()
    want = hf_logits(hf, pictures)
    model = load_native(native_dir, dtype="bfloat16", param_dtype="bfloat16")
    got = np.asarray(forward(model, jnp.asarray(TOKENS), native_images(pictures)))
    assert got.dtype == np.float32
    delta = np.mean(np.abs(got - want)) / np.std(want)
    top1 = np.mean(got.argmax(-1) == want.argmax(-1))

    def nll(logits):
        logp = jax.nn.log_softmax(jnp.asarray(logits[:, :-1]), -1)
        return -float(jnp.take_along_axis(logp, jnp.asarray(TOKENS[:, 1:, None]), -1).mean())

    assert 0 < delta <= MAX_MEAN_DELTA_PER_STD, delta
    assert top1 >= MIN_TOP1_AGREEMENT, top1
    assert abs(nll(got) - nll(want)) <= MAX_NLL_DELTA


@pytest.mark.reference
@pytest.mark.slow
def test_text_only_batch_matches_transformers(converted):
    """No images: the multimodal model's logits are transformers' text-only ones."""
    hf, _, native_dir = converted
    tokens = np.where(TOKENS == IMG, 40, TOKENS)
    model = load_native(native_dir, dtype="float32", param_dtype="float32")
    got = np.asarray(model.forward(jnp.asarray(tokens))[0])
    result = parity.compare(hf_logits(hf, None, tokens), got, np.ones(tokens.shape, np.int32))
    assert result.max_abs <= MAX_ABS, result.line()


# --- properties of the native model (no transformers) ---------------------------------


def vision_model():
    return model_with_path_values(gemma4_tiny().replace(vision=VISION))


@pytest.fixture(scope="module")
def model():
    """One tiny vision model for the property tests (each compile costs seconds)."""
    return vision_model()


@nnx.jit
def placed(model, tokens, batch):
    """``(embeddings with images, text embeddings, projected soft tokens, valid)``."""
    features, valid = model.vision_tower(batch)
    return (
        model.embed_with_images(tokens, batch),
        model.model.embed_tokens(tokens),
        model.embed_vision(features)[:, 0],  # [B, L, D]
        valid[:, 0],
    )


def test_image_tokens_land_where_the_template_puts_them(model):
    """The r-th image token of a row holds the row's r-th soft token (padding skipped);
    every other token keeps its text embedding."""
    out = placed(model, jnp.asarray(TOKENS), native_images(images()))
    embeds, text, soft, valid = (np.asarray(x) for x in out)
    np.testing.assert_array_equal(valid, [[1, 1, 1, 1], [1, 1, 0, 0]])
    for row, count in enumerate(SOFT):
        at = np.flatnonzero(TOKENS[row] == IMG)
        assert len(at) == count
        np.testing.assert_array_equal(embeds[row, at], soft[row, :count])
        rest = TOKENS[row] != IMG
        np.testing.assert_array_equal(embeds[row, rest], text[row, rest])


def test_pixels_change_the_logits_after_the_image_only(model):
    """Another picture in row 0 moves row 0's logits from its first image token on, and
    leaves row 0's earlier tokens and all of row 1 exactly as they were."""
    first = np.asarray(forward(model, jnp.asarray(TOKENS), native_images(images())))
    other = [images(seed=3)[0], images()[1]]
    second = np.asarray(forward(model, jnp.asarray(TOKENS), native_images(other)))
    start = int(np.flatnonzero(TOKENS[0] == IMG)[0])
    np.testing.assert_array_equal(first[0, :start], second[0, :start])
    np.testing.assert_array_equal(first[1], second[1])
    assert np.abs(first[0, start:] - second[0, start:]).min() > 0


def test_text_only_batch_gives_the_text_model_logits(model):
    """Without images, a model with a tower gives its text model's logits bit for bit."""
    tokens = jnp.asarray(np.where(TOKENS == IMG, 40, TOKENS))
    with_tower = forward(model, tokens, None)
    text_only = forward(model_with_path_values(gemma4_tiny()), tokens, None)
    np.testing.assert_array_equal(np.asarray(with_tower), np.asarray(text_only))


@pytest.mark.slow
def test_gradient_reaches_the_projector_and_the_tower():
    """The loss's gradient is nonzero on the projection and on the tower's first layer."""
    model = vision_model()
    batch = native_images(images())

    def loss(model):
        logits = model.forward(jnp.asarray(TOKENS), images=batch)[0]
        return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 0])

    grads = nnx.jit(nnx.grad(loss))(model)
    projector = grads.embed_vision.embedding_projection.kernel[...]
    first = grads.vision_tower.patch_embedder.input_proj.kernel[...]
    assert float(jnp.abs(projector).min(axis=0).max()) > 0
    assert float(jnp.abs(first).sum()) > 0


@pytest.mark.slow
@pytest.mark.devices(8)
def test_sharded_forward_with_images_equals_single_device():
    """On a mesh sharding images and rows (fsdp), heads (tensor) and the sequence and
    patches (context), the logits with images equal the single-device ones."""
    from posttrain import sharding
    from posttrain.models import build_model
    from tests.test_models import SHARDED_ATOL

    cfg = gemma4_tiny().replace(vision=VISION)
    tokens, batch = jnp.asarray(TOKENS), native_images(images())
    want = np.asarray(forward(build_model(cfg), tokens, batch))
    mesh = sharding.make_mesh({"fsdp": 2, "tensor": 2, "context": 2})
    model = build_model(cfg, mesh)
    with sharding.use_mesh(mesh):
        got = np.asarray(forward(model, tokens, batch))
    np.testing.assert_allclose(got, want, atol=SHARDED_ATOL)


def test_vision_config_is_read_only_when_asked_and_refuses_what_it_lacks():
    """A multimodal config reads as its text model by default; with ``vision=True`` its
    tower is read, and a feature the tower lacks fails naming the field."""
    from posttrain.conversion import ConversionError, from_hf_config
    from posttrain.families import gemma4

    cfg = gemma4_tiny().replace(vision=VISION)
    config = gemma4.wrap_hf(cfg, conversion.to_hf_config(cfg))
    assert from_hf_config(config).vision is None
    assert from_hf_config(config, vision=True).vision == VISION
    gelu = dict(config, vision_config=dict(config["vision_config"], hidden_activation="gelu"))
    with pytest.raises(ConversionError, match="vision_config.hidden_activation: 'gelu' is not"):
        from_hf_config(gelu, vision=True)
    with pytest.raises(ConversionError, match="vision_config: a gemma4 checkpoint without"):
        from_hf_config(dict(config, vision_config=None), vision=True)


@pytest.mark.reference
def test_a_vision_field_left_out_reads_as_transformers_default():
    """An empty ``vision_config`` reads as transformers' own default tower (every field
    and the image token ids), a field off its default as given; kv heads follow the
    heads when null; each refusal names its field and value in full."""
    from transformers import Gemma4Config, Gemma4VisionConfig

    from posttrain.conversion import ConversionError
    from posttrain.families.gemma4_vision import vision_from_hf

    full = Gemma4Config(vision_config=Gemma4VisionConfig().to_dict()).to_dict()
    assert vision_from_hf({"vision_config": {}}) == vision_from_hf(full)
    changed = Gemma4VisionConfig(
        rope_parameters={"rope_type": "default", "rope_theta": 50.0},
        rms_norm_eps=1e-5,
        standardize=True,
        use_clipped_linears=True,
    )
    got = vision_from_hf({"vision_config": changed.to_dict()})
    assert (got.rope_theta, got.norm_eps, got.standardize, got.clipped_linears) == (
        50.0,
        1e-5,
        True,
        True,
    )
    assert vision_from_hf({}) is None and vision_from_hf({"vision_config": None}) is None
    heads = {"num_attention_heads": 4, "rope_parameters": None}
    assert vision_from_hf({"vision_config": heads}).num_kv_heads == 4
    grouped = {"vision_config": {**heads, "num_key_value_heads": 2}}
    assert vision_from_hf(grouped).num_kv_heads == 2
    both = {"vision_config": {}, "text_config": {"use_bidirectional_attention": "vision"}}
    assert vision_from_hf(both).bidirectional
    refused = [
        ({"vision_config": "x"}, "vision_config: 'x' is not an object"),
        (
            {"vision_config": {"rope_parameters": {"rope_type": "yarn"}}},
            "vision_config.rope_parameters: rope_type 'yarn': one of default, axial only",
        ),
        (
            {"vision_config": {}, "text_config": {"use_bidirectional_attention": "all"}},
            "text_config.use_bidirectional_attention: 'all' is not supported (None or "
            "'vision' only)",
        ),
    ]
    for config, message in refused:
        with pytest.raises(ConversionError) as error:
            vision_from_hf(config)
        assert str(error.value) == f"config.json {message}"


@pytest.mark.slow
def test_a_cached_prefill_with_images_then_decoding_equals_the_full_forward():
    """The prefill writes the image soft tokens into the KV cache: prefill (images in) plus
    one-token decode steps (no images) give the full forward's logits."""
    check_cached_prefill(vision_model())


def check_cached_prefill(model) -> None:
    """Prefill :data:`TOKENS` past both images (images in), then one-token decode steps
    (no images): their logits equal ``model``'s full forward."""
    from tests.test_generate import INCREMENTAL_ATOL

    tokens, batch = jnp.asarray(TOKENS), native_images(images())
    batch_size, seq = TOKENS.shape
    prefill = 10  # past both images
    positions = jnp.broadcast_to(jnp.arange(seq), (batch_size, seq))
    want = forward(model, tokens, batch)
    cache = model.init_cache(batch_size, seq, "float32")
    step = nnx.jit(lambda m, t, p, c, i: m(t, p, c, None, images=i))
    logits, cache = step(model, tokens[:, :prefill], positions[:, :prefill], cache, batch)
    got = [logits]
    for t in range(prefill, seq):
        logits, cache = step(model, tokens[:, t : t + 1], positions[:, t : t + 1], cache, None)
        got.append(logits)
    got = np.asarray(jnp.concatenate(got, axis=1))
    np.testing.assert_allclose(got, np.asarray(want), atol=INCREMENTAL_ATOL)


@pytest.mark.reference
def test_convert_cli_reads_the_tower_only_with_vision(converted, tmp_path, capsys):
    """``posttrain convert --vision`` keeps the tower; without it the same checkpoint converts
    as its text model (tower tensors ignored); ``--vision`` on a text-only checkpoint is a
    one-line error, exit 2, nothing written."""
    from posttrain import cli
    from posttrain.conversion.native import NativeMeta

    _, src, _ = converted
    hf_native = ["convert", "--from", "hf", "--to", "native"]
    assert cli.main([*hf_native, "--vision", str(src), str(tmp_path / "v")]) == 0
    assert NativeMeta.read(tmp_path / "v").cfg.vision == VISION
    assert cli.main([*hf_native, str(src), str(tmp_path / "t")]) == 0
    assert NativeMeta.read(tmp_path / "t").cfg.vision is None
    assert "87 ignored" in capsys.readouterr().out  # the tower: 31 weights + 56 clip bounds
    assert (
        cli.main(
            [
                "convert",
                "--from",
                "native",
                "--to",
                "hf",
                str(tmp_path / "t"),
                str(tmp_path / "text-hf"),
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert cli.main([*hf_native, "--vision", str(tmp_path / "text-hf"), str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert "vision_config: a gemma4 checkpoint without a vision tower" in err and "\n" not in err
    assert not (tmp_path / "x").exists()


# Every VisionConfig field does what it claims (tests/test_config_sensitivity.py's rule for
# the text configs): a value field perturbed moves the logits with images; the others
# change parameter shapes by construction, or are the data's.
VISION_PERTURBATIONS = {
    "rope_theta": 1000.0,
    "norm_eps": 0.5,
    "pooling_kernel_size": 4,  # 1 soft token per image: row 0's later image tokens repeat it
    "image_token_id": 40,  # text token 40 is never in TOKENS: no image is placed
    "bidirectional": True,  # an image's tokens see its later ones (test_vision_bidirectional)
}
VISION_SHAPES = {  # fields that change the tower's parameters (or its pixel input)
    "d_model",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "d_ff",
    "patch_size",
    "position_embedding_size",
    "standardize",
    "clipped_linears",
}
VISION_DATA = {
    "boi_token_id": "the template's tokens around an image (expand_image_tokens)",
    "eoi_token_id": "as boi_token_id",
}


def test_every_vision_field_is_perturbed_shaped_or_the_data_s():
    import dataclasses

    fields = {f.name for f in dataclasses.fields(VISION)}
    groups = [set(VISION_PERTURBATIONS), VISION_SHAPES, set(VISION_DATA)]
    assert set().union(*groups) == fields and sum(map(len, groups)) == len(fields)


@pytest.mark.slow
@pytest.mark.parametrize("field", sorted(VISION_PERTURBATIONS))
def test_perturbing_a_vision_field_moves_the_logits(model, field):
    import dataclasses

    changed = vision_model_of(dataclasses.replace(VISION, **{field: VISION_PERTURBATIONS[field]}))
    tokens, batch = jnp.asarray(TOKENS), native_images(images())
    delta = np.abs(np.asarray(forward(changed, tokens, batch) - forward(model, tokens, batch)))
    assert delta.max() > 1e-3, f"{field}: max |delta logit| {delta.max():.2e}"


def vision_model_of(vision):
    return model_with_path_values(gemma4_tiny().replace(vision=vision))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(head_dim=10), "vision head_dim=10 must be divisible by 4 for 2-D RoPE"),
        (dict(num_kv_heads=3), "vision num_heads=4 must be divisible by num_kv_heads=3"),
        (dict(patch_size=0), "vision patch_size=0 must be >= 1"),
        (dict(pooling_kernel_size=0), "vision pooling_kernel_size=0 must be >= 1"),
        (dict(rope_theta=0.0), "vision rope_theta=0.0 must be > 0"),
    ],
    ids=["head_dim", "kv_heads", "patch", "pooling", "theta"],
)
def test_vision_config_refuses_what_the_tower_cannot_run(change, message):
    import dataclasses

    with pytest.raises(ValueError, match=re.escape(message)):
        dataclasses.replace(VISION, **change)
