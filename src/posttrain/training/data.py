"""Chat JSONL -> token ids + loss mask -> padded or packed rows -> sharded-ready batches.

Input format, one conversation per line::

    {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}

Template: the model's own (:mod:`posttrain.chat`: ``chat_template.jinja`` or
``tokenizer_config.json``'s ``chat_template``), or the built-in ChatML (Qwen's chat
template, without tools) for a tokenizer without one, the default::

    <|im_start|>{role}\n{content}<|im_end|>\n

Loss mask: the template's assistant spans (its ``{% generation %}`` blocks, else found by
rendering prefixes): for ChatML the content of assistant turns and their ``<|im_end|>``;
role headers, system and user turns are not targets. The rendering is encoded whole,
without the tokenizer's special tokens (the template renders its family's BOS), and the
mask follows the tokens' character offsets.

Rows are ``max_target_length`` long. ``packing=True`` fills each row greedily
with whole conversations in order (segment ids 1.., positions restart per
segment); otherwise one conversation per row, right-padded (segment 0).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np

from posttrain import chat
from posttrain.chat import ChatTemplate

ROLES = ("system", "user", "assistant")
Messages = list[dict[str, str]]


@dataclasses.dataclass(frozen=True)
class Example:
    """One tokenised conversation: ``tokens`` int32 ``[len]``, ``loss_mask`` bool ``[len]``."""

    tokens: np.ndarray
    loss_mask: np.ndarray


def read_chat_jsonl(
    path: str | os.PathLike,
    only: Callable[[int], bool] | None = None,
    *,
    template: ChatTemplate | None = None,
) -> list[Messages | None]:
    """Reads and validates a chat JSONL file (blank lines are skipped).

    ``only(i)`` False: conversation ``i`` is counted but not parsed or validated, and
    is None in the list (a process reads only its data shards; the process whose
    shard holds a bad line reports it). ``template``: each conversation is also checked
    in its terms (:func:`posttrain.chat.check_conversation`).

    Raises:
      ValueError: naming the file and line: not JSON, no ``messages`` list, a
        message without string ``role``/``content``, an unknown role, a
        conversation without an assistant turn or not ending in one; with
        ``template``: a conversation it refuses (its ``raise_exception``), a system
        message it leaves out, an assistant turn it cannot mask; or the file has no
        conversations.
    """
    conversations = []
    for where, record in jsonl_records(path, "a chat JSONL file", only=only):
        if record is NOT_READ:
            conversations.append(None)
            continue
        messages = validate_messages(record, where=where)
        if template is not None:
            chat.check_conversation(template, messages, where=where)
        conversations.append(messages)
    if not conversations:
        raise ValueError(f"{os.fspath(path)}: no conversations (empty dataset)")
    return conversations


NOT_READ = object()
"""The record :func:`jsonl_records` yields for a line its ``only`` leaves unparsed."""


def jsonl_records(
    path: str | os.PathLike,
    expected: str,
    flag: str = "--data",
    only: Callable[[int], bool] | None = None,
) -> Iterator[tuple[str, object]]:
    """``(where, record)`` for each non-blank line of a JSONL file, ``where`` being
    ``"<path>, line <n>"`` for the caller's own messages. ``only(i)`` False: the
    ``i``-th record (counting non-blank lines from 0) is :data:`NOT_READ` instead,
    decoded but not parsed.

    Raises:
      ValueError: ``path`` is not a file (naming ``flag`` and ``expected``, e.g. "a chat
        JSONL file"), or a line is not UTF-8 or (one ``only`` keeps) not JSON, naming
        the file and line.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        what = "is a directory" if os.path.isdir(path) else "does not exist"
        raise ValueError(f"{flag} {path!r} {what}; expected {expected}")
    index = -1
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}, line {lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not UTF-8 ({e.reason} at byte {e.start})") from None
            if not line.strip():
                continue
            index += 1
            if only is not None and not only(index):
                yield where, NOT_READ
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
            except RecursionError:
                raise ValueError(f"{where}: not valid JSON (nested too deeply)") from None
            yield where, record


def validate_messages(record, *, where: str) -> Messages:
    """Checks one ``{"messages": [...]}`` record; returns its messages.

    Raises:
      ValueError: as :func:`read_chat_jsonl`, prefixed with ``where``.
    """
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise ValueError(
            f'{where}: expected {{"messages": [{{"role", "content"}}, ...]}}, '
            f"got {str(record)[:80]!r}"
        )
    check_messages(messages, where=where)
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: no assistant message, so nothing to train on")
    if messages[-1]["role"] != "assistant":
        raise ValueError(
            f"{where}: the conversation ends with a {messages[-1]['role']!r} message; "
            "expected it to end with an assistant turn (SFT trains up to the last one)"
        )
    return messages


def check_messages(messages: list, *, where: str) -> None:
    """Checks each message of a list: a dict with string ``role`` and ``content``, valid
    Unicode, a role in :data:`ROLES` (the chat and the preference readers share it).

    Raises:
      ValueError: naming ``where`` and the message's index.
    """
    for i, m in enumerate(messages):
        if not (
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
        ):
            raise ValueError(f"{where}: message {i} needs string 'role' and 'content', got {m!r}")
        try:
            m["content"].encode("utf-8")
        except UnicodeEncodeError as e:  # valid JSON ("\ud800"), not text a tokenizer takes
            raise ValueError(
                f"{where}: message {i} content is not valid Unicode ({e.reason} at {e.start})"
            ) from None
        if m["role"] not in ROLES:
            raise ValueError(
                f"{where}: message {i} has unknown role {m['role']!r}; "
                f"expected one of {', '.join(ROLES)}"
            )


def encode_chat(messages: Messages, tokenizer, template: ChatTemplate | None = None) -> Example:
    """Token ids and the assistant loss mask of one conversation in ``template`` (default:
    the built-in ChatML)."""
    return encode_chats([messages], tokenizer, template)[0]


def chat_prompt(messages: Messages, tokenizer, template: ChatTemplate | None = None) -> list[int]:
    """Token ids of ``messages`` rendered by ``template`` (default: the built-in ChatML)
    with its generation prompt (ChatML: ``<|im_start|>assistant\n``): what a model trained
    by :func:`encode_chat` continues. Encoded as in training, without special tokens."""
    return chat.encode_prompt(messages, tokenizer, template or chat.chatml())


def encode_chats(
    conversations: Sequence[Messages], tokenizer, template: ChatTemplate | None = None
) -> list[Example]:
    """:func:`encode_chat` of each conversation (:func:`posttrain.chat.encode_conversations`:
    one ``encode_batch`` call per 1024 conversations; padding and truncation set in a
    ``tokenizer.json`` are ignored, rows are padded and cut by :func:`encode_dataset` /
    :func:`to_rows`).

    Raises:
      posttrain.chat.TemplateError: the template refuses a conversation or cannot mask it.
    """
    encoded = chat.encode_conversations(conversations, tokenizer, template or chat.chatml())
    return [Example(ids, mask) for ids, mask in encoded]


_unpadded = chat.unpadded


def encode_dataset(
    conversations: Sequence[Messages],
    tokenizer,
    max_target_length: int,
    *,
    overflow: str = "truncate",
    numbers: Sequence[int] | None = None,
    template: ChatTemplate | None = None,
) -> list[Example]:
    """Encodes conversations in ``template`` (default: the built-in ChatML); longer than
    ``max_target_length`` is truncated or rejected.

    Conversations left without a target token after truncation are dropped. ``numbers``:
    each conversation's index in the file, for the errors (default: its position).

    Raises:
      ValueError: ``overflow="reject"`` and a conversation is too long (naming
        its index and length), an unknown ``overflow``, or no examples remain.
    """
    if overflow not in ("truncate", "reject"):
        raise ValueError(f"overflow={overflow!r}; expected 'truncate' or 'reject'")
    if max_target_length < 2:
        raise ValueError(f"max_target_length={max_target_length}; expected >= 2")
    vocab = tokenizer.get_vocab_size()
    examples = []
    for position, ex in enumerate(encode_chats(conversations, tokenizer, template)):
        i = position if numbers is None else numbers[position]
        if len(ex.tokens) > max_target_length:
            if overflow == "reject":
                raise ValueError(
                    f"conversation {i} has {len(ex.tokens)} tokens, more than "
                    f"max_target_length={max_target_length} (overflow='reject')"
                )
            ex = Example(ex.tokens[:max_target_length], ex.loss_mask[:max_target_length])
        if len(ex.tokens) and ex.tokens.max() >= vocab:
            raise ValueError(f"conversation {i}: token id {ex.tokens.max()} >= vocab {vocab}")
        if ex.loss_mask[1:].any():
            examples.append(ex)
    if not examples:
        raise ValueError(
            "no conversation has a target token within max_target_length "
            f"{max_target_length} (empty dataset)"
        )
    return examples


def to_rows(
    examples: Iterable[Example], max_target_length: int, *, packing: bool, pad_id: int = 0
) -> dict[str, np.ndarray]:
    """Rows ``[rows, max_target_length]``: input_tokens, input_mask, positions, segment_ids."""
    rows: list[list[Example]] = []
    used = max_target_length  # forces a new row first
    for ex in examples:
        n = len(ex.tokens)
        if not packing or used + n > max_target_length:
            rows.append([])
            used = 0
        rows[-1].append(ex)
        used += n
    out = {
        "input_tokens": np.full((len(rows), max_target_length), pad_id, np.int32),
        "input_mask": np.zeros((len(rows), max_target_length), np.int32),
        "positions": np.zeros((len(rows), max_target_length), np.int32),
        "segment_ids": np.zeros((len(rows), max_target_length), np.int32),
    }
    for r, row in enumerate(rows):
        start = 0
        for seg, ex in enumerate(row, 1):
            n = len(ex.tokens)
            out["input_tokens"][r, start : start + n] = ex.tokens
            out["input_mask"][r, start : start + n] = ex.loss_mask
            out["positions"][r, start : start + n] = np.arange(n)
            out["segment_ids"][r, start : start + n] = seg
            start += n
    return out


def count_targets(rows: dict[str, np.ndarray]) -> np.ndarray:
    """Target tokens per row (``posttrain.training.loss.target_mask`` in NumPy)."""
    seg = rows["segment_ids"]
    same = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
    return (rows["input_mask"][:, 1:].astype(bool) & same).sum(axis=1)


def batches(
    rows: dict[str, np.ndarray],
    global_batch: int,
    grad_accum_steps: int = 1,
    *,
    seed: int = 0,
    epochs: int | None = None,
) -> Iterator[dict[str, np.ndarray]]:
    """Micro-batches ``[global_batch, ...]`` of ``rows`` (any dict of ``[rows, ...]``
    arrays), rows reshuffled each epoch (seeded).

    The stream of rows is the concatenation of shuffled epochs, cut into
    optimizer steps of ``grad_accum_steps`` micro-batches; SFT rows (with
    ``segment_ids``) also carry ``step_target_tokens`` ``[global_batch]`` (the step's
    target count).
    ``epochs=None`` repeats forever (the trainer stops at ``max_steps``).
    Deterministic for a given seed, so a resumed run sees the same batches.
    """
    if global_batch < 1 or grad_accum_steps < 1:
        raise ValueError(
            f"global_batch={global_batch}, grad_accum_steps={grad_accum_steps}; expected >= 1"
        )
    n = len(next(iter(rows.values())))
    targets = count_targets(rows) if "segment_ids" in rows else None
    rng = np.random.default_rng(seed)

    def row_stream():
        epoch = 0
        while epochs is None or epoch < epochs:
            yield from rng.permutation(n)
            epoch += 1

    stream = row_stream()
    per_step = global_batch * grad_accum_steps
    while True:
        idx = np.fromiter((i for _, i in zip(range(per_step), stream, strict=False)), np.int64)
        if len(idx) < per_step:
            return
        for micro in idx.reshape(grad_accum_steps, global_batch):
            batch = {k: v[micro] for k, v in rows.items()}
            if targets is not None:
                step_targets = np.int32(targets[idx].sum())
                batch["step_target_tokens"] = np.full((global_batch,), step_targets, np.int32)
            yield batch


def shard_seed(seed: int, shard: int) -> int:
    """The shuffling seed of data shard ``shard`` (shard 0 keeps ``seed``: one shard is
    the unsharded order)."""
    return seed + 7919 * shard


def sharded_batches(
    shard_rows: dict[int, dict[str, np.ndarray]],
    shards: int,
    global_batch: int,
    grad_accum_steps: int = 1,
    *,
    seed: int = 0,
    step_total: Callable[[dict[int, int]], int] | None = None,
) -> Iterator[dict[str, np.ndarray]]:
    """This process's part of each micro-batch when the data is split into ``shards``.

    The dataset is split into ``shards`` interleaved shards (conversation i in shard
    ``i % shards``), each packed and shuffled on its own (:func:`batches`, seeded by
    :func:`shard_seed`); a global micro-batch is ``global_batch / shards`` rows of each
    shard, in shard order. ``shard_rows`` holds the rows of the shards this process reads
    (contiguous ids); it yields their part, ``[len(shard_rows) x global_batch / shards,
    ...]``. SFT rows carry ``step_target_tokens``: the step's target count over every
    shard, ``step_total({shard: its count})`` (across processes a collective, called
    once per micro-batch in every process; default: the sum of the given shards).
    The same ``shards`` gives the same global batches whatever the number of processes.

    Raises:
      ValueError: ``global_batch`` not a multiple of ``shards``; no shard given.
    """
    if shards < 1 or global_batch % shards:
        raise ValueError(f"global batch {global_batch} does not divide into {shards} data shards")
    if not shard_rows:
        raise ValueError("no data shard to read")
    per = global_batch // shards
    ids = sorted(shard_rows)
    streams = [batches(shard_rows[s], per, grad_accum_steps, seed=shard_seed(seed, s)) for s in ids]
    total = step_total or (lambda counts: sum(counts.values()))
    while True:
        parts = [next(stream, None) for stream in streams]
        if any(p is None for p in parts):
            return
        local = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        if "step_target_tokens" in local:
            counts = {s: int(p["step_target_tokens"][0]) for s, p in zip(ids, parts, strict=True)}
            local["step_target_tokens"] = np.full(
                (len(local["step_target_tokens"]),), total(counts), np.int32
            )
        yield local
