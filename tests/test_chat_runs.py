"""The training runs in the checkpoint's own format (#36): ``posttrain sft`` (and ``dpo``,
``grpo``) render with the model's chat template, refuse ChatML a tokenizer would split
into text and a resume in another template, record the template's hash, and export the
template, tokenizer and stop ids so ``posttrain generate`` on the export prompts and
stops in the format the run trained."""

from __future__ import annotations

import hashlib
import itertools
import json

import jax
import numpy as np
import pytest

pytest.importorskip("tunix.sft.peft_trainer", reason="google-tunix is not installed")

from posttrain import chat, cli  # noqa: E402
from posttrain.sft.run import SFTConfig, run_sft  # noqa: E402
from posttrain.tokenizer import load_tokenizer  # noqa: E402
from tests import chat_formats  # noqa: E402

# the templates, their refusals and exports: host code around runs a chip runs elsewhere
pytestmark = pytest.mark.wiring

LLAMA3 = chat_formats.FAMILIES["llama3"]


def _llama3_checkpoint(tmp_path):
    return chat_formats.write_random_checkpoint(LLAMA3, tmp_path / "llama3")


def _chat_file(tmp_path, conversations, repeats: int = 4):
    path = tmp_path / "chat.jsonl"
    lines = [json.dumps({"messages": c}) for c in conversations] * repeats
    path.write_text("\n".join(lines) + "\n")
    return path


class _Stop(Exception):
    """Raised instead of training, once the first batch is recorded."""


def _first_batch(seen: list, *, stop: bool = False):
    """``on_built`` recording the first batch the trainer trains on (``stop``: and
    raising :class:`_Stop` instead of training)."""

    def on_built(trainer):
        original = trainer.train

        def train(batches, *args, **kwargs):
            stream = iter(batches)
            first = next(stream)
            seen.append(first)
            if stop:
                trainer.abandon()
                raise _Stop
            return original(itertools.chain([first], stream), *args, **kwargs)

        trainer.train = train

    return on_built


def test_sft_trains_the_checkpoints_template_and_exports_it(tmp_path):
    """An SFT run from a Llama-3-format HF checkpoint trains its template (one BOS per
    conversation, the template's rendering, loss on each assistant turn's content and
    ``<|eot_id|>``), records its sha256, and exports the template, the tokenizer and the
    generation config's stop ids, which the export then reads as its own."""
    ckpt = _llama3_checkpoint(tmp_path)
    tok = load_tokenizer(str(ckpt))
    conversations = [c for c in LLAMA3.conversations if c[0]["role"] != "system"]
    data = _chat_file(tmp_path, conversations)
    out = tmp_path / "run"
    cfg = SFTConfig(  # a first batch of 8 rows on any mesh, each row packed full
        model=str(ckpt),
        data=str(data),
        steps=2,
        max_target_length=128,
        per_device_batch_size=max(1, 8 // jax.device_count()),
        output=str(out),
    )
    seen: list = []
    run_sft(cfg, on_built=_first_batch(seen))

    template = chat.load_template(ckpt)
    rendered = {template.render(c): c for c in conversations}
    bos = tok.token_to_id("<|begin_of_text|>")
    batch = seen[0]
    segments = 0
    for tokens, mask, seg in zip(
        batch["input_tokens"], batch["input_mask"], batch["segment_ids"], strict=True
    ):
        for s in set(seg[seg > 0].tolist()):
            ids, trained = tokens[seg == s], mask[seg == s].astype(bool)
            conversation = rendered[tok.decode(ids.tolist(), skip_special_tokens=False)]
            assert ids[0] == bos and (ids == bos).sum() == 1
            expected = "".join(
                m["content"].strip() + "<|eot_id|>"
                for m in conversation
                if m["role"] == "assistant"
            )
            assert tok.decode(ids[trained].tolist(), skip_special_tokens=False) == expected
            segments += 1
    assert segments >= 4

    body = json.loads((out / "run.json").read_text())
    assert body["chat_template_sha256"] == hashlib.sha256(LLAMA3.template.encode()).hexdigest()
    eos = [tok.token_to_id(t) for t in LLAMA3.generation_eos]
    assert body["eos_ids"] == eos
    export = out / "model-step2"
    assert (export / "chat_template.jinja").read_text() == LLAMA3.template
    config = json.loads((export / "generation_config.json").read_text())
    assert config["eos_token_id"] == eos and config["bos_token_id"] == bos
    exported_tok = load_tokenizer(str(export))
    assert exported_tok.to_str() == tok.to_str()
    formats = chat.checkpoint_formats(str(export), exported_tok)
    assert formats.template.source == LLAMA3.template and formats.eos_ids == tuple(eos)
    assert formats.template.bos_token == "<|begin_of_text|>"


def test_chatml_without_its_markers_is_refused_before_any_write(tmp_path, capsys):
    """``--chat-template chatml`` with a tokenizer that has no ``<|im_start|>`` token is
    refused in one line (exit 2) before the output directory exists."""
    ckpt = _llama3_checkpoint(tmp_path)
    out = tmp_path / "run"
    argv = ["sft", "--model", str(ckpt), "--chat-template", "chatml", "--output", str(out)]
    assert cli.main([*argv, "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no <|im_start|> token" in err, err
    assert not out.exists()


def test_a_resume_in_another_template_is_refused_before_any_write(tmp_path, capsys):
    """A rerun into an output trained in the built-in ChatML (recorded, or recorded
    before templates were read) with another template file is refused in one line naming
    both; with the same template it passes the check."""
    from posttrain.training import formats as run_formats
    from posttrain.training import record as run_record

    other = tmp_path / "other.jinja"
    other.write_text(chat.CHATML.replace("'\\n'", "'\\n\\n'"))
    for facts in ({"rows": 1, run_formats.TEMPLATE_SHA_KEY: chat.chatml().sha256}, {"rows": 1}):
        out = tmp_path / f"run{len(facts)}"
        out.mkdir()
        run_record.record_segment(out, SFTConfig(output=str(out)), facts, 0)
        before = sorted(p.name for p in out.iterdir())
        argv = ["sft", "--output", str(out), "--chat-template", str(other)]
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "trained in chat template chatml" in err, err
        assert str(other) in err and "refusing to resume" in err
        assert sorted(p.name for p in out.iterdir()) == before
        tok = load_tokenizer(None)
        same = run_formats.run_formats(SFTConfig(output=str(out)), tok, None)
        assert same.template.source == chat.CHATML
    # a run recorded in the other template: resumed in it, refused in the default ChatML
    out = tmp_path / "run-other"
    out.mkdir()
    trained = chat.resolve_template(None, str(other))
    facts = {run_formats.TEMPLATE_SHA_KEY: trained.sha256, run_formats.TEMPLATE_KEY: str(other)}
    run_record.record_segment(out, SFTConfig(output=str(out)), facts, 0)
    resumed = SFTConfig(output=str(out), chat_template=str(other))
    assert run_formats.run_formats(resumed, load_tokenizer(None), None).template == trained
    with pytest.raises(ValueError) as refused:
        run_formats.run_formats(SFTConfig(output=str(out)), load_tokenizer(None), None)
    assert str(refused.value) == (
        f"{out} holds a run trained in chat template {other} (sha256 {trained.sha256[:12]}), "
        f"not chatml (sha256 {chat.chatml().sha256[:12]}); refusing to resume it: use a new "
        "--output, or the run's template (--chat-template)"
    )


def test_a_preset_with_a_tokenizer_directory_trains_in_the_tokenizers_template(tmp_path):
    """``--model PRESET --tokenizer DIR/tokenizer.json``: the template and the stop id are
    the tokenizer directory's (its tokenizer_config.json), not ChatML and names."""
    from posttrain.training.formats import run_formats

    ckpt = chat_formats.write_checkpoint(LLAMA3, tmp_path / "llama3")
    path = str(ckpt / "tokenizer.json")
    tok = load_tokenizer(path)
    cfg = SFTConfig(model="llama3-tiny", tokenizer=path, output=str(tmp_path / "run"))
    formats = run_formats(cfg, tok, path)
    assert formats.template.source == LLAMA3.template
    assert formats.eos_ids == (tok.token_to_id("<|eot_id|>"),)  # tokenizer_config's eos


def test_a_chatml_run_exports_im_end_first_and_the_embedded_tokenizer(tmp_path):
    """The built-in ChatML run's export stops at ``<|im_end|>`` (what it learnt to end a
    turn with) before the names' others, and its template is ChatML."""
    from posttrain.training.formats import run_formats

    tok = load_tokenizer(None)
    formats = run_formats(SFTConfig(output=str(tmp_path / "run")), tok, None)
    formats.write(tmp_path)
    config = json.loads((tmp_path / "generation_config.json").read_text())
    assert config["eos_token_id"][0] == tok.token_to_id("<|im_end|>")
    assert config["do_sample"] is False
    assert (tmp_path / "chat_template.jinja").read_text() == chat.CHATML
    assert np.array_equal(
        load_tokenizer(str(tmp_path)).encode("a<|im_end|>").ids,
        tok.encode("a<|im_end|>").ids,
    )


def _pairs_file(tmp_path, repeats: int = 8):
    path = tmp_path / "pairs.jsonl"
    pairs = [
        {"prompt": "What is 2+3?", "chosen": "2+3 is 5.", "rejected": "It is 6."},
        {"prompt": "Name a colour.", "chosen": "Blue.", "rejected": "Seven."},
    ]
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs * repeats))
    return path, pairs


def test_dpo_prompts_carry_the_templates_one_bos(tmp_path):
    """A DPO run from a Llama-3-format checkpoint (whose tokenizer's post-processor adds a
    BOS of its own): each prompt is the template's rendering with its generation prompt,
    one ``<|begin_of_text|>`` (the template's), each completion the assistant turn and
    ``<|eot_id|>``; run.json records the template (the export is SFT's, tested above)."""
    from posttrain.preference.run import DPORunConfig, run_dpo

    ckpt = _llama3_checkpoint(tmp_path)
    tok = load_tokenizer(str(ckpt))
    template = chat.load_template(ckpt)
    data, pairs = _pairs_file(tmp_path)
    out = tmp_path / "run"
    cfg = DPORunConfig(
        model=str(ckpt),
        data=str(data),
        steps=1,
        max_prompt_length=32,
        max_response_length=16,
        output=str(out),
    )
    seen: list = []
    with pytest.raises(_Stop):
        run_dpo(cfg, on_built=_first_batch(seen, stop=True))
    batch = seen[0]
    bos = tok.token_to_id("<|begin_of_text|>")
    prompts = {
        tuple(chat.encode_prompt([{"role": "user", "content": p["prompt"]}], tok, template)): p
        for p in pairs
    }
    for i in range(len(batch["prompt_ids"])):
        ids = batch["prompt_ids"][i][batch["prompt_mask"][i] > 0].tolist()
        assert ids.count(bos) == 1 and ids[0] == bos
        pair = prompts[tuple(ids)]
        chosen = batch["chosen_ids"][i][batch["chosen_mask"][i] > 0].tolist()
        assert tok.decode(chosen, skip_special_tokens=False) == pair["chosen"] + "<|eot_id|>"
    body = json.loads((out / "run.json").read_text())
    assert body["chat_template_sha256"] == template.sha256


def test_grpo_prompts_and_stops_in_the_checkpoints_format(tmp_path):
    """A GRPO run from a Llama-3-format checkpoint (no warm-up): its tokenizer is the
    checkpoint's, its prompts the template's rendering (one BOS, the Llama-3 assistant
    header), its rollout stops at the generation config's ids, not a token's name."""
    from posttrain.rl.run import GRPORunConfig, run_grpo

    ckpt = _llama3_checkpoint(tmp_path)
    tok = load_tokenizer(str(ckpt))
    template = chat.load_template(ckpt)
    cfg = GRPORunConfig(
        model=str(ckpt),
        steps=1,
        warmup_steps=0,
        per_device_batch_size=1,
        num_generations=2,
        max_new_tokens=2,
        eval_samples=0,
        output=str(tmp_path / "run"),
    )
    seen = {}

    def on_built(learner, policies):
        def train(data, *args, **kwargs):
            names = set(vars(learner))
            cluster = learner.rl_engine if "rl_engine" in names else learner.rl_cluster
            seen["rollout"] = cluster.cluster_config.rollout_config
            seen["batch"] = next(iter(data))
            raise _Stop

        learner.train = train

    with pytest.raises(_Stop):
        run_grpo(cfg, on_built=on_built)
    eos = [tok.token_to_id(t) for t in LLAMA3.generation_eos]
    assert list(seen["rollout"].eos_tokens) == eos
    for prompt in seen["batch"]["prompts"]:
        question = prompt.split("<|end_header_id|>\n\n")[1].split("<|eot_id|>")[0]
        assert prompt == chat.prompt_text([{"role": "user", "content": question}], template)
        assert prompt.startswith("<|begin_of_text|>") and prompt.count("<|begin_of_text|>") == 1


def _generated(ckpt, out, *flags) -> list[int]:
    argv = ["generate", "--model", str(ckpt), "--prompt", "Name a colour.", "--chat"]
    assert cli.main([*argv, "--max-new-tokens", "8", "--output", str(out), *flags]) == 0
    return json.loads(out.read_text())["tokens"]


def test_generate_takes_each_sampling_value_the_user_omits_from_the_checkpoint(tmp_path):
    """``posttrain generate``'s sampling: each of ``--temperature``, ``--top-k``,
    ``--top-p`` given wins; each omitted is generation_config.json's (greedy where it does
    not sample), else greedy and unlimited; stop and pad ids are the checkpoint's."""
    import argparse

    from posttrain.commands.generate import _sampling

    tok = load_tokenizer(None)
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [3, 4], "pad_token_id": 9, "do_sample": True, "top_k": 5})
    )

    def sampling(spec, **given):
        args = argparse.Namespace(
            **{"temperature": None, "top_k": None, "top_p": None, **given},
            max_new_tokens=4,
            seed=0,
        )
        got = _sampling(args, chat.checkpoint_formats(spec, tok))
        return got.temperature, got.top_k, got.top_p, got.eos_ids, got.pad_id

    # do_sample without a temperature: transformers' 1.0
    assert sampling(str(tmp_path)) == (1.0, 5, None, (3, 4), 9)
    assert sampling(str(tmp_path), temperature=0.0, top_p=0.5) == (0.0, 5, 0.5, (3, 4), 9)
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.7}))
    assert sampling(str(tmp_path))[:3] == (0.0, None, None)  # do_sample absent: greedy
    assert sampling(str(tmp_path), top_k=2)[:3] == (0.0, 2, None)
    assert sampling("qwen3-tiny")[:3] == (0.0, None, None)  # a preset has no files


@pytest.mark.slow  # four generate runs; the gate has the test above
def test_generate_samples_with_the_checkpoints_defaults_unless_told(tmp_path):
    """``posttrain generate`` without sampling flags: greedy where generation_config.json
    does not sample, its temperature where it does (seeded: the same draw twice);
    ``--temperature 0`` wins over it."""
    ckpt = _llama3_checkpoint(tmp_path)
    out = tmp_path / "out.jsonl"
    greedy = _generated(ckpt, out)
    path = ckpt / "generation_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "do_sample": True, "temperature": 5.0, "top_k": 50}))
    sampled = _generated(ckpt, out)
    assert sampled != greedy
    assert _generated(ckpt, out) == sampled
    assert _generated(ckpt, out, "--temperature", "0") == greedy


def test_the_pad_id_is_the_checkpoints_before_any_name(tmp_path):
    """The pad id: generation_config.json's ``pad_token_id``, then config.json's, then
    tokenizer_config.json's ``pad_token``; a token named ``<|pad|>`` only when none says."""
    tok = load_tokenizer(None)
    named = tok.token_to_id("<|pad|>")
    assert chat.pad_id(tok, checkpoint=tmp_path) == named
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"pad_token": "<|endoftext|>"}))
    assert chat.pad_id(tok, checkpoint=tmp_path) == tok.token_to_id("<|endoftext|>")
    (tmp_path / "config.json").write_text(json.dumps({"pad_token_id": 7}))
    assert chat.pad_id(tok, checkpoint=tmp_path) == 7
    (tmp_path / "generation_config.json").write_text(json.dumps({"pad_token_id": 5}))
    assert chat.pad_id(tok, checkpoint=tmp_path) == 5
    (tmp_path / "generation_config.json").write_text(json.dumps({"pad_token_id": -1}))
    with pytest.raises(chat.TemplateError, match="pad_token_id=-1; expected an id >= 0"):
        chat.pad_id(tok, checkpoint=tmp_path)
    (tmp_path / "config.json").unlink()
    (tmp_path / "generation_config.json").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"pad_token": "<nope>"}))
    with pytest.raises(chat.TemplateError, match="pad_token '<nope>' is not in"):
        chat.pad_id(tok, checkpoint=tmp_path)


@pytest.mark.slow  # 200 SFT steps, then transformers on the converted export
@pytest.mark.reference
def test_an_sft_export_generates_and_stops_like_transformers_on_its_hf_conversion(tmp_path):
    """The docs/formats.md demo as a test: a Llama-3-format checkpoint fine-tuned on the
    addition task in its own template; ``posttrain generate`` on the export stops each
    answer at ``<|eot_id|>``, and transformers on ``posttrain convert --to hf`` of the
    export (which carries the template, tokenizer and generation config) renders the same
    prompt and generates the same tokens, stopping at the same place."""
    import warnings

    import torch
    import transformers

    from posttrain.rl import arithmetic

    ckpt = _llama3_checkpoint(tmp_path)
    data = tmp_path / "addition.jsonl"
    arithmetic.write_warmup_jsonl(arithmetic.problems(), data, repeats=4)
    out = tmp_path / "run"
    cfg = SFTConfig(
        model=str(ckpt), data=str(data), steps=200, max_target_length=64, output=str(out)
    )
    run_sft(cfg)
    export = out / "model-step200"
    questions = ["3+4=", "9+8=", "0+5="]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": q}]}) + "\n" for q in questions
        )
    )
    written = tmp_path / "ours.jsonl"
    argv = ["generate", "--model", str(export), "--prompts", str(prompts), "--output", str(written)]
    assert cli.main([*argv, "--max-new-tokens", "16"]) == 0
    ours = [json.loads(line) for line in written.read_text().splitlines()]
    tok = load_tokenizer(str(export))
    eot = tok.token_to_id("<|eot_id|>")
    assert [(r["tokens"][-1], r["stop_reason"]) for r in ours] == [(eot, "eos")] * 3
    assert all(r["text"].isdigit() for r in ours), ours  # an answer, then the stop

    hf_dir = tmp_path / "hf"
    assert cli.main(["convert", "--from", "native", "--to", "hf", str(export), str(hf_dir)]) == 0
    hf_tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager")
    for question, record in zip(questions, ours, strict=True):
        messages = [{"role": "user", "content": question}]
        ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        template = chat.load_template(export)
        assert list(ids) == chat.encode_prompt(messages, tok, template)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = hf.generate(torch.as_tensor([ids]), do_sample=False, max_new_tokens=16)
        assert got[0, len(ids) :].tolist() == record["tokens"]


def test_native_to_hf_carries_the_exports_formats(tmp_path):
    """``posttrain convert --from native --to hf`` of a run's export copies its chat
    template, tokenizer and generation config, so the HF directory serves in the format
    the run trained (transformers reads them: the slow test above)."""
    from posttrain.conversion import convert_native_to_hf, save_native
    from posttrain.models import build_model, flat_params, get_config
    from posttrain.training.formats import run_formats

    cfg = get_config("qwen3-tiny")
    native = save_native(flat_params(build_model(cfg, seed=0)), cfg, tmp_path / "native")
    tok = load_tokenizer(None)
    run_formats(SFTConfig(output=str(tmp_path / "run")), tok, None).write(native)
    convert_native_to_hf(native, tmp_path / "hf")
    names = ("chat_template.jinja", "generation_config.json", "tokenizer.json")
    for name in (*names, "tokenizer_config.json"):
        assert (tmp_path / "hf" / name).read_bytes() == (native / name).read_bytes(), name
    formats = chat.checkpoint_formats(str(tmp_path / "hf"), load_tokenizer(str(tmp_path / "hf")))
    assert formats.template.source == chat.CHATML
    assert formats.eos_ids[0] == tok.token_to_id("<|im_end|>")


def test_sft_refuses_data_its_template_refuses_naming_the_file_and_line(tmp_path, capsys):
    """``posttrain sft`` checks a data file in its template's terms before any write: a
    system message where the family has no system role (Gemma's template, through
    ``--chat-template``) is one line naming the file, the line and the template's rule."""
    ckpt = _llama3_checkpoint(tmp_path)
    gemma = tmp_path / "gemma.jinja"
    gemma.write_text(chat_formats.FAMILIES["gemma"].template)
    good = LLAMA3.conversations[0]
    data = _chat_file(tmp_path, [good, [{"role": "system", "content": "Be brief."}, *good]], 1)
    out = tmp_path / "run"
    argv = ["sft", "--model", str(ckpt), "--chat-template", str(gemma), "--data", str(data)]
    assert cli.main([*argv, "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{data}, line 2: " in err, err
    assert "System role not supported" in err and not out.exists()


def test_the_export_keeps_the_checkpoints_pad_bos_and_sampling_defaults(tmp_path):
    """The export's generation_config.json: the run's stop ids, and the base checkpoint's
    pad id, the template's BOS id and its sampling defaults (transformers reads them back:
    ``tests/test_chat_families.py``), so generating from the export samples as the base."""
    from posttrain.training.formats import run_formats

    ckpt = chat_formats.write_checkpoint(LLAMA3, tmp_path / "llama3")
    config = json.loads((ckpt / "generation_config.json").read_text())
    sampled = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.9}
    (ckpt / "generation_config.json").write_text(
        json.dumps({**config, **sampled, "pad_token_id": 7})
    )
    tok = load_tokenizer(str(ckpt))
    formats = run_formats(SFTConfig(model=str(ckpt), output=str(tmp_path / "run")), tok, str(ckpt))
    formats.write(tmp_path / "export")
    written = json.loads((tmp_path / "export" / "generation_config.json").read_text())
    bos = tok.token_to_id("<|begin_of_text|>")
    assert written == {**config, **sampled, "pad_token_id": 7, "bos_token_id": bos}
    assert chat.resolve_sampling(tmp_path / "export") == chat.resolve_sampling(ckpt)
