"""A conversation -> token ids and its assistant mask, from the template's own rendering.

The mask comes from the rendered text, in characters, then to tokens:

1. Spans. A template with ``{% generation %}`` blocks marks them itself
   (:meth:`~posttrain.chat.template.ChatTemplate.render_spans`). Without blocks, as TRL
   separates a completion from its prompt: for assistant message ``i``, the rendering of
   ``messages[:i]`` with the generation prompt must be a prefix of the rendering of
   ``messages[:i + 1]``, which must be a prefix of the whole conversation's rendering; the
   span is what the assistant message added after the generation prompt. A template that
   renders an earlier turn differently once later turns follow (Qwen3 drops old
   reasoning, harmony ends the last turn with ``<|return|>``) cannot be masked this way
   and is refused (:class:`MaskError`), never trained on every token.
2. Tokens. The text is encoded whole, without the tokenizer's special-token post-processor
   (``add_special_tokens=False``, as transformers' ``apply_chat_template``): the template
   renders BOS where its family wants it, so nothing adds a second one. A token is an
   assistant token when its character offsets overlap a span (transformers marks the
   tokens from the one holding a span's first character to the one holding its last).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from posttrain.chat.template import ChatTemplate, TemplateError

Messages = list[dict[str, str]]


class MaskError(TemplateError):
    """A template that cannot say which tokens are the assistant's."""


def unpadded(tokenizer):
    """``tokenizer``, or a copy without padding and truncation when it has either (rows
    are padded and cut by the callers; a padded batch would put pad ids inside texts)."""
    if tokenizer.padding is None and tokenizer.truncation is None:
        return tokenizer
    copy = type(tokenizer).from_str(tokenizer.to_str())
    copy.no_padding()
    copy.no_truncation()
    return copy


def assistant_spans(
    template: ChatTemplate, messages: Messages
) -> tuple[str, list[tuple[int, int]]]:
    """The rendering of ``messages`` and the ``[start, end)`` character spans its assistant
    turns train on (module docstring, step 1).

    Raises:
      MaskError: the template has generation blocks but marks nothing in a conversation
        with an assistant turn, or (without blocks) an assistant span prefix rendering
        cannot isolate; naming the message.
      TemplateError: the template refuses the conversation.
    """
    if template.has_generation_blocks:
        text, spans = template.render_spans(messages)
        if not spans and any(m["role"] == "assistant" for m in messages):
            raise MaskError(
                f"chat template {template.origin}: its generation blocks mark no text of this "
                "conversation's assistant turns"
            )
        return text, spans
    text = template.render(messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = template.render(messages[:i], add_generation_prompt=True)
        upto = template.render(messages[: i + 1])
        if not (upto.startswith(prompt) and text.startswith(upto)):
            raise MaskError(
                f"chat template {template.origin} cannot isolate assistant message {i}: it "
                "renders the conversation up to that turn differently from the start of the "
                "whole conversation; give it {% generation %} blocks (--chat-template FILE)"
            )
        if len(upto) > len(prompt):
            spans.append((len(prompt), len(upto)))
    return text, spans


def token_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """bool ``[tokens]``: the tokens whose character ``offsets`` (``[tokens]`` of
    ``(start, end)``) overlap one of ``spans``."""
    if not len(offsets):
        return np.zeros(0, bool)
    bounds = np.asarray(offsets, np.int64).reshape(-1, 2)  # [tokens, 2]
    mask = np.zeros(len(bounds), bool)
    for start, end in spans:
        mask |= (bounds[:, 0] < end) & (bounds[:, 1] > start)
    return mask


_ENCODE_CHUNK = 1024  # conversations per encode_batch call: bounds the live Encodings


def encode_conversations(
    conversations: Sequence[Messages], tokenizer, template: ChatTemplate
) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(ids int32 [tokens], assistant mask bool [tokens])`` of each conversation, one
    ``encode_batch`` call per 1024 conversations.

    Raises:
      MaskError, TemplateError: as :func:`assistant_spans`.
    """
    tokenizer = unpadded(tokenizer)
    out = []
    for first in range(0, len(conversations), _ENCODE_CHUNK):
        rendered = [
            assistant_spans(template, m) for m in conversations[first : first + _ENCODE_CHUNK]
        ]
        texts = [text for text, _ in rendered]
        encodings = tokenizer.encode_batch(texts, add_special_tokens=False) if texts else []
        for (_, spans), e in zip(rendered, encodings, strict=True):
            out.append((np.asarray(e.ids, np.int32), token_mask(e.offsets, spans)))
    return out


def prompt_text(messages: Messages, template: ChatTemplate) -> str:
    """``messages`` rendered with the generation prompt: what the model continues."""
    return template.render(messages, add_generation_prompt=True)


def encode_prompt(messages: Messages, tokenizer, template: ChatTemplate) -> list[int]:
    """The ids of :func:`prompt_text` (encoded without special tokens: BOS is the template's)."""
    return unpadded(tokenizer).encode(prompt_text(messages, template), add_special_tokens=False).ids


def split_completion(
    prompt: Messages, completion: Messages, tokenizer, template: ChatTemplate
) -> tuple[list[int], list[int]]:
    """``(prompt ids, completion ids)``: the prompt rendered with the generation prompt,
    and the tokens the whole conversation adds after it, up to the last assistant token
    (a template's trailing newline after the last turn is not part of the completion).

    Raises:
      MaskError: the whole conversation's ids do not start with the prompt's (the template
        renders the prompt differently once a completion follows, or a token merges across
        the boundary), or the completion holds no assistant token.
      TemplateError: the template refuses the conversation.
    """
    prompt_ids, (completion_ids,) = split_completions(
        [(prompt, [completion])], tokenizer, template
    )[0]
    return prompt_ids, completion_ids


def split_completions(
    items: Sequence[tuple[Messages, Sequence[Messages]]], tokenizer, template: ChatTemplate
) -> list[tuple[list[int], list[list[int]]]]:
    """:func:`split_completion` of each ``(prompt, [completion, ...])`` (e.g. a preference
    pair's chosen and rejected), the prompt encoded once; one ``encode_batch`` call for all.

    Raises:
      MaskError, TemplateError: as :func:`split_completion`.
    """
    tokenizer = unpadded(tokenizer)
    texts: list[str] = []
    spans: list[list[tuple[int, int]]] = []
    for prompt, completions in items:
        head = prompt_text(prompt, template)
        texts.append(head)
        spans.append([])
        for completion in completions:
            text, marked = assistant_spans(template, [*prompt, *completion])
            if not text.startswith(head):
                raise MaskError(_NOT_A_PREFIX.format(template.origin))
            texts.append(text)
            spans.append(marked)
    encodings = iter(
        zip(tokenizer.encode_batch(texts, add_special_tokens=False), spans, strict=True)
    )
    out = []
    for _, completions in items:
        prompt_ids = next(encodings)[0].ids
        parts = []
        for _ in completions:
            full, marked = next(encodings)
            if full.ids[: len(prompt_ids)] != prompt_ids:
                raise MaskError(_NOT_A_PREFIX.format(template.origin))
            mask = token_mask(full.offsets, marked)[len(prompt_ids) :]
            if not mask.any():
                raise MaskError(
                    f"chat template {template.origin}: the completion holds no assistant token"
                )
            end = len(prompt_ids) + int(np.flatnonzero(mask)[-1]) + 1
            parts.append(full.ids[len(prompt_ids) : end])
        out.append((prompt_ids, parts))
    return out


_NOT_A_PREFIX = (
    "chat template {}: the prompt with its generation prompt is not where the conversation "
    "with the completion starts, so the completion cannot be cut from it"
)


def check_conversation(
    template: ChatTemplate, messages: Messages, *, where: str, ends_with_assistant: bool = True
) -> None:
    """Checks one conversation in the template's terms; each error is one line starting
    with ``where`` (file and line) and naming the rule.

    Raises:
      ValueError: the conversation does not end in an assistant turn (when
        ``ends_with_assistant``: SFT trains up to the last turn); the template refuses it
        (its ``raise_exception``, e.g. roles that do not alternate); a system message the
        template leaves out of its rendering (a family without a system role); or the
        assistant mask cannot be computed (:func:`assistant_spans`).
    """
    if ends_with_assistant and messages[-1]["role"] != "assistant":
        raise ValueError(
            f"{where}: the conversation ends with a {messages[-1]['role']!r} message; "
            "expected it to end with an assistant turn (SFT trains up to the last one)"
        )
    try:
        text, _ = assistant_spans(template, messages)
    except TemplateError as e:
        raise ValueError(f"{where}: {e}") from None
    for i, m in enumerate(messages):
        if m["role"] == "system" and m["content"].strip() and m["content"].strip() not in text:
            raise ValueError(
                f"{where}: message {i} is a system message, but chat template "
                f"{template.origin} leaves it out of its rendering (the family has no "
                "system role)"
            )
