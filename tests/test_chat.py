"""posttrain.chat: templates found, loaded, rendered and saved as transformers does; the
built-in ChatML giving the rows ``posttrain sft`` always trained; masks by generation
blocks or prefix rendering, and the templates refused; stop ids and sampling defaults
read from the checkpoint in their order; validation in the template's terms."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest

from posttrain import chat
from posttrain.preference import data as pref_data
from posttrain.rl import arithmetic
from posttrain.tokenizer import byte_tokenizer
from posttrain.training import data, default_data
from posttrain.tunix_sampler import TunixTokenizer
from tests import chat_formats as cf

pytestmark = pytest.mark.host

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi <|im_end|> there"},
    {"role": "assistant", "content": "Héllo ✓"},
    {"role": "user", "content": "More"},
    {"role": "assistant", "content": "Done."},
]


def piecewise_chatml(conversation, tokenizer):
    """What ``encode_chats`` computed before templates were read (the oracle): each ChatML
    piece encoded on its own; content and ``<|im_end|>`` of assistant turns are targets."""
    ids, mask = [], []
    for m in conversation:
        target = m["role"] == "assistant"
        for piece, t in (
            (f"<|im_start|>{m['role']}\n", False),
            (m["content"], target),
            ("<|im_end|>", target),
            ("\n", False),
        ):
            piece_ids = tokenizer.encode(piece, add_special_tokens=False).ids
            ids += piece_ids
            mask += [t] * len(piece_ids)
    return ids, mask


def test_builtin_chatml_gives_the_rows_sft_always_trained_on_the_embedded_data():
    """Every conversation of the embedded dataset (and one with a special token's spelling
    and non-ASCII text): ids and loss mask equal the piecewise ChatML encoding."""
    tok = byte_tokenizer()
    conversations = [*default_data.pydoc_conversations(), CHAT]
    examples = data.encode_chats(conversations, tok)
    assert len(examples) == len(conversations) > 50
    for conversation, ex in zip(conversations, examples, strict=True):
        ids, mask = piecewise_chatml(conversation, tok)
        np.testing.assert_array_equal(ex.tokens, ids)
        np.testing.assert_array_equal(ex.loss_mask, mask)
    prompt = data.chat_prompt(CHAT[:2], tok)
    head = piecewise_chatml(CHAT[:2], tok)[0] + tok.encode("<|im_start|>assistant\n").ids
    assert prompt == head


def test_rl_prompt_and_preference_pieces_keep_their_chatml_text():
    assert arithmetic.Problem(3, 4).prompt == (
        "<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n"
    )
    tok = byte_tokenizer()
    turns = [{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]
    got = tok.decode(
        pref_data.encode_completion(turns, tok, prompt=CHAT[:2]), skip_special_tokens=False
    )
    assert got == "a<|im_end|>\n<|im_start|>assistant\nb<|im_end|>"


# --- loading --------------------------------------------------------------------------


def _write(directory, config=None, jinja=None):
    directory.mkdir(exist_ok=True)
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (directory / "chat_template.jinja").write_text(jinja)
    return directory


def test_a_jinja_file_wins_over_tokenizer_config_and_lists_use_default(tmp_path):
    d = _write(tmp_path / "a", {"chat_template": "config", "bos_token": {"content": "<s>"}}, "file")
    t = chat.load_template(d / "tokenizer.json")  # a tokenizer file: its directory
    assert (t.source, t.special_tokens) == ("file", {"bos_token": "<s>"})
    d = _write(
        tmp_path / "b",
        {
            "chat_template": [
                {"name": "tool_use", "template": "t"},
                {"name": "default", "template": "d"},
            ]
        },
    )
    assert chat.load_template(d).source == "d"
    assert chat.load_template(_write(tmp_path / "c", {"eos_token": "x"})) is None
    assert chat.load_template(_write(tmp_path / "e")) is None
    assert chat.resolve_template(tmp_path / "c").source == chat.CHATML
    assert chat.resolve_template(tmp_path / "c").special_tokens == {"eos_token": "x"}
    assert chat.resolve_template(tmp_path / "a", "chatml").source == chat.CHATML
    (tmp_path / "mine.jinja").write_text("{{ eos_token }}")
    assert chat.resolve_template(tmp_path / "c", str(tmp_path / "mine.jinja")).render([]) == "x"


@pytest.mark.parametrize(
    ("config", "jinja", "message"),
    [
        ({"chat_template": [{"name": "x", "template": "t"}]}, None, "without a 'default'"),
        ({"chat_template": 3}, None, "expected a Jinja string, got int"),
        (None, "{% for %}", "does not parse"),
        ([1], None, "expected a JSON object, got list"),
    ],
    ids=["list-without-default", "not-a-string", "bad-jinja", "config-not-an-object"],
)
def test_bad_templates_are_refused_in_one_line(tmp_path, config, jinja, message):
    d = _write(tmp_path / "d", config, jinja)
    with pytest.raises(chat.TemplateError, match=message) as error:
        chat.load_template(d)
    assert "\n" not in str(error.value)


def test_a_missing_override_file_is_named(tmp_path):
    with pytest.raises(chat.TemplateError, match="--chat-template 'nope.jinja' is not a file"):
        chat.resolve_template(None, "nope.jinja")


def test_rendering_has_transformers_globals_and_filters():
    t = chat.ChatTemplate(
        "{{ messages[0]['content'] | tojson }}{{ bos_token }}{{ strftime_now('%Y') | length }}"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}!{% endfor %}",
        {"bos_token": "<B>"},
    )
    assert t.render([{"content": "<é>"}, {"content": ""}]) == '"<é>"<B>4!'
    refusing = chat.ChatTemplate("{{ raise_exception('no system\nrole') }}", origin="fam")
    with pytest.raises(chat.TemplateError, match="^chat template fam: no system role$"):
        refusing.render([])
    adding = chat.ChatTemplate("{{ messages[0]['content'] + '!' }}", origin="t")
    with pytest.raises(chat.TemplateError, match="^chat template t: can only concatenate list"):
        adding.render([{"content": []}])
    mutating = chat.ChatTemplate("{% set x = [] %}{{ x.append(1) }}")
    with pytest.raises(chat.TemplateError, match="unsafe"):  # the sandbox is immutable
        mutating.render([])


def test_save_template_round_trips_and_leaves_one_source(tmp_path):
    d = _write(tmp_path / "export", {"chat_template": "old", "model_max_length": 9})
    template = chat.ChatTemplate(cf.LLAMA3, {"bos_token": "<|begin_of_text|>"}, "x")
    chat.save_template(d, template)
    loaded = chat.load_template(d)
    assert (loaded.source, loaded.special_tokens) == (template.source, template.special_tokens)
    assert loaded.sha256 == template.sha256 != chat.chatml().sha256
    config = json.loads((d / "tokenizer_config.json").read_text())
    assert "chat_template" not in config and config["model_max_length"] == 9


# --- masks ----------------------------------------------------------------------------


def _without_blocks(source):
    return source.replace("{%- generation -%}", "").replace("{%- endgeneration -%}", "")


@pytest.mark.parametrize("family", ["llama3", "mixtral"])
def test_prefix_rendering_finds_the_generation_blocks_spans(family):
    """Families whose assistant turn ends at its end token: the spans found by rendering
    prefixes equal the generation blocks' spans."""
    fam = cf.FAMILIES[family]
    blocks = chat.ChatTemplate(fam.template, fam.tokens)
    plain = chat.ChatTemplate(_without_blocks(fam.template), fam.tokens)
    assert not plain.has_generation_blocks
    for conversation in fam.conversations:
        assert chat.assistant_spans(plain, conversation) == chat.assistant_spans(
            blocks, conversation
        )


def test_prefix_rendering_of_chatml_includes_the_turns_newline():
    plain = chat.ChatTemplate(_without_blocks(chat.CHATML))
    text, spans = chat.assistant_spans(plain, CHAT)
    assert [text[a:b] for a, b in spans] == ["Héllo ✓<|im_end|>\n", "Done.<|im_end|>\n"]


@pytest.mark.parametrize("family", ["qwen3", "gpt_oss"])
def test_a_template_that_rewrites_earlier_turns_cannot_be_masked_by_prefixes(family):
    """Qwen3 drops reasoning before the last user turn, harmony ends the last turn with
    <|return|>: without generation blocks the multi-turn conversation is refused."""
    fam = cf.FAMILIES[family]
    plain = chat.ChatTemplate(_without_blocks(fam.template), fam.tokens, family)
    conversation = fam.conversations[-1 if family == "qwen3" else 1]  # two assistant turns
    message = (
        f"chat template {family} cannot isolate assistant message 1: it renders the "
        "conversation up to that turn differently from the start of the whole conversation; "
        "give it {% generation %} blocks (--chat-template FILE)"
    )
    with pytest.raises(chat.MaskError, match=f"^{re.escape(message)}$"):
        chat.assistant_spans(plain, conversation)
    with pytest.raises(ValueError, match="^f.jsonl, line 3: chat template"):
        chat.check_conversation(plain, conversation, where="f.jsonl, line 3")


def test_blocks_that_mark_nothing_are_refused():
    t = chat.ChatTemplate(
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% if false %}{% generation %}x{% endgeneration %}{% endif %}"
    )
    with pytest.raises(
        chat.MaskError, match="mark no text of this conversation's assistant turns$"
    ):
        chat.assistant_spans(t, CHAT)
    assert chat.assistant_spans(t, CHAT[:2]) == ("Be brief.Hi <|im_end|> there", [])  # a prompt


_TURNS = (
    "{% for m in messages %}{% if m['role'] == 'user' %}U{{ m['content'] }}"
    "{% else %}{% generation %}{{ m['content'] }}{% endgeneration %}E{% endif %}{% endfor %}"
)


def test_completions_that_cannot_be_cut_from_the_prompt_are_refused():
    """Split a completion from its prompt: refused when the generation prompt is not what
    the conversation continues with, when a token merges across the boundary, and when
    the completion trains no token."""
    byte = byte_tokenizer()
    user, said = {"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}
    other_header = chat.ChatTemplate(
        chat.CHATML.replace("assistant\\n' -}}{%- endif", "model\\n' -}}{%- endif"), origin="t"
    )
    assert other_header.render([user], add_generation_prompt=True).endswith("model\n")
    with pytest.raises(
        chat.MaskError, match="^chat template t: the prompt with its generation prompt is not"
    ):
        chat.split_completion([user], [said], byte, other_header)
    merging = cf.build_tokenizer(
        dataclasses.replace(
            cf.FAMILIES["mixtral"],
            conversations=([user, {"role": "assistant", "content": "xy" * 40}],),
        )
    )
    assert merging.encode("Uxy").ids[1:] == merging.encode("xy").ids  # the merge exists
    turns = chat.ChatTemplate(_TURNS, origin="t")
    with pytest.raises(
        chat.MaskError, match="^chat template t: the prompt with its generation prompt is not"
    ):
        chat.split_completion([user], [said], merging, turns)
    assert chat.split_completion([user], [said], byte, turns) == ([ord("U"), ord("x")], [ord("y")])
    empty = {"role": "assistant", "content": ""}
    with pytest.raises(
        chat.MaskError, match="^chat template t: the completion holds no assistant token$"
    ):
        chat.split_completion([user, said, user], [empty], byte, turns)


def test_token_mask_marks_tokens_overlapping_a_span():
    offsets = [(0, 2), (2, 3), (3, 6), (6, 6), (6, 9)]
    assert chat.token_mask(offsets, [(2, 4)]).tolist() == [False, True, True, False, False]
    assert chat.token_mask(offsets, [(1, 2), (8, 9)]).tolist() == [True, False, False, False, True]
    empty = chat.token_mask([], [(0, 1)])
    assert (empty.shape, empty.dtype) == ((0,), np.dtype(bool))


# --- validation -----------------------------------------------------------------------


def test_validation_names_the_file_the_line_and_the_rule(tmp_path):
    gemma = chat.ChatTemplate(cf.GEMMA, cf.FAMILIES["gemma"].tokens, "gemma")
    lines = [
        {"messages": CHAT[1:3]},
        {"messages": CHAT[:3]},  # gemma: no system role
        {"messages": [CHAT[1], CHAT[2], CHAT[2]]},  # roles must alternate
    ]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    only = lambda want: lambda i: i == want  # noqa: E731
    assert data.read_chat_jsonl(path, only(0), template=gemma)[0] == CHAT[1:3]
    with pytest.raises(ValueError, match=f"^{path}, line 2: chat template gemma: System role not"):
        data.read_chat_jsonl(path, only(1), template=gemma)
    with pytest.raises(
        ValueError, match=f"^{path}, line 3: chat template gemma: Conversation roles"
    ):
        data.read_chat_jsonl(path, only(2), template=gemma)
    with pytest.raises(
        ValueError, match=r"^x, line 1: the conversation ends with a 'user' message"
    ):
        data.validate_messages({"messages": CHAT[:4]}, where="x, line 1")


def test_a_system_message_the_template_leaves_out_is_refused():
    skips = chat.ChatTemplate(
        "{% for m in messages %}{% if m['role'] != 'system' %}{{ m['role'] }}: "
        "{% generation %}{{ m['content'] }}{% endgeneration %}\n{% endif %}{% endfor %}",
        origin="no-system",
    )
    with pytest.raises(
        ValueError,
        match="^f, line 9: message 0 is a system message, but chat "
        "template no-system leaves it out",
    ):
        chat.check_conversation(skips, CHAT, where="f, line 9")
    chat.check_conversation(chat.chatml(), CHAT, where="f, line 9")


# --- stop ids and sampling ------------------------------------------------------------


def test_stop_ids_come_from_the_checkpoint_in_order(tmp_path):
    """generation_config.json, then config.json (its text_config too), then the tokenizer's
    eos_token; names only when none says anything."""
    fam = cf.FAMILIES["llama3"]
    d = cf.write_checkpoint(fam, tmp_path / "ckpt")
    tok = cf.build_tokenizer(fam)
    ids = [tok.token_to_id(t) for t in fam.generation_eos]
    assert chat.stop_ids_with_source(tok, checkpoint=d) == (
        tuple(ids),
        str(d / "generation_config.json"),
    )
    (d / "generation_config.json").write_text(json.dumps({"bos_token_id": 0}))
    assert chat.stop_ids(tok, checkpoint=d) == (tok.token_to_id("<|end_of_text|>"),)
    (d / "config.json").write_text(json.dumps({"text_config": {"eos_token_id": [4, 4, 5]}}))
    assert chat.stop_ids(tok, checkpoint=d) == (4, 5)
    (d / "config.json").write_text(
        json.dumps({"eos_token_id": 9, "text_config": {"eos_token_id": 4}})
    )
    assert chat.stop_ids(tok, checkpoint=d) == (9,)  # the top level first
    (d / "config.json").unlink()
    assert chat.stop_ids_with_source(tok, checkpoint=d) == (
        (tok.token_to_id("<|eot_id|>"),),
        f"{d}/tokenizer_config.json",
    )
    byte = byte_tokenizer()
    assert chat.stop_ids_with_source(byte) == (
        (258, 256),
        "default token names <|im_end|>, <|endoftext|>, </s>",
    )
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<nope>"}))
    with pytest.raises(chat.TemplateError, match="eos_token '<nope>' is not in the tokenizer"):
        chat.stop_ids(tok, checkpoint=d)
    (d / "config.json").write_text(json.dumps({"eos_token_id": [1, "2"]}))
    with pytest.raises(chat.TemplateError, match=r"config.json: eos_token_id=\[1, '2'\]; expected"):
        chat.stop_ids(tok, checkpoint=d)


def test_a_checkpoints_eos_wins_over_a_token_named_im_end(tmp_path):
    """The issue's Mixtral-style checkpoint: its config says EOS 2 while its (byte)
    tokenizer has <|im_end|> at 258; generation stops at 2 only, as transformers does."""
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert chat.stop_ids(byte_tokenizer(), checkpoint=tmp_path) == (2,)


def test_checkpoint_formats_read_the_export_then_the_tokenizer(tmp_path):
    """A preset: ChatML and the default names; a Llama 3 checkpoint: its template and
    three ids; an export carrying its own template and generation config wins over the
    recorded tokenizer's."""
    byte = byte_tokenizer()
    preset = chat.checkpoint_formats("llama3-tiny", byte)
    assert (preset.template.source, preset.eos_ids, preset.checkpoint) == (
        chat.CHATML,
        (258, 256),
        None,
    )
    fam = cf.FAMILIES["llama3"]
    d = cf.write_checkpoint(fam, tmp_path / "ckpt")
    tok = cf.build_tokenizer(fam)
    own = chat.checkpoint_formats(d, tok)
    assert own.template.source == fam.template and len(own.eos_ids) == 3
    assert own.sampling(top_k=3) == {"temperature": 0.0, "top_k": 3, "top_p": None}
    assert chat.checkpoint_formats(d, tok, chat_template="chatml").template.source == chat.CHATML
    export = tmp_path / "export"
    export.mkdir()
    chat.save_template(export, chat.chatml())
    chat.write_generation_config(export, eos_ids=(7,))
    formats = chat.checkpoint_formats(export, tok, tokenizer_path=d)
    assert (formats.template.source, formats.eos_ids) == (chat.CHATML, (7,))


def test_a_chatml_run_stops_at_im_end_and_needs_its_tokens(tmp_path):
    """Trained in the built-in ChatML, an export stops at <|im_end|> first, then the
    checkpoint's ids; ChatML with a tokenizer that would split its markers is refused."""
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    byte = byte_tokenizer()
    assert chat.run_stop_ids(chat.chatml(), byte, checkpoint=tmp_path) == (258, 2)
    assert chat.run_stop_ids(chat.chatml(), byte) == (258, 256)
    llama = chat.ChatTemplate(cf.LLAMA3)
    assert chat.run_stop_ids(llama, byte, checkpoint=tmp_path) == (2,)
    chat.check_template_tokens(chat.chatml(), byte)
    chat.check_template_tokens(llama, cf.build_tokenizer(cf.FAMILIES["llama3"]))
    with pytest.raises(
        chat.TemplateError, match=re.escape("no chat template and no <|im_start|> token")
    ):
        chat.check_template_tokens(chat.chatml(), cf.build_tokenizer(cf.FAMILIES["llama3"]))


def test_sampling_defaults_follow_generation_config_and_the_user_wins(tmp_path):
    assert chat.resolve_sampling(None) == {"temperature": 0.0, "top_k": None, "top_p": None}
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps({"temperature": 0.6, "top_p": 0.9}))  # no do_sample: greedy
    assert chat.sampling_defaults(tmp_path) == {"temperature": 0.0}
    path.write_text(json.dumps({"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95}))
    assert chat.resolve_sampling(tmp_path, top_k=5) == {
        "temperature": 0.6,
        "top_k": 5,
        "top_p": 0.95,
    }
    defaults = chat.sampling_defaults(tmp_path)  # top_k an int (SamplingConfig's), the rest floats
    assert [type(defaults[k]) for k in ("temperature", "top_k", "top_p")] == [float, int, float]
    path.write_text(json.dumps({"do_sample": True, "top_k": True}))
    with pytest.raises(chat.TemplateError, match="top_k=True; expected a number"):
        chat.sampling_defaults(tmp_path)
    path.write_text(json.dumps({"do_sample": True, "temperature": "hot"}))
    with pytest.raises(chat.TemplateError, match="temperature='hot'; expected a number"):
        chat.sampling_defaults(tmp_path)


def test_write_generation_config_is_read_back(tmp_path):
    tok = byte_tokenizer()
    chat.write_generation_config(
        tmp_path, eos_ids=(258, 256), pad_id=259, temperature=0.7, top_p=0.9
    )
    assert chat.stop_ids(tok, checkpoint=tmp_path) == (258, 256)
    assert chat.resolve_sampling(tmp_path) == {"temperature": 0.7, "top_k": None, "top_p": 0.9}
    chat.write_generation_config(tmp_path, eos_ids=(2,))
    assert json.loads((tmp_path / "generation_config.json").read_text()) == {
        "eos_token_id": 2,
        "do_sample": False,
    }
    with pytest.raises(ValueError, match=r"eos_ids=\(\): expected one id"):
        chat.write_generation_config(tmp_path, eos_ids=())


def test_the_tunix_tokenizer_takes_the_checkpoints_stop_ids():
    tok = TunixTokenizer(byte_tokenizer(), eos_ids=(7, 258))
    assert (tok.eos_id(), tok.stop_ids) == (7, (7, 258))
    assert TunixTokenizer(byte_tokenizer()).stop_ids == (258,)
    with pytest.raises(ValueError, match="expected at least one stop id"):
        TunixTokenizer(byte_tokenizer(), eos_ids=())
