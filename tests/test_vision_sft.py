"""``posttrain sft --vision``: rows and their loss mask, where the gradient goes, a text-only
batch through the vision step, bad input, and real runs (issue #39)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from PIL import Image

pytest.importorskip("tunix.sft.peft_trainer", reason="google-tunix is not installed")

from posttrain import chat, cli, sharding  # noqa: E402
from posttrain.families.gemma4 import gemma4_tiny, gemma4_vision_tiny  # noqa: E402
from posttrain.sft.options import SFTConfig  # noqa: E402
from posttrain.tokenizer import byte_tokenizer  # noqa: E402
from posttrain.training import loss  # noqa: E402
from posttrain.vision import default_data as vision_default_data  # noqa: E402
from posttrain.vision import run as vision_run
from posttrain.vision.rows import PATCH_POSITIONS, PIXELS, with_images  # noqa: E402
from tests.path_params import model_with_path_values  # noqa: E402

VISION = gemma4_vision_tiny().vision
ROW = 192  # tokens per row: a drawing (64 soft tokens) and its question and answer fit


def small_dataset(directory, count: int = 8) -> str:
    """``count`` embedded-style drawings in TRL's format; returns the JSONL path."""
    return vision_default_data.write_dataset(directory, count=count, seed=1)


def vision_rows_of(path: str, **options) -> tuple[vision_run.VisionRun, dict]:
    """The prepared vision run of ``--data path`` and its rows (one data shard)."""
    cfg = SFTConfig(vision=True, model="gemma4-vision-tiny", data=path, max_target_length=ROW)
    cfg = SFTConfig(**{**cfg.__dict__, **options})
    tok = byte_tokenizer()
    run = vision_run.prepare(cfg, tok, chat.chatml(), pad_id=0)
    return run, run.rows(cfg, tok)


def test_the_loss_mask_excludes_image_and_prompt_tokens(tmp_path):
    """Each row's targets (``loss.target_mask``) are exactly its assistant answer and the
    end-of-turn marker: no image, begin/end-of-image, role or question token."""
    path = small_dataset(tmp_path)
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    _, rows = vision_rows_of(path)
    targets = np.asarray(
        loss.target_mask(jnp.asarray(rows["input_mask"]), jnp.asarray(rows["segment_ids"]))
    )
    tok = byte_tokenizer()
    image_ids = {VISION.image_token_id, VISION.boi_token_id, VISION.eoi_token_id}
    for row, record in enumerate(records):
        tokens = rows["input_tokens"][row, 1:]
        picked = tokens[targets[row]]
        answer = record["messages"][-1]["content"][0]["text"]
        assert tok.decode(picked.tolist(), skip_special_tokens=False) == answer + "<|im_end|>"
        assert not image_ids & set(picked.tolist())
        assert np.sum(rows["input_tokens"][row] == VISION.image_token_id) == 64
    # the images ride along, one slot per row, the patches of a 64 x 64 drawing
    assert rows[PIXELS].shape == (8, 1, 256, 48) and rows[PATCH_POSITIONS].min() == 0


def trainer_of(model, frozen):
    """An ``SFTTrainer`` over ``model`` with ``frozen`` (no checkpoints, no logs)."""
    import optax
    from tunix.sft import peft_trainer

    from posttrain.training.trainer import SFTOptions, SFTTrainer

    mesh = sharding.make_mesh({"fsdp": 1}, devices=jax.devices()[:1])
    config = peft_trainer.TrainingConfig(eval_every_n_steps=100, max_steps=1)
    options = SFTOptions(mesh=mesh, frozen=frozen)
    return SFTTrainer(model, optax.sgd(1e-3), config, options=options)


def grads_of(trainer, model, batch):
    """The trainer's step gradient for ``batch`` (jitted)."""

    @nnx.jit
    def grads(model, batch):
        return trainer._grads(model, batch)[2]

    return grads(model, batch)


def image_batch(tmp_path, rows: int = 2) -> dict:
    path = small_dataset(tmp_path, count=rows)
    _, built = vision_rows_of(path)
    built = {k: jnp.asarray(v) for k, v in built.items()}
    return next(with_images([built], "images"))


def norms(grads, part: str) -> list[float]:
    flat = nnx.to_flat_state(grads)
    return [float(jnp.abs(v[...]).sum()) for path, v in flat if part in map(str, path)]


@pytest.mark.parametrize(
    "train_tower",
    [
        pytest.param(False, id="tower-frozen", marks=pytest.mark.slow),
        pytest.param(True, id="tower-trained", marks=pytest.mark.slow),
    ],
)
def test_the_gradient_reaches_the_projector_and_the_tower_only_when_trained(tmp_path, train_tower):
    """With images the projector's gradient is nonzero; the frozen tower's is exactly zero
    (a trained tower's nonzero, its buffers' zero)."""
    model = model_with_path_values(gemma4_vision_tiny())
    trainer = trainer_of(model, vision_run.frozen_filter(train_tower))
    grads = grads_of(trainer, model, image_batch(tmp_path))
    assert min(norms(grads, "embed_vision")) > 0
    tower = nnx.to_flat_state(grads)
    weights = [
        float(jnp.abs(v[...]).sum())
        for path, v in tower
        if "vision_tower" in map(str, path)
        and not set(map(str, path)) & set(vision_run.TOWER_BUFFERS)
    ]
    buffers = [
        float(jnp.abs(v[...]).sum())
        for path, v in tower
        if set(map(str, path)) & set(vision_run.TOWER_BUFFERS)
    ]
    assert buffers and max(buffers) == 0.0
    if train_tower:
        assert min(weights) > 0
    else:
        assert max(weights) == 0.0


@pytest.mark.slow
def test_a_text_only_batch_trains_as_the_text_model(tmp_path):
    """Without images, the vision run's step gives the text model's loss terms and, for
    every text parameter, its gradient, bit for bit (the frozen tower changes nothing)."""
    vision_model = model_with_path_values(gemma4_vision_tiny())
    text_model = model_with_path_values(gemma4_tiny())
    batch = {k: v for k, v in image_batch(tmp_path).items() if k != "images"}
    batch["input_tokens"] = jnp.where(batch["input_tokens"] >= 261, 40, batch["input_tokens"])
    with_tower = grads_of(
        trainer_of(vision_model, vision_run.frozen_filter(False)), vision_model, batch
    )
    text = grads_of(trainer_of(text_model, None), text_model, batch)
    text_flat = dict(nnx.to_flat_state(text))
    compared = 0
    for path, value in nnx.to_flat_state(with_tower):
        if path in text_flat:
            np.testing.assert_array_equal(np.asarray(value[...]), np.asarray(text_flat[path][...]))
            compared += 1
    assert compared == len(text_flat)
    terms = [loss.sft_terms(m, **batch) for m in (vision_model, text_model)]
    assert float(terms[0]["nll_sum"]) == float(terms[1]["nll_sum"])


def write_png(path, size=(16, 16)):
    Image.new("RGB", size, (200, 10, 10)).save(path)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--data", "{missing}"], "image '{dir}/gone.png' does not exist"),
        (["--data", "{unreadable}"], "image '{dir}/junk.png' is not a readable image"),
        (["--data", "{mismatch}"], "line 1: 1 image part(s) in the messages but 2 path(s)"),
        (["--model", "llama3-tiny"], "--model 'llama3-tiny' has no vision tower"),
        (["--lora-rank", "4", "--train-vision-tower"], "(--train-vision-tower): expected full"),
    ],
    ids=["missing-image", "unreadable-image", "image-count", "no-tower", "tower-with-lora"],
)
def test_bad_vision_input_is_one_line_and_exit_2(tmp_path, capsys, argv, message):
    """Each bad input fails before anything is written, in one line naming the value."""
    write_png(tmp_path / "a.png")
    (tmp_path / "junk.png").write_bytes(b"not a png")
    parts = [{"type": "image"}, {"type": "text", "text": "what?"}]
    chat_ = [
        {"role": "user", "content": parts},
        {"role": "assistant", "content": [{"type": "text", "text": "red"}]},
    ]
    files = {"missing": ["gone.png"], "unreadable": ["junk.png"], "mismatch": ["a.png", "a.png"]}
    for name, images in files.items():
        record = {"messages": chat_, "images": images}
        (tmp_path / f"{name}.jsonl").write_text(json.dumps(record) + "\n")
    for name in files:
        argv = [a.replace("{" + name + "}", str(tmp_path / f"{name}.jsonl")) for a in argv]
    message = message.replace("{dir}", str(tmp_path))
    out = tmp_path / "out"
    assert cli.main(["sft", "--vision", "--output", str(out), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("posttrain: error: ") and "\n" not in err and message in err, err
    assert not out.exists()


def flat(model) -> dict:
    from posttrain.models import flat_params

    return {k: np.asarray(v) for k, v in flat_params(model).items()}


def small_vision_model(directory) -> str:
    """A native directory of llama3-tiny with the tiny tower: a dense text model compiles
    in a fraction of Gemma 4's MoE, and the tower, the images' way in and the freezing are
    the same (the 200-step test below runs ``gemma4-vision-tiny`` itself)."""
    from posttrain.conversion.native import save_native
    from posttrain.models import build_model, flat_params, get_config

    cfg = get_config("llama3-tiny").replace(vision=VISION)
    save_native(flat_params(build_model(cfg, seed=0)), cfg, directory)
    return str(directory)


def _two_steps(tmp_path, model: str, **options):
    """Two real steps of ``posttrain sft --vision`` on ``model`` and 8 drawings (160-token
    rows); their losses are steps 1 and 2, finite."""
    from posttrain.vision.run import run_vision

    cfg = SFTConfig(
        vision=True,
        model=model,
        data=small_dataset(tmp_path / "data"),
        steps=2,
        max_target_length=160,
        output=str(tmp_path / "run"),
        **options,
    )
    result = run_vision(cfg)
    assert [r["step"] for r in result.history] == [1, 2]
    assert all(np.isfinite(r["loss"]) for r in result.history)
    return result


@pytest.mark.wiring
def test_a_short_vision_run_trains_the_projector_and_leaves_the_tower(tmp_path):
    """Two real steps of ``posttrain sft --vision`` on 8 drawings: finite losses, the
    projector (and the text model) moved, every tower tensor bit for bit as loaded, and
    the export carries how its images were prepared."""
    from posttrain.conversion import load_native

    model = small_vision_model(tmp_path / "model")
    result = _two_steps(tmp_path, model)
    before = flat(load_native(model))
    after = flat(load_native(result.exported[0]))
    tower = [k for k in before if k.startswith("vision_tower.")]
    assert tower and all(np.array_equal(before[k], after[k]) for k in tower)
    for moved in ("embed_vision.embedding_projection.kernel", "model.embed_tokens.embedding"):
        assert not np.array_equal(before[moved], after[moved]), moved
    processor = json.loads((result.exported[0] / vision_run.PROCESSOR_FILE).read_text())
    assert processor["max_soft_tokens"] == vision_run.PRESET_SOFT_TOKENS


def test_lora_on_a_vision_model_adapts_the_text_model_and_refuses_the_tower():
    """The default target covers the text model's projections, not the tower's namesakes
    (Qwix traces the model without images at apply time, so an adapter there would be
    created mid-training and fail); a target that reaches the tower is refused in one
    line."""
    from posttrain.lora import LoraConfig, apply_lora
    from posttrain.models import build_model, get_config

    mesh = sharding.make_mesh(None)
    base = build_model(get_config("llama3-tiny").replace(vision=VISION), mesh, seed=0)
    adapted = apply_lora(base, mesh, LoraConfig(rank=4, alpha=4))
    paths = ["/".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(adapted, nnx.LoRAParam))]
    assert any("/self_attn/q_proj/" in p for p in paths), paths[:4]
    assert paths and all(p.startswith("model/") for p in paths), paths[:4]
    tower = LoraConfig(rank=4, alpha=4, target=r".*/self_attn/q_proj")
    with pytest.raises(ValueError, match=r"reaches the vision tower \(vision_tower/layers/0/"):
        apply_lora(base, mesh, tower)


@pytest.mark.slow  # 9 s; the gate applies the adapters above and runs a full vision run
def test_a_lora_vision_run_trains_adapters_on_the_text_model(tmp_path):
    """``posttrain sft --vision --lora-rank 4``, two real steps: finite losses, and the
    exported adapter holds the text model's adapters only."""
    import safetensors.numpy

    result = _two_steps(tmp_path, small_vision_model(tmp_path / "model"), lora_rank=4)
    (adapter,) = [p for p in result.exported if p.name.startswith("adapter-step")]
    names = list(safetensors.numpy.load_file(str(adapter / "lora_adapter.safetensors")))
    assert names and all(n.startswith("model") for n in names), names[:4]


#: the held-out accuracy a model blind to the images reaches at best: each question's most
#: common training answer (4 of the 64 held-out drawings)
BLIND_ACCURACY = 0.0625


@pytest.mark.slow
def test_the_embedded_vision_run_learns_to_read_the_images(tmp_path, capsys):
    """``posttrain sft --vision`` on the embedded drawings, 200 steps of 160-token rows:
    the held-out answer loss falls and the accuracy rises far past what the questions
    alone allow (:data:`BLIND_ACCURACY`): the answers come from the pixels (here 0.000 ->
    0.500, loss 5.58 -> 0.16)."""
    argv = ["sft", "--vision", "--steps", "200", "--max-target-length", "160"]
    assert cli.main([*argv, "--output", str(tmp_path / "run")]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("held-out"))
    numbers = [float(x.strip(",")) for x in line.split() if x.strip(",").replace(".", "").isdigit()]
    loss_before, loss_after, accuracy_before, accuracy_after = numbers[-4:]
    assert loss_after < loss_before - 3.0, line
    assert accuracy_after >= 5 * BLIND_ACCURACY > accuracy_before, line


def example(tokens, mask):
    from posttrain.vision.data import VisionExample

    pixels, positions = np.zeros((1, 4, 48), np.float32), np.zeros((1, 4, 2), np.int32)
    return VisionExample(np.asarray(tokens, np.int32), np.asarray(mask, bool), pixels, positions)


IMG = VISION.image_token_id


@pytest.mark.parametrize(
    ("tokens", "mask", "length", "overflow", "want"),
    [
        ([5, IMG, IMG, 6, 7, 8], [0, 0, 0, 0, 1, 1], 6, "reject", 6),
        ([5, IMG, IMG, 6, 7, 8], [0, 0, 0, 0, 1, 1], 5, "truncate", 5),
        ([5, IMG, IMG, 6, 7, 8], [0, 0, 0, 0, 0, 1], 5, "truncate", None),
        ([5, IMG, IMG, 6, 7, 8], [1, 0, 0, 0, 0, 0], 6, "truncate", None),
        ([5, IMG, IMG, 6, 7, 8], [0, 0, 0, 0, 1, 1], 5, "reject", "6 tokens, more than"),
        ([5, IMG, IMG, 6, 7, 8], [0, 0, 0, 0, 1, 1], 3, "truncate", "run to token 4, past"),
        ([5, IMG, IMG, 6, 7, 8], [0, 0, 0, 0, 1, 1], 4, "truncate", None),
    ],
    ids=[
        "fits",
        "cut-after-image",
        "no-target-left",
        "first-token-only",
        "reject",
        "cut-through-image",
        "cut-at-eoi",
    ],
)
def test_a_row_is_cut_only_after_its_image_tokens(tokens, mask, length, overflow, want):
    """``fit_example``: a conversation that fits is kept; a longer one is cut (``truncate``)
    only past its last image token and the one after it, refused with ``reject``; one left
    without a target (the first token is never one) is dropped."""
    from posttrain.vision.rows import fit_example

    ex = example(tokens, mask)
    if isinstance(want, str):
        with pytest.raises(ValueError, match=want):
            fit_example(ex, length, overflow, IMG, "conversation 3")
        return
    got = fit_example(ex, length, overflow, IMG, "conversation 3")
    if want is None:
        assert got is None
    else:
        assert len(got.tokens) == len(got.loss_mask) == want
        np.testing.assert_array_equal(got.tokens, tokens[:want])
        assert got.pixels is ex.pixels


def test_rows_refuse_more_images_than_their_slots_and_pad_the_rest():
    """A row's unused image slots are all padding (positions -1, pixels 0); an example
    with more images than the slots, or a dataset without one image, is refused."""
    from posttrain.vision.data import VisionExample
    from posttrain.vision.rows import vision_rows

    one = example([5, IMG, 6, 7], [0, 0, 1, 1])
    pixels = np.ones((2, 4, 48), np.float32)
    two = VisionExample(one.tokens, one.loss_mask, pixels, np.zeros((2, 4, 2), np.int32))
    rows = vision_rows([one, two], 6, 2, pad_id=9)
    # the dtypes the step is compiled for (Tunix shards them as they come)
    assert {k: v.dtype.name for k, v in rows.items()} == {
        "input_tokens": "int32",
        "input_mask": "int32",
        "positions": "int32",
        "segment_ids": "int32",
        PIXELS: "float32",
        PATCH_POSITIONS: "int32",
    }
    np.testing.assert_array_equal(rows["input_tokens"][0], [5, IMG, 6, 7, 9, 9])
    np.testing.assert_array_equal(rows["segment_ids"][0], [1, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(rows["positions"][0], [0, 1, 2, 3, 0, 0])
    assert rows[PATCH_POSITIONS][0, 1].min() == rows[PATCH_POSITIONS][0, 1].max() == -1
    assert rows[PIXELS][0, 1].max() == 0 and rows[PIXELS][1].min() == 1
    assert rows[PATCH_POSITIONS][1].max() == 0
    with pytest.raises(ValueError, match="row 1 has 2 images, more than 1 per row"):
        vision_rows([one, two], 6, 1, pad_id=0)
    blind = VisionExample(one.tokens, one.loss_mask, np.zeros((0, 4, 48)), np.zeros((0, 4, 2)))
    with pytest.raises(ValueError, match="no example has an image"):
        vision_rows([blind], 6, 1, pad_id=0)


def test_the_exported_processor_config_reads_back_as_the_run_prepared_images(tmp_path):
    """``preprocessor_config.json`` of the run's processing reads back as it (every field),
    and a model directory holding one is prepared by it; a preset by the tower's sizes."""
    from posttrain.vision.data import ImageProcessing

    preset = vision_run.image_processing("gemma4-vision-tiny", VISION)
    assert (preset.patch_size, preset.pooling_kernel_size) == (4, 2)
    assert preset.max_soft_tokens == vision_run.PRESET_SOFT_TOKENS
    other = ImageProcessing(
        patch_size=4,
        pooling_kernel_size=2,
        max_soft_tokens=9,
        resample=2,
        rescale_factor=0.5,
        do_normalize=True,
        image_mean=(0.1, 0.2, 0.3),
        image_std=(0.4, 0.5, 0.6),
    )
    config = vision_run.processor_config(other)
    (tmp_path / vision_run.PROCESSOR_FILE).write_text(json.dumps(config))
    assert vision_run.image_processing(str(tmp_path), VISION) == other
    (tmp_path / vision_run.PROCESSOR_FILE).write_text("{oops")
    with pytest.raises(ValueError, match="preprocessor_config.json: not readable JSON"):
        vision_run.image_processing(str(tmp_path), VISION)


def test_the_tokenizer_image_token_is_the_placeholder():
    """The tokenizer's image token is the placeholder (the default model under
    ``--vision``: tests/test_model_option.py)."""
    assert vision_run.placeholder_of(byte_tokenizer(), VISION) == "<|reserved_1|>"
    import dataclasses

    beyond = dataclasses.replace(VISION, image_token_id=9999)  # past the byte vocabulary
    with pytest.raises(ValueError, match="no single token for the tower's image_token_id=9999"):
        vision_run.placeholder_of(byte_tokenizer(), beyond)


def test_a_run_recorded_before_the_vision_options_resumes_as_a_text_run(tmp_path):
    """``run.json`` of a run recorded before ``vision`` existed reads as ``vision=False``
    (its default then): the text run resumes, a ``--vision`` one is refused naming it."""
    from posttrain.training import record

    out = tmp_path / "run"
    out.mkdir()
    cfg = SFTConfig(output=str(out))
    record.record_segment(out, cfg, {}, 0)
    body = json.loads((out / "run.json").read_text())
    for part in (body.get("settings", {}), *body.get("segments", [])):
        part.pop("vision", None)
        part.pop("train_vision_tower", None)
    (out / "run.json").write_text(json.dumps(body))
    record.check_resumable(cfg, out)
    with pytest.raises(ValueError, match="vision False -> True"):
        record.check_resumable(SFTConfig(output=str(out), vision=True), out)


def test_sft_and_vision_runs_refuse_each_others_options(tmp_path):
    """``run_sft`` refuses ``--vision`` options and ``run_vision`` text ones, in one line
    and before anything is written (``posttrain sft`` picks the run by ``--vision``)."""
    from posttrain.sft.run import run_sft
    from posttrain.vision.run import run_vision

    out = tmp_path / "run"
    with pytest.raises(ValueError, match="run_vision's"):
        run_sft(SFTConfig(vision=True, output=str(out)))
    with pytest.raises(ValueError, match="vision is off"):
        run_vision(SFTConfig(output=str(out)))
    assert not out.exists()
