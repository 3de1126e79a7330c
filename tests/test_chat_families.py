"""Each family's own format (``tests/chat_formats.py``: Llama 3, Qwen3, Gemma, GPT-OSS
harmony, Mixtral): SFT trains exactly its assistant spans, rendered ids and masks equal
transformers' ``apply_chat_template``, stop ids are the checkpoint's, and greedy
generation on a tiny Llama-3-format checkpoint stops where transformers' does."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from posttrain import chat
from posttrain.training import data
from tests import chat_formats as cf


def _template(fam: cf.Family) -> chat.ChatTemplate:
    return chat.ChatTemplate(fam.template, fam.tokens, fam.name)


def _think(content: str) -> tuple[str, str]:
    """Qwen3's ``<think>reasoning</think>answer`` split."""
    if "</think>" not in content:
        return "", content
    head, answer = content.split("</think>")
    return head.split("<think>")[-1].strip("\n"), answer.lstrip("\n")


def expected_targets(fam: cf.Family, conversation: list[dict]) -> list[str]:
    """The text of each assistant turn that trains, written from the family's published
    format (not from the template): content and the turn's end token."""
    last_user = max(i for i, m in enumerate(conversation) if m["role"] == "user")
    out = []
    for i, m in enumerate(conversation):
        if m["role"] != "assistant":
            continue
        last = i == len(conversation) - 1
        content = m["content"]
        if fam.name == "llama3":
            out.append(content.strip() + "<|eot_id|>")
        elif fam.name == "gemma":
            out.append(content.strip() + "<end_of_turn>")
        elif fam.name == "mixtral":
            out.append(content + "</s>")
        elif fam.name == "qwen3":
            reasoning, answer = _think(content)
            kept = f"<think>\n{reasoning}\n</think>\n\n" if reasoning and i > last_user else ""
            out.append(kept + answer + "<|im_end|>")
        elif m.get("tool_calls"):  # gpt_oss
            call = m["tool_calls"][0]["function"]
            out.append(
                f"<|channel|>commentary to=functions.{call['name']} <|constrain|>json"
                f"<|message|>{json.dumps(call['arguments'])}<|call|>"
            )
        else:
            thinking = m.get("thinking")
            analysis = (
                f"<|channel|>analysis<|message|>{thinking}<|end|><|start|>assistant"
                if thinking and last
                else ""
            )
            end = "<|return|>" if last else "<|end|>"
            out.append(f"{analysis}<|channel|>final<|message|>{content}{end}")
    return out


def _runs(tokens: np.ndarray, mask: np.ndarray) -> list[list[int]]:
    """The contiguous runs of ``tokens`` where ``mask`` is set."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return [tokens[a:b].tolist() for a, b in zip(edges[::2], edges[1::2], strict=True)]


@pytest.mark.parametrize("family", cf.NAMES)
def test_sft_trains_exactly_the_assistant_spans(family):
    """The rows SFT trains on (encode_dataset -> to_rows): the masked tokens are, run by
    run, each assistant turn's content and end token, and nothing else."""
    fam = cf.FAMILIES[family]
    tok = cf.build_tokenizer(fam)
    examples = data.encode_dataset(fam.conversations, tok, 512, template=_template(fam))
    rows = data.to_rows(examples, 512, packing=False)
    bos = tok.token_to_id(fam.tokens.get("bos_token", ""))
    for r, conversation in enumerate(fam.conversations):
        if bos is not None:  # the template's BOS, once (Llama 3's tokenizer would add one)
            assert (
                rows["input_tokens"][r, :2].tolist().count(bos)
                == 1
                == (rows["input_tokens"][r, 0] == bos)
            )
        mask = rows["input_mask"][r].astype(bool)
        runs = [
            tok.decode(run, skip_special_tokens=False)
            for run in _runs(rows["input_tokens"][r], mask)
        ]
        assert runs == expected_targets(fam, conversation)


@pytest.mark.parametrize("family", cf.NAMES)
def test_dpo_completions_are_the_assistant_turns_and_the_prompt_keeps_one_bos(family):
    """Each conversation as a preference pair (its last assistant turn chosen, a made-up
    one rejected): the completions are exactly the turns' trained text, the prompt has
    the template's BOS once, and a prompt cut to fit keeps it."""
    from posttrain.preference import data as pref

    fam = cf.FAMILIES[family]
    tok = cf.build_tokenizer(fam)
    template = _template(fam)
    rejected = {"role": "assistant", "content": "No."}
    pairs = [
        pref.Pair(c[:-1], c[-1:], [rejected], f"f.jsonl, line {i}")
        for i, c in enumerate(fam.conversations, 1)
    ]
    arrays = pref.encode_pairs(
        pairs, tok, max_prompt_length=400, max_response_length=64, template=template
    )
    bos = tok.token_to_id(fam.tokens.get("bos_token", ""))
    for row, pair in enumerate(pairs):
        for name, turn in (("chosen", pair.chosen), ("rejected", pair.rejected)):
            ids = arrays[f"{name}_ids"][row][arrays[f"{name}_mask"][row].astype(bool)]
            want = expected_targets(fam, [*pair.prompt, *turn])[-1]
            assert tok.decode(ids.tolist(), skip_special_tokens=False) == want
        prompt = arrays["prompt_ids"][row][arrays["prompt_mask"][row].astype(bool)].tolist()
        assert prompt == chat.encode_prompt(pair.prompt, tok, template)
        if bos is not None:
            assert prompt.count(bos) == 1 and prompt[0] == bos
    if bos is not None:
        cut = pref.encode_pairs(
            pairs[:1], tok, max_prompt_length=6, max_response_length=64, template=template
        )
        assert cut["prompt_ids"][0, 0] == bos and cut["prompt_ids"][0, 1] != bos


def test_dpo_names_the_pair_its_template_refuses():
    from posttrain.preference import data as pref

    fam = cf.FAMILIES["gemma"]
    system = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    pairs = [
        pref.Pair(
            fam.conversations[0][:1],
            fam.conversations[0][1:],
            fam.conversations[0][1:],
            "a, line 1",
        ),
        pref.Pair(system, fam.conversations[0][1:], fam.conversations[0][1:], "a, line 2"),
    ]
    with pytest.raises(
        ValueError, match="^a, line 2: chat template gemma: System role not supported$"
    ):
        pref.encode_pairs(
            pairs,
            cf.build_tokenizer(fam),
            max_prompt_length=64,
            max_response_length=64,
            template=_template(fam),
        )


@pytest.mark.parametrize("family", cf.NAMES)
def test_stop_ids_are_the_generation_configs(tmp_path, family):
    """Llama 3's three EOS ids, Qwen3's two, harmony's <|return|>/<|endoftext|>/<|call|>:
    the generation config's, in its order, whatever the tokens are named."""
    fam = cf.FAMILIES[family]
    directory = cf.write_checkpoint(fam, tmp_path / family)
    tok = cf.build_tokenizer(fam)
    want = tuple(tok.token_to_id(t) for t in fam.generation_eos)
    assert chat.stop_ids(tok, checkpoint=directory) == want
    assert chat.resolve_template(directory).source == fam.template


@pytest.mark.reference
@pytest.mark.parametrize("family", cf.NAMES)
@pytest.mark.host
def test_ids_and_assistant_masks_equal_transformers(family):
    """Every test conversation: our ids and assistant mask equal transformers'
    ``apply_chat_template(return_assistant_tokens_mask=True)`` on the same tokenizer and
    template, and so do the prompts with the generation prompt (BOS once: Llama 3's
    tokenizer would add a second)."""
    fam = cf.FAMILIES[family]
    tok = cf.build_tokenizer(fam)
    hf = cf.hf_tokenizer(fam, tok)
    template = _template(fam)
    encoded = chat.encode_conversations(list(fam.conversations), tok, template)
    for conversation, (ids, mask) in zip(fam.conversations, encoded, strict=True):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = hf.apply_chat_template(
                conversation, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
        assert ids.tolist() == list(want["input_ids"])
        assert mask.astype(int).tolist() == list(want["assistant_masks"])
        prompt = conversation[:-1]
        got = chat.encode_prompt(prompt, tok, template)
        assert got == list(
            hf.apply_chat_template(prompt, add_generation_prompt=True, return_dict=True)[
                "input_ids"
            ]
        )
        if fam.post_bos:
            bos = tok.token_to_id(fam.post_bos)
            assert got.count(bos) == 1 and got[0] == bos
            assert tok.encode(template.render(prompt)).ids[:2] == [bos, bos]  # what was avoided
    thinking = dict(add_generation_prompt=True, enable_thinking=False)
    assert template.render(fam.conversations[0][:1], **thinking) == hf.apply_chat_template(
        fam.conversations[0][:1], tokenize=False, **thinking
    )


@pytest.mark.reference
def test_exported_generation_config_is_what_transformers_reads(tmp_path):
    import transformers

    chat.write_generation_config(tmp_path, eos_ids=(5, 3, 4), bos_id=0, temperature=0.6, top_p=0.9)
    config = transformers.GenerationConfig.from_pretrained(tmp_path)
    assert (config.eos_token_id, config.bos_token_id, config.do_sample) == ([5, 3, 4], 0, True)
    assert (config.temperature, config.top_p) == (0.6, 0.9)


GENERATED = 24  # new tokens at most: the stop must come before


#: format -> (the model family of its tiny checkpoint, the turn's stop token)
GENERATION_CASES = {
    "llama3": ("llama3", "<|eot_id|>"),
    "qwen3": ("qwen3", "<|im_end|>"),
    "gemma": ("gemma4", "<end_of_turn>"),
    "gpt_oss": ("gpt_oss", "<|return|>"),
    "mixtral": ("mixtral", "</s>"),
}


@pytest.mark.reference
@pytest.mark.parametrize(
    "name",
    # the gate: Llama 3 (three EOS ids, none of them the config's); the slow tier: the rest
    [pytest.param(n, marks=() if n == "llama3" else pytest.mark.slow) for n in GENERATION_CASES],
)
def test_greedy_chat_generation_stops_at_eot_like_transformers(hf_tiny, tmp_path, name):
    """A tiny random checkpoint in each family's format (its tokenizer, template, and
    generation config with its EOS ids; Llama 3's three): the chat prompt ``posttrain
    generate`` builds and its greedy tokens equal transformers' ``generate`` on the same
    checkpoint, stopping at the same token, the turn's end (<|eot_id|>, <|im_end|>,
    <end_of_turn>, <|return|>, </s>). The model is made to emit it (its lm_head row
    doubled from the token it would pick at step 6), so the stop is tested, not hoped
    for."""
    import torch
    import transformers

    from posttrain import conversion, generate

    model_family, stop = GENERATION_CASES[name]
    fam = cf.FAMILIES[name]
    src = cf.write_checkpoint(fam, tmp_path / "hf")
    tok = cf.build_tokenizer(fam)
    # untied: the doubled output row below must not move the prompt's embeddings (the
    # stop token is in the prompt's earlier turns)
    model = hf_tiny.build(model_family, vocab_size=tok.get_vocab_size(), tie_word_embeddings=False)
    eot = tok.token_to_id(stop)
    template = chat.resolve_template(src)
    prompt = data.chat_prompt(fam.conversations[1][:3], tok, template)
    ids = torch.as_tensor([prompt])
    with torch.no_grad():
        free = model.generate(
            ids, do_sample=False, max_new_tokens=8, eos_token_id=None, pad_token_id=0
        )
        picked = int(free[0, len(prompt) + 6])
        model.lm_head.weight[eot] = 2 * model.lm_head.weight[picked]
    hf_tiny.save(model, src)  # its config.json says EOS 2 (<|start_header_id|> here)
    stops = [tok.token_to_id(t) for t in fam.generation_eos]
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, attn_implementation="eager")
    assert list(hf.generation_config.eos_token_id) == list(chat.stop_ids(tok, checkpoint=src))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = hf.generate(ids, do_sample=False, max_new_tokens=GENERATED, pad_token_id=0)
    want = want[0, len(prompt) :].tolist()
    assert want[-1] == eot and len(want) < GENERATED

    conversion.convert_hf_to_native(src, tmp_path / "native")
    native = conversion.load_native(tmp_path / "native")
    sampling = generate.SamplingConfig(
        max_new_tokens=GENERATED,
        eos_ids=chat.stop_ids(tok, checkpoint=src),
        pad_id=0,
        **chat.resolve_sampling(src),
    )
    out = generate.generate(native, [prompt], sampling)
    assert (out.row(0), out.stop_reasons[0]) == (want, "eos")
    # the same through `posttrain generate` on the checkpoint directory: its template and
    # its generation config's stop ids, nothing guessed from token names
    from posttrain import cli

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": fam.conversations[1][:3]}) + "\n")
    written = tmp_path / "out.jsonl"
    argv = ["generate", "--model", str(src), "--prompts", str(prompts), "--output", str(written)]
    assert cli.main([*argv, "--max-new-tokens", str(GENERATED), "--devices", "1"]) == 0
    record = json.loads(written.read_text())
    assert (record["tokens"], record["stop_reason"]) == (want, "eos")
