"""Vision data: TRL's vision chat format, Gemma 4's image preparation against transformers'
own processor, the image tokens the template's one becomes, one-line errors, and the
embedded drawn dataset."""

from __future__ import annotations

import json
import pathlib
import warnings

import numpy as np
import pytest

from posttrain.vision import default_data as vision_default_data
from posttrain.vision.data import (
    ImageProcessing,
    expand_image_tokens,
    image_patches,
    load_image,
    read_vision_jsonl,
    resized_size,
)

pytestmark = pytest.mark.host  # host code only: left out of the TPU/GPU tier

# a tiny processor: 4 x 4 patches, 2 x 2 pooling, 70 soft tokens (HF's smallest budget)
TINY = ImageProcessing(patch_size=4, pooling_kernel_size=2, max_soft_tokens=70)
PLACEHOLDER = "<image>"


def png(path, height, width, seed=0):
    from PIL import Image

    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(path)
    return path


@pytest.mark.reference
@pytest.mark.parametrize(("height", "width"), [(50, 37), (13, 90), (16, 16), (200, 9)])
def test_images_are_prepared_as_transformers_prepares_them(tmp_path, height, width):
    """Resize, rescale, patches, positions and soft-token count equal
    ``Gemma4ImageProcessorPil``'s for the same file (odd sizes, a thin one, one to keep)."""
    from PIL import Image
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    path = png(tmp_path / "a.png", height, width)
    hf = Gemma4ImageProcessorPil(patch_size=4, max_soft_tokens=70, pooling_kernel_size=2)
    want = hf(images=[Image.open(path)], return_tensors="np")
    patches, positions, soft = image_patches(load_image(str(path), TINY, "x"), TINY)
    assert soft == want["num_soft_tokens_per_image"][0]
    np.testing.assert_array_equal(positions, want["image_position_ids"][0])
    np.testing.assert_allclose(patches, want["pixel_values"][0], rtol=0, atol=1e-6)


def test_normalisation_and_resize_follow_the_config(tmp_path):
    """``do_normalize`` applies mean and std per channel; a thin image keeps one block."""
    config = {
        "patch_size": 4,
        "pooling_kernel_size": 2,
        "max_soft_tokens": 70,
        "do_normalize": True,
        "image_mean": [0.5, 0.25, 0.0],
        "image_std": [0.5, 0.5, 2.0],
    }
    processing = ImageProcessing.from_preprocessor_config(config)
    assert (processing.max_patches, processing.do_normalize) == (280, True)
    path = str(png(tmp_path / "a.png", 16, 16))
    plain = load_image(path, TINY, "x")
    normalised = load_image(path, processing, "x")
    want = (plain - np.array([0.5, 0.25, 0.0])) / np.array([0.5, 0.5, 2.0])
    np.testing.assert_allclose(normalised, want, rtol=1e-6)
    assert resized_size(13, 900, processing) == (8, 552)  # 4,416 of 4,480 pixels
    assert resized_size(3, 900, processing) == (8, 560)  # too thin: one block high
    assert resized_size(64, 64, processing) == (64, 64)


def test_expand_image_tokens_places_the_block_where_the_template_put_the_token():
    """Each image token becomes boi, n image tokens, eoi at its place; none is a target."""
    tokens = np.array([1, 5, 9, 6, 9, 7], np.int32)
    mask = np.array([0, 1, 0, 1, 0, 1], bool)  # targets between the images too
    got, got_mask = expand_image_tokens(
        tokens, mask, [2, 1], image_token_id=9, boi_token_id=3, eoi_token_id=4
    )
    np.testing.assert_array_equal(got, [1, 5, 3, 9, 9, 4, 6, 3, 9, 4, 7])
    np.testing.assert_array_equal(got_mask, [0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 1])
    with pytest.raises(ValueError, match="2 image tokens in the rendered text but 1 images"):
        expand_image_tokens(tokens, mask, [2], image_token_id=9, boi_token_id=3, eoi_token_id=4)


def write(tmp_path, records) -> str:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def record(images, parts=1):
    user = [{"type": "image"}] * parts + [{"type": "text", "text": "what?"}]
    return {
        "messages": [
            {"role": "user", "content": user},
            {"role": "assistant", "content": [{"type": "text", "text": "that"}]},
        ],
        "images": images,
    }


def test_reads_trl_vision_format_with_paths_relative_to_the_file(tmp_path):
    """Parts become text with one placeholder per image; paths resolve beside the JSONL."""
    (tmp_path / "img").mkdir()
    png(tmp_path / "img" / "a.png", 8, 8)
    (conversation,) = read_vision_jsonl(write(tmp_path, [record(["img/a.png"])]), PLACEHOLDER, TINY)
    assert conversation.messages[0]["content"] == PLACEHOLDER + "what?"
    assert conversation.images == (str(tmp_path / "img" / "a.png"),)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing", r"data.jsonl, line 2: image '.*nope.png' does not exist"),
        ("unreadable", r"data.jsonl, line 2: image '.*bad.png' is not a readable image"),
        ("oversized", r"data.jsonl, line 2: image '.*big.png' is 200x100 pixels, over max_pixels"),
        ("count", r"data.jsonl, line 2: 2 image part\(s\) in the messages but 1 path\(s\)"),
        ("part", r"data.jsonl, line 2: message 0 part .* is neither"),
    ],
    ids=lambda value: value if " " not in value else "",
)
def test_bad_images_fail_in_one_line_naming_file_and_line(tmp_path, case, message):
    png(tmp_path / "ok.png", 8, 8)
    png(tmp_path / "big.png", 100, 200)
    (tmp_path / "bad.png").write_text("not an image")
    bad = {
        "missing": record(["nope.png"]),
        "unreadable": record(["bad.png"]),
        "oversized": record(["big.png"]),
        "count": record(["ok.png"], parts=2),
        "part": {**record(["ok.png"]), "messages": [{"role": "user", "content": [{"x": 1}]}]},
    }[case]
    path = write(tmp_path, [record(["ok.png"]), bad])
    small = ImageProcessing(
        patch_size=4, pooling_kernel_size=2, max_soft_tokens=70, max_pixels=10_000
    )
    with pytest.raises(ValueError, match=message) as error:
        read_vision_jsonl(path, PLACEHOLDER, small)
    assert "\n" not in str(error.value)


def corrupt_image(path, how):
    """An image whose header opens but whose pixels the decoder rejects in its own way."""
    import io

    from PIL import Image

    if how == "png-chunk":  # the second IDAT's type mangled: Pillow raises SyntaxError
        data = png(path, 256, 256).read_bytes()  # incompressible: several IDATs
        second = data.index(b"IDAT", data.index(b"IDAT") + 4)
        data = data[:second] + b"ID\xaaT" + data[second + 4 :]
    else:  # an icon whose directory says 32x32 over a 64x64 image: Pillow warns
        buffer = io.BytesIO()
        Image.new("RGB", (64, 64)).save(buffer, "ICO", sizes=[(64, 64)])
        data = bytearray(buffer.getvalue())
        data[6:8] = b"\x20\x20"
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("how", ["png-chunk", "ico-size"])
def test_a_corrupt_image_is_one_line_whatever_the_decoder_raises(tmp_path, how):
    """Whatever Pillow raises or warns while decoding is one ValueError naming the file,
    and no warning reaches stderr."""
    path = corrupt_image(tmp_path / f"bad.{how.split('-')[0]}", how)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(
            ValueError, match=r"--image: image '.*bad\.\w+' is not a readable image"
        ):
            load_image(str(path), TINY, "--image")
    assert not caught, [str(w.message) for w in caught]


def test_the_embedded_dataset_is_drawn_deterministically_and_reads_back(tmp_path):
    """Drawn images with their answers, in TRL's format; the same seed gives the same bytes,
    and the drawings differ by what they show."""
    path = vision_default_data.write_dataset(tmp_path / "a", count=12, seed=3)
    again = vision_default_data.write_dataset(tmp_path / "b", count=12, seed=3)
    conversations = read_vision_jsonl(path, PLACEHOLDER, TINY)
    assert len(conversations) == 12
    for i, (kind, _, _, answer) in enumerate(vision_default_data.examples(12, seed=3)):
        assert conversations[i].messages[-1]["content"] == answer
        assert kind in answer
        a = (tmp_path / "a" / "images" / f"{i}.png").read_bytes()
        assert a == (tmp_path / "b" / "images" / f"{i}.png").read_bytes()
    assert pathlib.Path(path).read_text() == pathlib.Path(again).read_text()
    pixels = {
        kind: np.asarray(vision_default_data.draw(kind, "red"))
        for kind in (*vision_default_data.SHAPES, "3", "8")
    }
    assert len({p.tobytes() for p in pixels.values()}) == len(pixels)


def test_encoded_conversation_trains_on_the_answer_only(tmp_path):
    """Byte tokenizer and ChatML: the image becomes boi + its soft tokens + eoi where the
    template put the placeholder, and only the assistant's answer (and its end marker) is
    a target: no prompt, role or image token."""
    from posttrain import chat
    from posttrain.families.gemma4_vision import vision_tiny
    from posttrain.tokenizer import byte_tokenizer
    from posttrain.vision.data import encode_vision_chats

    vision, tokenizer = vision_tiny(), byte_tokenizer()
    placeholder = tokenizer.id_to_token(vision.image_token_id)
    png(tmp_path / "a.png", 16, 16)
    conversations = read_vision_jsonl(write(tmp_path, [record(["a.png"])]), placeholder, TINY)
    (example,) = encode_vision_chats(conversations, tokenizer, chat.chatml(), TINY, vision)
    tokens, mask = example.tokens, example.loss_mask
    soft = int(np.sum(tokens == vision.image_token_id))
    # 16 x 16 resizes to 64 x 64 (the 280-patch budget): 256 patches, 64 soft tokens
    assert soft == 64 and example.pixels.shape == (1, TINY.max_patches, 48)
    (boi,) = np.flatnonzero(tokens == vision.boi_token_id)
    assert tokens[boi + soft + 1] == vision.eoi_token_id
    assert np.all(tokens[boi + 1 : boi + 1 + soft] == vision.image_token_id)
    assert tokenizer.decode(tokens[mask].tolist(), skip_special_tokens=False) == "that<|im_end|>"


def _outside(tmp_path, how: str) -> tuple[pathlib.Path, str]:
    """A data directory and an image path in it that leaves it (``how``)."""
    data, secret = tmp_path / "data", tmp_path / "private"
    data.mkdir()
    secret.mkdir()
    png(secret / "s.png", 8, 8)
    if how == "absolute":
        return data, str(secret / "s.png")
    if how == "dotdot":
        return data, "../private/s.png"
    if how == "missing":  # outside and absent: the same line as outside and present
        return data, "../private/absent.png"
    if how == "file-link":
        (data / "link.png").symlink_to(secret / "s.png")
        return data, "link.png"
    (data / "dir-link").symlink_to(secret)  # a directory link: the file reached through it
    return data, "dir-link/s.png"


OUTSIDE = ("absolute", "dotdot", "missing", "file-link", "dir-link")


@pytest.mark.parametrize("how", OUTSIDE)
def test_an_image_outside_the_data_directory_is_refused_without_saying_if_it_exists(tmp_path, how):
    """Images are confined to the data file's directory (resolved, links followed): an
    absolute path, ``..`` or a link that leaves it is one line naming the path and the
    directory, the same whether the file exists or not."""
    data, image = _outside(tmp_path, how)
    path = write(data, [record([image])])
    with pytest.raises(ValueError) as error:
        read_vision_jsonl(path, PLACEHOLDER, TINY)
    message = str(error.value)
    root = str(data.resolve())
    assert message == (
        f"{path}, line 1: image {image!r} is outside {root}; images must be under the data "
        "file's directory (widen it with --image-root DIR)"
    ), message
    assert "exist" not in message and "readable" not in message


@pytest.mark.parametrize("how", ["absolute", "dotdot", "file-link", "dir-link"])
def test_image_root_widens_the_confinement_to_an_explicit_directory(tmp_path, how):
    """``image_root`` (``--image-root``): images anywhere under it are read, the data
    directory no longer counts, and what leaves the root is still refused."""
    data, image = _outside(tmp_path, how)
    path = write(data, [record([image])])
    (conversation,) = read_vision_jsonl(path, PLACEHOLDER, TINY, image_root=str(tmp_path))
    assert conversation.images == (str((tmp_path / "private" / "s.png").resolve()),)
    inner = str(tmp_path / "private")
    with pytest.raises(ValueError, match=r"is outside .*private; images must be under --image-"):
        read_vision_jsonl(write(data, [record(["ok.png"])]), PLACEHOLDER, TINY, image_root=inner)
    with pytest.raises(ValueError, match=r"^--image-root '.*nope' is not a directory$"):
        read_vision_jsonl(path, PLACEHOLDER, TINY, image_root=str(tmp_path / "nope"))


def test_image_root_reaches_the_loader_from_the_command_line(tmp_path, monkeypatch):
    """``posttrain sft --vision --data F --image-root DIR`` hands DIR to the vision
    loader (an explicit value, and None when not given)."""
    from posttrain import cli
    from posttrain.vision import data as vision_data
    from posttrain.vision import run as vision_run

    seen = []

    def reader(path, placeholder, processing, *, image_root=None):
        seen.append(image_root)
        raise ValueError("stop")

    monkeypatch.setattr(vision_data, "read_vision_jsonl", reader)
    monkeypatch.setattr(vision_run, "placeholder_of", lambda tok, vision: PLACEHOLDER)
    for extra, root in (([], None), (["--image-root", "/some/root"], "/some/root")):
        cfg = cli.parse_options(["sft", "--vision", "--data", "d.jsonl", *extra])
        assert cfg.image_root == root
        with pytest.raises(ValueError, match="stop"):
            vision_run._encoded(cfg, None, None, TINY, None)
    assert seen == [None, "/some/root"]
    for argv in (["--image-root", "r"], ["--vision", "--image-root", "r"]):  # nothing to widen
        with pytest.raises(ValueError, match=r"^image_root='r' \(--image-root\): expected only"):
            cli.parse_options(["sft", *argv]).check_fields()
