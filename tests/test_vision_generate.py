"""``posttrain generate --image``: the cached generation with an image is the uncached
greedy one; bad input is one line (issue #39)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from PIL import Image

from posttrain import chat, cli, generate
from posttrain.commands.generate_image import image_prompt
from posttrain.families.gemma4 import gemma4_vision_tiny
from posttrain.models import build_model, get_config
from posttrain.tokenizer import byte_tokenizer
from posttrain.vision import default_data as vision_default_data

STEPS = 6
QUESTION = "What shape is in the picture?"


def prompt_with(model, path):
    """``(prompt ids, images)`` of a drawing at ``path`` and :data:`QUESTION`."""
    prompts = [{"prompt": QUESTION}]
    return image_prompt(str(path), prompts, model, byte_tokenizer(), chat.chatml(), "preset")


def recompute_greedy(model, ids, images) -> list[int]:
    """Greedy tokens by the full forward with the image on the whole sequence so far (no
    cache), right-padded to one width (causal: later padding never changes a logit)."""
    width = len(ids) + STEPS
    forward = nnx.jit(lambda m, t, i: m(t, None, None, None, images=i)[0][0])  # [width, V]
    seq = list(ids)
    for _ in range(STEPS):
        tokens = jnp.asarray([seq + [0] * (width - len(seq))], jnp.int32)
        seq.append(int(jnp.argmax(forward(model, tokens, images)[len(seq) - 1])))
    return seq[len(ids) :]


def test_cached_generation_with_an_image_equals_the_uncached_greedy_loop(tmp_path):
    """The prefill writes the image's soft tokens into the KV cache: greedy decoding from
    it gives the tokens of re-running the full forward, image included, at every step;
    another picture gives other logprobs."""
    # llama3-tiny with the tiny tower: the cache and the images' way in are the family's
    # own only in the decoder it runs, and a dense one compiles in a fraction of the time
    model = build_model(
        get_config("llama3-tiny").replace(vision=gemma4_vision_tiny().vision), seed=1
    )
    vision_default_data.draw("circle", "red").save(tmp_path / "a.png")
    vision_default_data.draw("7", "blue").save(tmp_path / "b.png")
    ids, images = prompt_with(model, tmp_path / "a.png")
    assert ids.count(model.config.vision.image_token_id) == 64  # a 64 x 64 drawing
    cfg = generate.SamplingConfig(max_new_tokens=STEPS)
    out = generate.generate(model, [ids], cfg, images=images)
    assert out.row(0) == recompute_greedy(model, ids, images)
    other = generate.generate(model, [ids], cfg, images=prompt_with(model, tmp_path / "b.png")[1])
    assert not np.array_equal(out.logprobs, other.logprobs)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--image", "{dir}/gone.png"],
            "--image '{dir}/gone.png' does not exist; expected an image file",
        ),
        (["--image", "{dir}"], "--image '{dir}' is not a file; expected an image file"),
        (["--image", "{dir}/a.png", "--prompt", "again"], "takes exactly one --prompt (got 2)"),
        (["--image", "{dir}/a.png", "--model", "llama3-tiny"], "'llama3-tiny' has no vision"),
    ],
    ids=["missing-image", "a-directory", "two-prompts", "no-tower"],
)
def test_cli_bad_image_input_is_one_line_and_exit_2(tmp_path, capsys, extra, message):
    Image.new("RGB", (16, 16), (0, 0, 200)).save(tmp_path / "a.png")
    extra = [x.replace("{dir}", str(tmp_path)) for x in extra]
    argv = ["generate", "--model", "gemma4-vision-tiny", "--prompt", QUESTION, *extra]
    if "--model" in extra:
        argv = argv[:1] + argv[3:]  # the later --model only
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    message = message.replace("{dir}", str(tmp_path))
    assert err.startswith("posttrain: error: ") and "\n" not in err and message in err, err
