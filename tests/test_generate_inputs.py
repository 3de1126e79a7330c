"""``posttrain generate``'s and ``posttrain sft``'s bad inputs (#40): each is one line
``posttrain: error: ...`` naming the value, exit 2, and nothing written, refused before
the model is read where the model is not needed and before the KV cache or the rows are
allocated where it is."""

from __future__ import annotations

import json

import pytest

from posttrain import cli, limits
from posttrain.models import get_config

pytestmark = pytest.mark.host


def _files(tmp_path):
    """Every bad input file, by name (written fresh under ``tmp_path``)."""
    files = {
        "nonutf8": b'{"prompt": "caf\xe9"}\n',
        "empty": b'{"prompt": ""}\n',
        "blank": b"\n  \n",
        "nested": b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n",
        "surrogate": b'{"prompt": "a\\ud800b"}\n',
        "notjson": b"{oops\n",
    }
    paths = {}
    for name, body in files.items():
        paths[name] = tmp_path / f"{name}.jsonl"
        paths[name].write_bytes(body)
    for name, body in {
        "alpha": {"format": "posttrain-lora", "family": "qwen3", "num_layers": 2, "rank": 2}
        | {"alpha": "abc", "target": None, "weight_qtype": None, "tile_size": None},
        "list": [1, 2],
    }.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "lora_config.json").write_text(json.dumps(body))
        paths[name] = tmp_path / name
    paths["file"] = tmp_path / "a-file"
    paths["file"].write_text("not a directory\n")
    paths["dir"] = tmp_path / "a-dir"
    paths["dir"].mkdir()
    return paths


CASES = {
    # no model is read for these: the options alone
    "seed-negative": (["--seed", "-1"], r"seed=-1: expected an integer in \[0, 2\*\*32\)"),
    "seed-too-big": (["--seed", "4294967296"], r"seed=4294967296: expected an integer"),
    "temperature-inf": (["--temperature", "inf"], "temperature=inf: expected a finite value"),
    "temperature-nan": (["--temperature", "nan"], "temperature=nan: expected a finite value"),
    "top-p-nan": (["--top-p", "nan"], r"top_p=nan: expected in \(0, 1\]"),
    "output-directory": (["--output", "{dir}"], "--output '{dir}' is a directory"),
    "output-under-a-file": (["--output", "{file}/x.jsonl"], "{file} is not a directory"),
    "output-missing-dir": (["--output", "{dir}/no/x.jsonl"], "{dir}/no does not exist"),
    "output-proc": (["--output", "/proc/x.jsonl"], "is under a kernel file system"),
    # the prompts, before the model is read
    "prompt-surrogate": (["--prompt", "a\udcffb"], "--prompt 1: not valid Unicode"),
    "prompt-empty": (["--prompt", ""], "--prompt 1: empty prompt; expected some text"),
    "prompts-not-utf8": (["--prompts", "{nonutf8}"], "{nonutf8}, line 1: not UTF-8"),
    "prompts-empty-string": (["--prompts", "{empty}"], "{empty}, line 1: empty prompt"),
    "prompts-blank": (["--prompts", "{blank}"], r"no prompt \({blank} has only blank lines\)"),
    "prompts-nested": (["--prompts", "{nested}"], "{nested}, line 1: .*nested too deeply"),
    "prompts-surrogate": (["--prompts", "{surrogate}"], "{surrogate}, line 1: not valid Unicode"),
    "prompts-not-json": (["--prompts", "{notjson}"], "{notjson}, line 1: not valid JSON"),
    "prompts-directory": (["--prompts", "{dir}"], "--prompts '{dir}' is a directory"),
    # the adapter, after the model
    "adapter-alpha-string": (
        ["--adapter", "{alpha}"],
        "{alpha}/lora_config.json: alpha='abc' must be a finite number > 0",
    ),
    "adapter-json-list": (
        ["--adapter", "{list}"],
        "{list}/lora_config.json: expected a JSON object, got list",
    ),
    # the lengths, after the model and before the cache
    "max-new-tokens-past-positions": (
        ["--max-new-tokens", "1000000000"],
        r"max_new_tokens=1000000000 \(--max-new-tokens\): the longest prompt has 5 tokens, "
        r"so positions reach 1000000005; the model's limit is 4096 \(4096: the checkpoint "
        r"records no max_position_embeddings\): expected --max-new-tokens <= 4091",
    ),
}


@pytest.mark.devices(8)
@pytest.mark.parametrize(("argv", "message"), CASES.values(), ids=CASES.keys())
def test_generate_bad_input_is_one_line_exit_2_and_writes_nothing(
    tmp_path, monkeypatch, capsys, argv, message
):
    paths = _files(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    for name, path in paths.items():
        argv = [a.replace("{" + name + "}", str(path)) for a in argv]
        message = message.replace("{" + name + "}", str(path))
    prompt = [] if "--prompt" in argv or "--prompts" in argv else ["--prompt", "hello"]
    status = cli.main(["generate", "--model", "qwen3-tiny", *prompt, *argv])
    out, err = capsys.readouterr()
    assert (status, out) == (2, ""), err
    assert err.startswith("posttrain: error: ") and err.count("\n") == 1, err
    assert __import__("re").search(message, err), err
    assert list(work.iterdir()) == []  # nothing written (no output, no scratch)
    assert sorted(p.name for p in paths["dir"].iterdir()) == []


def test_generation_larger_than_the_memory_is_refused_naming_both():
    """The memory check compares a lower bound of the request (KV cache and the prefill's
    scores) with what there is, naming both."""
    cfg = get_config("qwen3-tiny")
    need = limits.generation_bytes(cfg, 2, 100, 300)
    # the formula: 2 layers x 2 (k, v) x B x S x K x H x 4 bytes, end_index, scores
    assert need == 2 * (2 * 2 * 300 * 4 * 10 * 4 + 4 * 2) + 4 * 2 * 8 * 100 * 300
    kwargs = dict(rows=2, prompt=100, new_tokens=200, cache_size=None)
    limits.check_generation("qwen3-tiny", cfg, **kwargs, memory=(need, "the test's memory"))
    with pytest.raises(
        ValueError, match=r"need at least 2\.2 MiB .* the test's memory is 2\.2 MiB"
    ):
        limits.check_generation("qwen3-tiny", cfg, **kwargs, memory=(need - 1, "the test's memory"))


def test_a_recorded_max_position_embeddings_is_the_limit(tmp_path):
    """An HF directory's (and a converted native one's) own limit, not the default."""
    from posttrain.conversion.hf_config import to_hf_config

    cfg = get_config("qwen3-tiny")
    (tmp_path / "config.json").write_text(
        json.dumps({**to_hf_config(cfg), "max_position_embeddings": 300})
    )
    read, positions, source = limits.checkpoint_config(str(tmp_path))
    assert positions == 300 and source.endswith("config.json")
    kwargs = dict(rows=1, prompt=100, cache_size=None, memory=(1 << 40, "plenty"))
    limits.check_generation(str(tmp_path), read, new_tokens=200, **kwargs)
    with pytest.raises(ValueError, match=r"limit is 300 .*expected --max-new-tokens <= 200$"):
        limits.check_generation(str(tmp_path), read, new_tokens=201, **kwargs)


@pytest.mark.devices(8)
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--max-target-length", "1000000000"],
            r"max_target_length=1000000000 \(--max-target-length\): the model's limit is "
            r"4096 positions",
        ),
    ],
    ids=["max-target-length-past-positions"],
)
def test_sft_length_past_the_model_is_refused_before_the_output_exists(
    tmp_path, capsys, argv, message
):
    out = tmp_path / "run"
    assert cli.main(["sft", "--output", str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("posttrain: error: ") and err.count("\n") == 1, err
    assert __import__("re").search(message, err), err
    assert list(tmp_path.iterdir()) == []


def test_a_training_step_larger_than_the_memory_is_refused():
    cfg = get_config("qwen3-tiny")
    need = limits.training_bytes(cfg, 8, 1024)
    assert need == 4 * 8 * 1024 * 264 + 4 * 8 * 8 * 1024 * 1024
    limits.check_training_length(
        "qwen3-tiny", 1024, 8, flag="--max-target-length", memory=(need, "m")
    )
    with pytest.raises(
        ValueError, match=r"^max_target_length=1024 \(--max-target-length\): a step"
    ):
        limits.check_training_length(
            "qwen3-tiny", 1024, 8, flag="--max-target-length", memory=(need - 1, "m")
        )


def test_a_chunked_loss_step_counts_one_chunk_of_logits():
    """The SFT loss holds one chunk's float32 logits at a time (``sft_terms``): a step whose
    whole logits exceed the memory but whose chunk and scores fit is not refused (on a
    v5e, qwen3-0.6b at 16 x 2048 was refused for logits it never holds)."""
    cfg = get_config("qwen3-tiny")
    scores = 4 * 8 * 8 * 1024 * 1024
    assert limits.training_bytes(cfg, 8, 1024, logit_chunk_bytes=2**20) == 2**20 + scores
    # at least one position of each row, however small the chunk
    assert limits.training_bytes(cfg, 8, 1024, logit_chunk_bytes=1) == 4 * 8 * 264 + scores
    # a chunk larger than the whole logits holds the whole logits
    whole = 4 * 8 * 1024 * 264
    assert limits.training_bytes(cfg, 8, 1024, logit_chunk_bytes=2**40) == whole + scores
    need = 2**20 + scores
    limits.check_training_length(
        "qwen3-tiny",
        1024,
        8,
        flag="--max-target-length",
        memory=(need, "m"),
        logit_chunk_bytes=2**20,
    )
    with pytest.raises(ValueError, match=r"needs at least .* \(one chunk's logits and one layer"):
        limits.check_training_length(
            "qwen3-tiny",
            1024,
            8,
            flag="--max-target-length",
            memory=(need - 1, "m"),
            logit_chunk_bytes=2**20,
        )


def test_the_step_check_s_limits_and_defaults(monkeypatch):
    """A row of exactly the model's positions is accepted; the whole logits are named when
    the loss does not chunk; without ``memory`` the backend's available memory is read."""
    _, positions, _ = limits.checkpoint_config("qwen3-tiny")
    limits.check_training_length("qwen3-tiny", positions, 1, flag="--seq", memory=(2**60, "m"))
    with pytest.raises(ValueError, match=rf"^seq={positions + 1} \(--seq\): the model's limit"):
        limits.check_training_length("qwen3-tiny", positions + 1, 1, flag="--seq")
    with pytest.raises(ValueError, match=r"needs at least .* \(logits and one layer's attention"):
        limits.check_training_length("qwen3-tiny", 64, 8, flag="--seq", memory=(1, "m"))
    monkeypatch.setattr(limits, "available_memory", lambda: (1, "one byte"))
    with pytest.raises(ValueError, match=r"; one byte is 1 B$"):
        limits.check_training_length("qwen3-tiny", 64, 8, flag="--seq")


class _Checked(Exception):
    pass


def test_sft_checks_its_step_with_the_loss_s_chunk(tmp_path, monkeypatch):
    """``posttrain sft`` passes the chunked loss's chunk size to the memory check."""
    from posttrain.training import chunked_loss, supervised

    seen = []
    real = limits.check_training_length

    def spy(*args, **kw):
        seen.append(kw)
        return real(*args, **kw)

    def stop(*_, **__):
        raise _Checked

    monkeypatch.setattr(limits, "check_training_length", spy)
    monkeypatch.setattr(supervised, "check_same_run", stop)
    with pytest.raises(_Checked):
        cli.main(["--debug", "sft", "--output", str(tmp_path / "run"), "--model", "qwen3-tiny"])
    assert [kw["logit_chunk_bytes"] for kw in seen] == [chunked_loss.LOGIT_CHUNK_BYTES]


def test_output_paths_accepted_and_refused(tmp_path, monkeypatch):
    """A new or an existing file under a writable directory is accepted; an empty path
    and (emulated with ``os.access``: the tests may run as root) an unwritable directory
    or file are refused, naming them."""
    import os

    from posttrain.atomic import check_output_file

    existing = tmp_path / "old.jsonl"
    existing.write_text("x\n")
    check_output_file(str(tmp_path / "new.jsonl"))
    check_output_file(str(existing))
    for empty in ("", "  "):
        with pytest.raises(ValueError, match=r"^--output '\s*': expected a file path$"):
            check_output_file(empty)
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: str(p) != str(tmp_path) and real(p, mode))
    with pytest.raises(ValueError, match=f"^--output '.*new.jsonl': directory {tmp_path} is not"):
        check_output_file(str(tmp_path / "new.jsonl"))
    monkeypatch.setattr(os, "access", lambda p, mode: str(p) != str(existing))
    with pytest.raises(ValueError, match=r"^--output '.*old.jsonl' is not writable$"):
        check_output_file(str(existing))
