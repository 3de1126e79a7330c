"""A checkpoint's ``generation_config.json`` and ``config.json`` as bad input (#56, not yet
swept): stop ids, pad ids and sampling values of the wrong type, out of range or past the
tokenizer's vocabulary are one line naming the file and the value (a ``TemplateError``,
exit 2 on the command line), never an ``OverflowError`` or a silent truncation."""

from __future__ import annotations

import json
import os

import pytest

from posttrain import chat, cli
from posttrain.chat.template import TemplateError
from posttrain.tokenizer import byte_tokenizer

pytestmark = pytest.mark.host

GENERATION = "generation_config.json"


def checkpoint(tmp_path, name: str, body: str):
    (tmp_path / name).write_text(body)
    return tmp_path


STOP_CASES = {
    "eos-past-vocab": (
        '{"eos_token_id": 5000}',
        r"eos_token_id=5000; id 5000 is past the tokenizer's vocabulary of 2\d\d ids",
    ),
    "eos-list-past-vocab": ('{"eos_token_id": [1, 99999]}', r"eos_token_id=\[1, 99999\]"),
    "eos-past-int32": ('{"eos_token_id": 1000000000000}', r"eos_token_id=1000000000000"),
    "eos-float": ('{"eos_token_id": 1.5}', r"eos_token_id=1.5; expected an id >= 0"),
    "eos-string": ('{"eos_token_id": "2"}', r"eos_token_id='2'; expected an id >= 0"),
    "eos-empty-list": ('{"eos_token_id": []}', r"eos_token_id=\[\]; expected an id >= 0"),
    "pad-past-vocab": ('{"eos_token_id": 1, "pad_token_id": 70000}', r"pad_token_id=70000"),
    "pad-past-int32": ('{"eos_token_id": 1, "pad_token_id": 1e30}', r"pad_token_id=1e\+30"),
    "not-json": ('{"eos_token_id": ', "not a readable JSON file"),
    "a-list": ("[1, 2]", "expected a JSON object, got list"),
}


@pytest.mark.parametrize(("body", "message"), STOP_CASES.values(), ids=STOP_CASES.keys())
def test_bad_stop_and_pad_ids_are_one_line_naming_the_file(tmp_path, body, message):
    """Each bad id is a TemplateError naming generation_config.json, before any model."""
    directory = checkpoint(tmp_path, GENERATION, body)
    with pytest.raises(TemplateError, match=message) as error:
        chat.checkpoint_formats(directory, byte_tokenizer())
    assert GENERATION in str(error.value) and "\n" not in str(error.value)


SAMPLING_CASES = {
    "top-k-inf": (
        '{"do_sample": true, "top_k": 1e400}',
        r"top_k=inf; expected a number: an integer",
    ),
    "top-k-fraction": (
        '{"do_sample": true, "top_k": 2.5}',
        r"top_k=2.5; expected a number: an integer",
    ),
    "top-k-zero": ('{"do_sample": true, "top_k": 0}', r"top_k=0; expected a number: an integer"),
    "top-k-huge": (
        '{"do_sample": true, "top_k": 1e30}',
        r"top_k=1e\+30; expected a number: an integer",
    ),
    "temperature-nan": ('{"do_sample": true, "temperature": NaN}', r"temperature=nan; expected"),
    "temperature-negative": ('{"do_sample": true, "temperature": -1}', r"temperature=-1"),
    "top-p-two": ('{"do_sample": true, "top_p": 2}', r"top_p=2; expected a number in \(0, 1\]"),
    "top-p-string": ('{"do_sample": true, "top_p": "0.9"}', r"top_p='0.9'; expected a number"),
}


@pytest.mark.parametrize(("body", "message"), SAMPLING_CASES.values(), ids=SAMPLING_CASES.keys())
def test_bad_sampling_values_are_one_line_naming_the_file(tmp_path, body, message):
    """A sampling value SamplingConfig would refuse (or overflow on) is refused where it is
    read, naming the file, whatever the user's own flags."""
    directory = checkpoint(tmp_path, GENERATION, body)
    with pytest.raises(TemplateError, match=message) as error:
        chat.sampling_defaults(directory)
    assert GENERATION in str(error.value)


def test_a_bad_generation_config_stops_generate_in_one_line_and_writes_nothing(
    tmp_path, monkeypatch, capsys
):
    """Through the command: exit 2, one stderr line naming the file, no output file."""
    directory = tmp_path / "ckpt"
    directory.mkdir()
    checkpoint(directory, GENERATION, json.dumps({"eos_token_id": 10**12}))
    # a preset's weights with this checkpoint's formats: the files are read as generate
    # reads them (chat.checkpoint_formats), before the cache is allocated
    formats = chat.checkpoint_formats
    monkeypatch.setattr(
        chat, "checkpoint_formats", lambda spec, tok, **kw: formats(directory, tok, **kw)
    )
    out = tmp_path / "out.jsonl"
    argv = ["generate", "--model", "qwen3-tiny", "--prompt", "hi", "--output", str(out)]
    flags = os.environ.get("XLA_FLAGS")
    assert cli.main([*argv, "--devices", "1"]) == 2
    # in a process already running JAX the command leaves the device flags alone (they
    # told later in-process pytest sessions of this worker 1 device instead of 8)
    assert os.environ.get("XLA_FLAGS") == flags
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "eos_token_id=1000000000000" in err, err
    assert not out.exists() and not any(tmp_path.glob(".out*"))
