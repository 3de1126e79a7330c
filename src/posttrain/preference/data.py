"""Preference JSONL -> token ids and masks in the layout Tunix's ``DPOTrainer`` takes.

Input, one pair per line, in the two forms TRL's preference datasets use::

    {"prompt": "text", "chosen": "text", "rejected": "text"}
    {"prompt": [{"role": "system"|"user"|"assistant", "content": ...}, ...],
     "chosen": [{"role": "assistant", "content": ...}],
     "rejected": [{"role": "assistant", "content": ...}]}

A string prompt is one user turn; a string completion is one assistant turn. Template:
ChatML, as ``posttrain sft`` trains (:mod:`posttrain.sft.data`): the prompt is the
conversation so far followed by ``<|im_start|>assistant\\n``; a completion is the
assistant's content and its ``<|im_end|>`` (further assistant turns joined with
``\\n<|im_start|>assistant\\n``, whose tokens then count in the completion, where SFT
masks the header). Every piece is encoded on its own, without special tokens, so the
masks cover exactly the completion tokens.

BOS: the prompt starts with the tokenizer's own prefix (what its post-processor puts
before a text, e.g. Llama 3's ``<|begin_of_text|>``; nothing for ChatML tokenizers such
as Qwen's and the embedded byte tokenizer) exactly once: the template's pieces are
encoded without special tokens, so nothing adds a second one (google-tunix <= 0.1.5's
DPO tokenisation prepended the BOS to a text its tokenizer had already given one,
``shared/research/tunix-rl.md`` 7, bug 2). Text is text: a message whose content
spells a special token (``<|begin_of_text|>``) gets that token, as in ``posttrain sft``.

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

from posttrain.sft.data import (
    NOT_READ,
    Messages,
    _unpadded,
    chat_prompt,
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
    :func:`posttrain.sft.data.read_chat_jsonl`).

    Raises:
      ValueError: naming the file and line: not UTF-8, not JSON, a missing or mistyped
        field, a message without string ``role``/``content``, an unknown role, a
        completion turn that is not the assistant's; or the file has no pairs.
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


def _prompt_pieces(messages: Messages) -> list[str]:
    """ChatML pieces of the conversation so far and the assistant's header."""
    pieces = [
        p
        for m in messages
        for p in (f"<|im_start|>{m['role']}\n", m["content"], "<|im_end|>", "\n")
    ]
    return [*pieces, "<|im_start|>assistant\n"]


def _completion_pieces(turns: Messages) -> list[str]:
    """The assistant turns: content and ``<|im_end|>``, turns joined by
    ``\n<|im_start|>assistant\n``. A single-turn completion is exactly what ``posttrain
    sft`` trains on (content and ``<|im_end|>``); in a multi-turn one the join's tokens
    are part of the completion (and its mask), where SFT leaves the header out."""
    pieces: list[str] = []
    for i, m in enumerate(turns):
        if i:
            pieces += ["\n", "<|im_start|>assistant\n"]
        pieces += [m["content"], "<|im_end|>"]
    return pieces


def encode_prompt(messages: Messages, tokenizer, prefix: Sequence[int]) -> list[int]:
    """``prefix`` (the BOS), then the ChatML prompt with the assistant's header; the
    template's pieces are encoded without special tokens, so nothing adds another BOS."""
    return [*prefix, *chat_prompt(messages, tokenizer)]


def encode_completion(turns: Messages, tokenizer) -> list[int]:
    """The ids of :func:`_completion_pieces`."""
    encodings = _unpadded(tokenizer).encode_batch(
        _completion_pieces(turns), add_special_tokens=False
    )
    return [i for e in encodings for i in e.ids]


_ENCODE_CHUNK = 1024  # pairs per encode_batch call, as posttrain.sft.data's


def _encode_all(pairs: Sequence[Pair], tokenizer) -> list[tuple[list[int], ...]]:
    """``(prompt, chosen, rejected)`` ids (prompt without the BOS prefix) of each pair,
    one ``encode_batch`` call per :data:`_ENCODE_CHUNK` pairs."""
    tokenizer = _unpadded(tokenizer)
    encoded = []
    for first in range(0, len(pairs), _ENCODE_CHUNK):
        chunk = pairs[first : first + _ENCODE_CHUNK]
        pieces: list[str] = []
        counts: list[int] = []
        for pair in chunk:
            for part in (
                _prompt_pieces(pair.prompt),
                _completion_pieces(pair.chosen),
                _completion_pieces(pair.rejected),
            ):
                pieces += part
                counts.append(len(part))
        encodings = tokenizer.encode_batch(pieces, add_special_tokens=False)
        start = 0
        parts = []
        for count in counts:
            parts.append([i for e in encodings[start : start + count] for i in e.ids])
            start += count
        encoded += [tuple(parts[i : i + 3]) for i in range(0, len(parts), 3)]
    return encoded


def encode_pairs(
    pairs: Sequence[Pair],
    tokenizer,
    *,
    max_prompt_length: int,
    max_response_length: int,
    overflow: str = "truncate",
    pad_id: int = 0,
) -> dict[str, np.ndarray]:
    """The pairs as Tunix's tokenized ``TrainingInput`` arrays (see the module docstring).

    Raises:
      ValueError: a length below its minimum (the prompt's BOS prefix + 1, the
        completion's 1), an unknown ``overflow``, or with ``overflow="reject"`` a prompt
        or completion longer than its maximum, naming the pair's file and line.
    """
    if overflow not in ("truncate", "reject"):
        raise ValueError(f"overflow={overflow!r}; expected 'truncate' or 'reject'")
    prefix = bos_prefix(tokenizer)
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
        zip(pairs, _encode_all(pairs, tokenizer), strict=True)
    ):
        prompt = [*prefix, *prompt]
        if len(prompt) > max_prompt_length:
            _overflow(overflow, pair, "prompt", len(prompt), "max_prompt_length", max_prompt_length)
            keep = max_prompt_length - len(prefix)
            prompt = [*prefix, *prompt[len(prompt) - keep :]]
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


def _overflow(mode: str, pair: Pair, what: str, length: int, limit: str, value: int) -> None:
    if mode == "reject":
        raise ValueError(
            f"{pair.where}: {what} has {length} tokens, more than {limit}={value} "
            "(--overflow reject; use --overflow truncate to cut it)"
        )
