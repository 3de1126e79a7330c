"""Tokenizers for SFT: an HF ``tokenizers`` JSON file, or the embedded byte tokenizer.

The embedded default is built in code with the ``tokenizers`` library (nothing
downloaded, nothing shipped as a binary): a byte-level BPE with no merges, i.e.
one token per UTF-8 byte (ids 0-255, GPT-2's byte-to-unicode alphabet) plus
:data:`SPECIAL_TOKENS` (ids 256-263). Its 264 ids match the ``vocab_size`` of the
``<family>-tiny`` presets.
"""

from __future__ import annotations

import functools
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

#: Special tokens of the embedded tokenizer, ids 256.. in this order. The chat
#: markers are ChatML's (Qwen's chat template), so a user tokenizer that has
#: them (Qwen2/3) gets the same template with single-token markers.
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|pad|>",
    "<|reserved_0|>",
    "<|reserved_1|>",
    "<|reserved_2|>",
    "<|reserved_3|>",
)


def byte_tokenizer() -> Tokenizer:
    """The embedded tokenizer: 256 byte tokens + 8 special tokens (vocab 264)."""
    symbol_byte = _byte_of_symbol()
    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 byte symbols
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=symbol_byte.__getitem__))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


@functools.cache
def _byte_of_symbol() -> dict[str, int]:
    """GPT-2's byte-to-unicode map, inverted: symbol -> byte (so byte b gets id b).

    Source: ``bytes_to_unicode`` in openai/gpt-2 ``src/encoder.py`` (printable bytes map
    to themselves, the others to ``chr(256 + n)`` in byte order).
    """
    printable = {
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    }
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def load_tokenizer(path: str | os.PathLike | None) -> Tokenizer:
    """``path`` (a ``tokenizer.json``, or a directory holding one), or the byte tokenizer.

    Raises:
      ValueError: the file does not exist or is not a ``tokenizers`` JSON file.
    """
    if path is None:
        return byte_tokenizer()
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise ValueError(f"tokenizer {path!r} does not exist; expected a tokenizer.json file")
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises its own Exception type
        raise ValueError(f"tokenizer {path!r} is not a tokenizers JSON file: {e}") from None


#: Above this share of unknown-token ids the data is mostly invisible to the model.
MAX_UNKNOWN_RATE = 0.05


def unknown_token_id(tokenizer: Tokenizer) -> int | None:
    """The id of the tokenizer model's unknown token (BPE, WordPiece, WordLevel
    ``unk_token``; Unigram ``unk_id``), or None when it has none."""
    model = tokenizer.model
    unk_id = getattr(model, "unk_id", None)  # tokenizers' Unigram
    if isinstance(unk_id, int):
        return unk_id
    unk_token = getattr(model, "unk_token", None)
    return tokenizer.token_to_id(unk_token) if unk_token else None


def check_coverage(token_ids, tokenizer: Tokenizer, source: str) -> None:
    """Refuses data that the tokenizer mostly maps to its unknown token.

    Args:
      token_ids: every token id of the encoded data (any iterable of int arrays).
      source: the tokenizer's name in the message.

    Raises:
      ValueError: more than :data:`MAX_UNKNOWN_RATE` of the ids are the unknown token.
    """
    unk = unknown_token_id(tokenizer)
    if unk is None:
        return
    total = unknown = 0
    for ids in token_ids:
        total += len(ids)
        unknown += int((ids == unk).sum())
    if total and unknown / total > MAX_UNKNOWN_RATE:
        raise ValueError(
            f"tokenizer {source}: {unknown / total:.0%} of the data's {total} tokens are its "
            f"unknown token (id {unk}); expected at most {MAX_UNKNOWN_RATE:.0%}: "
            "a tokenizer that covers the text"
        )
