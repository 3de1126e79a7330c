"""Preference JSONL -> token ids and masks in the layout Tunix's ``DPOTrainer`` takes.

Input, one pair per line, in the two forms TRL's preference datasets use::

    {"prompt": "text", "chosen": "text", "rejected": "text"}
    {"prompt": [{"role": "system"|"user"|"assistant", "content": ...}, ...],
     "chosen": [{"role": "assistant", "content": ...}],
     "rejected": [{"role": "assistant", "content": ...}]}

A string prompt is one user turn; a string completion is one assistant turn. Template:
the model's own, as ``posttrain sft`` trains (:mod:`posttrain.chat`), or the built-in
ChatML by default. The prompt is the conversation so far rendered with the template's
generation prompt (ChatML: ``<|im_start|>assistant\n``); a completion is what rendering
the prompt with the completion's turns adds after it, up to its last assistant token
(ChatML: the content and ``<|im_end|>``; further assistant turns' headers are then part of
the completion and its mask, where SFT masks them). The completion must extend the
prompt's own tokens (:func:`posttrain.chat.split_completions`), so the masks cover exactly
the completion tokens.

BOS. With a template: the template's way (its rendering, encoded without special tokens,
holds the BOS its family wants, e.g. Llama 3's ``<|begin_of_text|>``, exactly once). Without
one (the default, as before templates were read): the prompt starts with the tokenizer's
own prefix (what its post-processor puts before a text; nothing for ChatML tokenizers such
as Qwen's and the embedded byte tokenizer) exactly once (google-tunix <= 0.1.5's DPO
tokenisation prepended the BOS to a text its tokenizer had already given one,
``shared/research/tunix-rl.md`` 7, bug 2). Text is text: a message whose content spells a
special token (``<|begin_of_text|>``) gets that token, as in ``posttrain sft``.

Arrays (``[pairs, length]``, int32), the names of Tunix's ``TrainingInput``:
``prompt_ids`` / ``prompt_mask`` left-padded to ``max_prompt_length``; ``chosen_ids`` /
``chosen_mask`` and ``rejected_ids`` / ``rejected_mask`` right-padded to
``max_response_length``. Longer prompts keep their end (the BOS prefix stays), longer
completions their start, or the pair is rejected (``overflow="reject"``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence

import numpy as np

from posttrain import chat
from posttrain.chat import ChatTemplate
from posttrain.training.data import (
    NOT_READ,
    Messages,
    _unpadded,
    check_messages,
    jsonl_records,
)

FIELDS = ("prompt", "chosen", "rejected")
ARRAYS = ("prompt_ids", "prompt_mask", "chosen_ids", "chosen_mask", "rejected_ids", "rejected_mask")


@dataclasses.dataclass(frozen=True)
class Pair:
    """One preference pair: the prompt's messages, each completion's assistant messages,
    and where it came from (``file, line N``) for error messages."""

    prompt: Messages
    chosen: Messages
    rejected: Messages
    where: str


def read_preference_jsonl(
    path: str | os.PathLike, flag: str = "--data", only: Callable[[int], bool] | None = None
) -> list[Pair | None]:
    """Reads and validates a preference JSONL file (blank lines are skipped); ``flag``
    names the option it came from in a missing-file error. ``only(i)`` False: pair ``i``
    is counted but not parsed or validated, and is None in the list (as
    :func:`posttrain.training.data.read_chat_jsonl`).

    Raises:
      ValueError: naming the file and line: not UTF-8, not JSON, a missing or mistyped
        field, a message without string ``role``/``content``, an unknown role, a
        completion turn that is not the assistant's, an empty (or blank) prompt or
        completion, chosen equal to rejected; or the file has no pairs.
    """
    pairs = [
        None if record is NOT_READ else validate_pair(record, where=where)
        for where, record in jsonl_records(path, "a preference JSONL file", flag, only)
    ]
    if not pairs:
        raise ValueError(f"{os.fspath(path)}: no preference pairs (empty dataset)")
    return pairs


def validate_pair(record, *, where: str) -> Pair:
    """One ``{"prompt", "chosen", "rejected"}`` record as a :class:`Pair`.

    Raises:
      ValueError: as :func:`read_preference_jsonl`, prefixed with ``where``.
    """
    if not isinstance(record, dict) or any(k not in record for k in FIELDS):
        got = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(
            f"{where}: expected an object with 'prompt', 'chosen' and 'rejected', got {got}"
        )
    prompt = _messages(record["prompt"], "user", where=f"{where}: prompt")
    chosen = _messages(record["chosen"], "assistant", where=f"{where}: chosen")
    rejected = _messages(record["rejected"], "assistant", where=f"{where}: rejected")
    for name, turns in (("chosen", chosen), ("rejected", rejected)):
        roles = {m["role"] for m in turns}
        if roles != {"assistant"}:
            raise ValueError(
                f"{where}: {name} has roles {sorted(roles)}; expected assistant turns only"
            )
    for name, turns in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
        if not any(m["content"].strip() for m in turns):
            raise ValueError(f"{where}: {name} is empty; expected some text")
    if chosen == rejected:
        raise ValueError(
            f"{where}: chosen and rejected are the same; expected two different completions "
            "(a pair that does not differ has no preference to learn)"
        )
    return Pair(prompt, chosen, rejected, where)


def _messages(value, role: str, *, where: str) -> Messages:
    """A string (one ``role`` turn) or a non-empty message list, checked."""
    if isinstance(value, str):
        value = [{"role": role, "content": value}]
    if not isinstance(value, list) or not value:
        raise ValueError(
            f"{where}: expected a string or a non-empty list of messages, got {str(value)[:60]!r}"
        )
    check_messages(value, where=where)
    return [{"role": m["role"], "content": m["content"]} for m in value]


def bos_prefix(tokenizer) -> list[int]:
    """The ids ``tokenizer``'s post-processor puts before every text (its BOS), found by
    encoding one character with and without special tokens; ``[]`` when it adds none."""
    tokenizer = _unpadded(tokenizer)
    bare = tokenizer.encode("a", add_special_tokens=False).ids
    full = tokenizer.encode("a", add_special_tokens=True).ids
    for start in range(len(full) - len(bare) + 1):
        if full[start : start + len(bare)] == bare:
            return full[:start]
    return []


def encode_prompt(
    messages: Messages, tokenizer, prefix: Sequence[int], template: ChatTemplate | None = None
) -> list[int]:
    """``prefix`` (the tokenizer's BOS when no template is given), then the prompt with the
    template's generation prompt (default: the built-in ChatML), encoded without special
    tokens, so nothing adds another BOS."""
    return [*prefix, *chat.encode_prompt(messages, tokenizer, template or chat.chatml())]


def encode_completion(
    turns: Messages, tokenizer, template: ChatTemplate | None = None, prompt: Messages = ()
) -> list[int]:
    """The ids of a completion's assistant ``turns`` after ``prompt`` (default: none) in
    ``template`` (default: the built-in ChatML), as :func:`encode_pairs` cuts them."""
    return chat.split_completion(list(prompt), turns, tokenizer, template or chat.chatml())[1]


_ENCODE_CHUNK = 1024  # pairs per encode_batch call, as posttrain.training.data's


def _encode_all(
    pairs: Sequence[Pair], tokenizer, template: ChatTemplate
) -> list[tuple[list[int], ...]]:
    """``(prompt, chosen, rejected)`` ids (prompt without the BOS prefix) of each pair,
    one ``encode_batch`` call per :data:`_ENCODE_CHUNK` pairs.

    Raises:
      ValueError: naming the pair's file and line: the template refuses it or cannot cut
        a completion from it.
    """
    encoded = []
    for first in range(0, len(pairs), _ENCODE_CHUNK):
        chunk = pairs[first : first + _ENCODE_CHUNK]
        items = [(pair.prompt, (pair.chosen, pair.rejected)) for pair in chunk]
        try:
            parts = chat.split_completions(items, tokenizer, template)
        except chat.TemplateError:  # find the pair, for its file and line
            for pair, item in zip(chunk, items, strict=True):
                try:
                    chat.split_completions([item], tokenizer, template)
                except chat.TemplateError as e:
                    raise ValueError(f"{pair.where}: {e}") from None
            raise
        encoded += [(prompt, *completions) for prompt, completions in parts]
    return encoded


def encode_pairs(
    pairs: Sequence[Pair],
    tokenizer,
    *,
    max_prompt_length: int,
    max_response_length: int,
    overflow: str = "truncate",
    pad_id: int = 0,
    template: ChatTemplate | None = None,
) -> dict[str, np.ndarray]:
    """The pairs as Tunix's tokenized ``TrainingInput`` arrays (see the module docstring),
    in ``template`` (default: the built-in ChatML, and the tokenizer's BOS prefix).

    Raises:
      ValueError: a length below its minimum (the prompt's BOS prefix + 1, the
        completion's 1), an unknown ``overflow``, or with ``overflow="reject"`` a prompt
        or completion longer than its maximum, naming the pair's file and line.
    """
    if overflow not in ("truncate", "reject"):
        raise ValueError(f"overflow={overflow!r}; expected 'truncate' or 'reject'")
    prefix = bos_prefix(tokenizer) if template is None else _template_bos(tokenizer, template)
    if max_prompt_length < len(prefix) + 1:
        raise ValueError(
            f"max_prompt_length={max_prompt_length} (--max-prompt-length): expected >= "
            f"{len(prefix) + 1} (the tokenizer's BOS prefix and one token)"
        )
    if max_response_length < 1:
        raise ValueError(
            f"max_response_length={max_response_length} (--max-response-length): expected >= 1"
        )
    n = len(pairs)
    out = {
        name: np.full(
            (n, max_prompt_length if name.startswith("prompt") else max_response_length),
            pad_id if name.endswith("_ids") else 0,
            np.int32,
        )
        for name in ARRAYS
    }
    for row, (pair, (prompt, *completions)) in enumerate(
        zip(pairs, _encode_all(pairs, tokenizer, template or chat.chatml()), strict=True)
    ):
        if template is None:
            prompt = [*prefix, *prompt]
        if len(prompt) > max_prompt_length:
            _overflow(overflow, pair, "prompt", len(prompt), "max_prompt_length", max_prompt_length)
            kept = prefix if prompt[: len(prefix)] == prefix else []
            keep = max_prompt_length - len(kept)
            prompt = [*kept, *prompt[len(prompt) - keep :]]
        out["prompt_ids"][row, max_prompt_length - len(prompt) :] = prompt
        out["prompt_mask"][row, max_prompt_length - len(prompt) :] = 1
        for name, ids in zip(("chosen", "rejected"), completions, strict=True):
            if len(ids) > max_response_length:
                _overflow(
                    overflow, pair, name, len(ids), "max_response_length", max_response_length
                )
                ids = ids[:max_response_length]
            out[f"{name}_ids"][row, : len(ids)] = ids
            out[f"{name}_mask"][row, : len(ids)] = 1
    return out


def _template_bos(tokenizer, template: ChatTemplate) -> list[int]:
    """The template's BOS id (``[]`` without one): kept when a long prompt is cut."""
    bos = template.bos_token
    bos_id = None if bos is None else tokenizer.token_to_id(bos)
    return [] if bos_id is None else [bos_id]


def _overflow(mode: str, pair: Pair, what: str, length: int, limit: str, value: int) -> None:
    if mode == "reject":
        raise ValueError(
            f"{pair.where}: {what} has {length} tokens, more than {limit}={value} "
            "(--overflow reject; use --overflow truncate to cut it)"
        )
