"""Small tokenizers and chat templates in each family's published format, for the format
tests (``tests/test_chat_families.py``).

Each :class:`Family` holds a byte-level BPE tokenizer trained (``tokenizers``' own
``BpeTrainer``, a few hundred merges) on the test conversations with the family's special
tokens, and a Jinja template written here from the family's published chat format (model
cards and ``transformers`` chat-template documentation), with ``{% generation %}`` blocks
around what an assistant turn trains on:

- Llama 3: ``<|begin_of_text|>`` (the template's; the tokenizer's post-processor adds one
  too, which ``add_special_tokens=False`` must leave out), ``<|start_header_id|>role
  <|end_header_id|>\\n\\n content <|eot_id|>``; generation config EOS: ``<|end_of_text|>``,
  ``<|eom_id|>``, ``<|eot_id|>``.
- Qwen3: ChatML with ``<think>...</think>`` reasoning kept only after the last user turn,
  ``enable_thinking=False`` giving an empty think block in the generation prompt.
- Gemma: BOS, ``<start_of_turn>user|model\\n ... <end_of_turn>\\n``, alternating roles,
  no system role (``raise_exception``).
- GPT-OSS harmony: ``<|start|>role<|channel|>final<|message|>...``, the last assistant turn
  ending ``<|return|>``, earlier ones ``<|end|>``, tool calls ``<|call|>``.
- Mixtral: ``<s>[INST] user [/INST]assistant</s>``, alternating user/assistant only.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

LLAMA3 = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- generation -%}{{- message['content'] | trim + '<|eot_id|>' -}}{%- endgeneration -%}"
    "{%- else -%}{{- message['content'] | trim + '<|eot_id|>' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)

QWEN3 = (
    "{%- set ns = namespace(last_query=-1) -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- set content = message['content'] -%}{%- set reasoning = '' -%}"
    "{%- if '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- generation -%}"
    "{%- if loop.index0 > ns.last_query and reasoning -%}"
    "{{- '<think>\\n' + reasoning + '\\n</think>\\n\\n' + content -}}"
    "{%- else -%}{{- content -}}{%- endif -%}"
    "{{- '<|im_end|>' -}}"
    "{%- endgeneration -%}"
    "{{- '\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}{%- endif -%}"
)

GEMMA = (
    "{{- bos_token -}}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{{- raise_exception('System role not supported') -}}{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') -}}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{- '<start_of_turn>' + role + '\\n' -}}"
    "{%- if role == 'model' -%}"
    "{%- generation -%}{{- message['content'] | trim + '<end_of_turn>' -}}{%- endgeneration -%}"
    "{{- '\\n' -}}"
    "{%- else -%}{{- message['content'] | trim + '<end_of_turn>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
)

GPT_OSS = (
    "{{- '<|start|>system<|message|>Reasoning: medium\\n\\n# Valid channels: analysis, "
    "commentary, final.<|end|>' -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{{- '<|start|>developer<|message|># Instructions\\n\\n' + message['content'] + '<|end|>' -}}"
    "{%- elif message['role'] == 'user' -%}"
    "{{- '<|start|>user<|message|>' + message['content'] + '<|end|>' -}}"
    "{%- elif message['role'] == 'tool' -%}"
    "{{- '<|start|>functions.' + message['name'] + ' to=assistant<|channel|>commentary"
    "<|message|>' + message['content'] + '<|end|>' -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '<|start|>assistant' -}}"
    "{%- generation -%}"
    "{%- if message.get('thinking') and loop.last -%}"
    "{{- '<|channel|>analysis<|message|>' + message['thinking'] + '<|end|><|start|>assistant' -}}"
    "{%- endif -%}"
    "{%- if message.get('tool_calls') -%}"
    "{%- set call = message['tool_calls'][0]['function'] -%}"
    "{{- '<|channel|>commentary to=functions.' + call['name'] + ' <|constrain|>json<|message|>'"
    " + (call['arguments'] | tojson) + '<|call|>' -}}"
    "{%- else -%}"
    "{{- '<|channel|>final<|message|>' + message['content'] -}}"
    "{{- '<|return|>' if loop.last else '<|end|>' -}}"
    "{%- endif -%}"
    "{%- endgeneration -%}"
    "{%- else -%}{{- raise_exception('Unknown role ' + message['role']) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start|>assistant' -}}{%- endif -%}"
)

MIXTRAL = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') -}}"
    "{%- endif -%}"
    "{%- if message['role'] == 'user' -%}"
    "{{- '[INST] ' + message['content'] + ' [/INST]' -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{%- generation -%}{{- message['content'] + eos_token -}}{%- endgeneration -%}"
    "{%- else -%}{{- raise_exception('Only user and assistant roles are supported!') -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)


@dataclasses.dataclass(frozen=True)
class Family:
    """One family's format: its special tokens (ids 0.. in this order), the template,
    the tokenizer_config.json special tokens, the generation config's EOS tokens, and
    its test conversations (alternating user/assistant, ending with the assistant)."""

    name: str
    specials: tuple[str, ...]
    template: str
    tokens: dict[str, str]
    generation_eos: tuple[str, ...]
    config_eos: str
    conversations: tuple[list[dict], ...]
    post_bos: str | None = None  # the tokenizer's post-processor adds this before a text
    added: tuple[str, ...] = ()  # non-special added tokens (Qwen3's think tags)


def _chat(*turns, system=None):
    roles = ("user", "assistant")
    messages = [{"role": "system", "content": system}] if system else []
    return messages + [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]


BASIC = (
    _chat("What is 2+3?", "2+3 is 5."),
    _chat("Name a colour.", "Blue, the colour of the sky.", "And another?", "Green, like grass!"),
    _chat("Say héllo in French ✓", "Bonjour — ça va?"),
)

FAMILIES = {
    "llama3": Family(
        "llama3",
        (
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|eom_id|>",
            "<|finetune_right_pad_id|>",
            "<|python_tag|>",
        ),
        LLAMA3,
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
        "<|end_of_text|>",
        (*BASIC, _chat("Hi", "  Hello there.  ", system="You are terse.")),
        post_bos="<|begin_of_text|>",
    ),
    "qwen3": Family(
        "qwen3",
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        QWEN3,
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        ("<|im_end|>", "<|endoftext|>"),
        "<|endoftext|>",
        (
            *BASIC,
            _chat("What is 7*6?", "<think>\nSeven sixes.\n</think>\n\n42.", system="Be exact."),
            _chat(
                "Hi",
                "<think>\ngreet\n</think>\n\nHello!",
                "Bye",
                "<think>\nleave\n</think>\n\nBye!",
            ),
        ),
        added=("<think>", "</think>"),
    ),
    "gemma": Family(
        "gemma",
        ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"),
        GEMMA,
        {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"},
        ("<eos>", "<end_of_turn>"),
        "<eos>",
        BASIC,
    ),
    "gpt_oss": Family(
        "gpt_oss",
        (
            "<|endoftext|>",
            "<|start|>",
            "<|message|>",
            "<|end|>",
            "<|return|>",
            "<|call|>",
            "<|channel|>",
            "<|constrain|>",
        ),
        GPT_OSS,
        {"eos_token": "<|return|>", "pad_token": "<|endoftext|>"},
        ("<|return|>", "<|endoftext|>", "<|call|>"),
        "<|return|>",
        (
            *BASIC,
            _chat("Sum 2 and 2", "It is 4.", system="Answer briefly."),
            [
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {"function": {"name": "weather", "arguments": {"city": "Paris"}}}
                    ],
                },
                {"role": "tool", "name": "weather", "content": "sunny"},
                {"role": "assistant", "content": "Sunny.", "thinking": "The tool said sunny."},
            ],
        ),
    ),
    "mixtral": Family(
        "mixtral",
        ("<unk>", "<s>", "</s>"),
        MIXTRAL,
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
        ("</s>",),
        "</s>",
        BASIC,
    ),
}
NAMES = tuple(FAMILIES)


def corpus(family: Family) -> list[str]:
    """Text the tokenizer's merges are learnt from: the conversations' contents."""
    return [m["content"] for c in family.conversations for m in c] * 3


def build_tokenizer(family: Family, vocab_size: int = 400) -> Tokenizer:
    """A byte-level BPE with the family's special tokens first (ids 0..), merges learnt
    from :func:`corpus`, and (Llama 3) a post-processor that adds BOS."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(family.specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(family), trainer)
    if family.added:
        tok.add_tokens(list(family.added))
    if family.post_bos:
        bos = family.post_bos
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A",
            pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tok.token_to_id(bos))],
        )
    return tok


def write_checkpoint(
    family: Family, directory: pathlib.Path, template: str | None = None
) -> pathlib.Path:
    """A checkpoint directory's format files: tokenizer.json, tokenizer_config.json (with
    the chat template), generation_config.json (a list of EOS ids where the family has
    several) and config.json (one EOS id)."""
    directory.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(family)
    tok.save(str(directory / "tokenizer.json"))
    config = {**family.tokens, "chat_template": template or family.template}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    eos = [tok.token_to_id(t) for t in family.generation_eos]
    (directory / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos if len(eos) > 1 else eos[0]})
    )
    (directory / "config.json").write_text(
        json.dumps({"eos_token_id": tok.token_to_id(family.config_eos)})
    )
    return directory


def hf_tokenizer(family: Family, tok: Tokenizer, template: str | None = None):
    """The same tokenizer and template as a transformers fast tokenizer (imports
    transformers: reference tests only)."""
    import transformers

    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tok.to_str()),
        chat_template=template or family.template,
        **family.tokens,
    )


def write_tiny_model(family: Family, directory: pathlib.Path, hf_family: str) -> pathlib.Path:
    """A tiny random transformers checkpoint of ``hf_family`` (:mod:`tests.hf_tiny`) in
    ``family``'s format: its tokenizer, template, generation config (imports torch)."""
    from tests import hf_tiny

    tok = build_tokenizer(family)
    hf_tiny.save(hf_tiny.build(hf_family, vocab_size=tok.get_vocab_size()), directory)
    config = json.loads((directory / "config.json").read_text())
    write_checkpoint(family, directory)  # the format files (config.json: its EOS only)
    config["eos_token_id"] = tok.token_to_id(family.config_eos)
    config["bos_token_id"] = tok.token_to_id(family.tokens.get("bos_token", ""))  # id 0 too
    # the family's pad token, or none (Llama 3 has none): hf_tiny's id 0 is another token here
    config["pad_token_id"] = tok.token_to_id(family.tokens.get("pad_token", ""))
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def write_random_checkpoint(
    family: Family, directory: pathlib.Path, preset: str = "llama3-tiny", seed: int = 0
) -> pathlib.Path:
    """A tiny random HF checkpoint of our ``preset`` (random tensors named by the
    conversion table, ``to_hf_config``; no torch) in ``family``'s format: its tokenizer,
    template, generation config and ``config.json`` EOS."""
    from posttrain.conversion import to_hf_config
    from posttrain.models import get_config
    from tests import checkpoints

    tok = build_tokenizer(family)
    cfg = get_config(preset).replace(vocab_size=tok.get_vocab_size())
    tensors = checkpoints.hf_checkpoint(cfg, "hub", seed)
    checkpoints.write_hf_dir(directory, tensors, to_hf_config(cfg))
    config = json.loads((directory / "config.json").read_text())
    write_checkpoint(family, directory)
    config["eos_token_id"] = tok.token_to_id(family.config_eos)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


if __name__ == "__main__":
    # python -m tests.chat_formats DIR [CHAT.jsonl]: a tiny Llama-3-format model, and the
    # embedded addition task's conversations (docs/formats.md's demo)
    import sys

    if len(sys.argv) not in (2, 3):
        sys.exit("usage: python -m tests.chat_formats DIR [CHAT.jsonl]")
    print(write_tiny_model(FAMILIES["llama3"], pathlib.Path(sys.argv[1]), "llama3"))
    if len(sys.argv) == 3:
        from posttrain.rl import arithmetic

        arithmetic.write_warmup_jsonl(arithmetic.problems(), sys.argv[2], repeats=4)
        print(sys.argv[2])
