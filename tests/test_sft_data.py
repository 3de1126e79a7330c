"""Chat JSONL -> tokens + loss mask -> rows -> batches; the embedded tokenizer and dataset."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from posttrain import tokenizer
from posttrain.training import data, default_data
from tests.strategies import chat_messages

pytestmark = pytest.mark.host  # host code only: left out of the TPU/GPU tier

TOK = tokenizer.byte_tokenizer()
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi?"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Again"},
    {"role": "assistant", "content": "Hey"},
]


def write_jsonl(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_byte_tokenizer_is_one_token_per_byte_plus_specials():
    text = "naïve café ☕ <|im_start|>"
    ids = TOK.encode(text, add_special_tokens=False).ids
    assert ids[:-1] == list("naïve café ☕ ".encode())
    assert ids[-1] == 256 + tokenizer.SPECIAL_TOKENS.index("<|im_start|>")
    assert TOK.get_vocab_size() == 264
    assert TOK.decode(ids, skip_special_tokens=False) == text


def test_loss_mask_covers_exactly_the_assistant_turns():
    ex = data.encode_chat(CHAT, TOK)
    decoded_targets = TOK.decode(ex.tokens[ex.loss_mask].tolist(), skip_special_tokens=False)
    assert decoded_targets == "Hello!<|im_end|>Hey<|im_end|>"
    full = TOK.decode(ex.tokens.tolist(), skip_special_tokens=False)
    assert full == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nAgain<|im_end|>\n"
        "<|im_start|>assistant\nHey<|im_end|>\n"
    )


def padded_truncating_byte_tokenizer():
    """The byte tokenizer as a ``tokenizer.json`` may come: padding and truncation on."""
    tok = tokenizer.byte_tokenizer()
    tok.enable_padding(pad_id=0)
    tok.enable_truncation(3)
    return tok


@given(
    st.lists(chat_messages(), max_size=5),
    st.sampled_from([TOK, padded_truncating_byte_tokenizer()]),
)
def test_batched_encoding_equals_encoding_each_piece_alone(conversations, tok):
    """Batched ``encode_batch`` gives each conversation the ids and mask of encoding its
    ChatML pieces one by one without padding or truncation (empty contents and
    special-token text in contents too), whatever the tokenizer's own settings."""
    got = data.encode_chats(conversations, tok)
    assert len(got) == len(conversations)
    for messages, ex in zip(conversations, got, strict=True):
        ids, mask = [], []
        for m in messages:
            target = m["role"] == "assistant"
            for text, is_target in (
                (f"<|im_start|>{m['role']}\n", False),
                (m["content"], target),
                ("<|im_end|>", target),
                ("\n", False),
            ):
                piece = TOK.encode(text, add_special_tokens=False).ids
                ids += piece
                mask += [is_target] * len(piece)
        assert ex.tokens.dtype == np.int32 and ex.tokens.tolist() == ids
        assert ex.loss_mask.tolist() == mask


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not valid JSON"),
        ('{"text": "x"}', 'expected {"messages"'),
        ('{"messages": [{"role": "robot", "content": "x"}]}', "unknown role 'robot'"),
        ('{"messages": [{"role": "user", "content": 3}]}', "needs string 'role' and 'content'"),
        ('{"messages": [{"role": "user", "content": "x"}]}', "no assistant message"),
    ],
)
def test_bad_lines_are_named(tmp_path, line, message):
    good = json.dumps({"messages": CHAT})
    path = write_jsonl(tmp_path / "d.jsonl", [good, line])
    with pytest.raises(ValueError) as e:
        data.read_chat_jsonl(path)
    assert str(e.value).startswith(f"{path}, line 2: ")
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_a_shard_reader_parses_its_lines_only_and_counts_the_others(tmp_path):
    """``only``: the other shards' conversations are None (counted, blank lines not), a
    bad line in another shard is not this reader's error, and a bad line in its own
    shard still names the file and line. Blank line 2 does not shift the shards."""
    good = json.dumps({"messages": CHAT})
    other = json.dumps(
        {
            "messages": [
                *CHAT,
                {"role": "user", "content": "more"},
                {"role": "assistant", "content": "k"},
            ]
        }
    )
    path = write_jsonl(tmp_path / "d.jsonl", [good, "", other, good, "{not json"])
    evens = data.read_chat_jsonl(path, only=lambda i: i % 2 == 0)
    assert evens == [CHAT, None, CHAT, None]  # record 3 (line 5, not JSON) is not read
    with pytest.raises(ValueError, match=f"^{path}, line 5: not valid JSON"):
        data.read_chat_jsonl(path, only=lambda i: i % 2 == 1)
    second = json.loads(other)["messages"]
    assert data.read_chat_jsonl(path, only=lambda i: i == 1) == [None, second, None, None]


def test_empty_and_missing_datasets(tmp_path):
    with pytest.raises(ValueError, match="empty dataset"):
        data.read_chat_jsonl(write_jsonl(tmp_path / "e.jsonl", ["", "  "]))
    with pytest.raises(ValueError, match="does not exist"):
        data.read_chat_jsonl(tmp_path / "missing.jsonl")


def test_overflow_truncates_or_rejects():
    n = len(data.encode_chat(CHAT, TOK).tokens)
    (ex,) = data.encode_dataset([CHAT], TOK, n - 5)
    assert (
        len(ex.tokens) == n - 5
        and ex.loss_mask.sum() == data.encode_chat(CHAT, TOK).loss_mask[: n - 5].sum()
    )
    with pytest.raises(
        ValueError, match=f"conversation 0 has {n} tokens, more than max_target_length={n - 5}"
    ):
        data.encode_dataset([CHAT], TOK, n - 5, overflow="reject")
    # Truncated before any assistant token: nothing left to train on.
    with pytest.raises(ValueError, match="empty dataset"):
        data.encode_dataset([CHAT], TOK, 10)


@given(
    lengths=st.lists(st.integers(2, 30), min_size=1, max_size=12),
    row=st.integers(30, 64),
    packing=st.booleans(),
)
def test_rows_keep_every_token_once(lengths, row, packing):
    rng = np.random.default_rng(len(lengths))
    examples = [
        data.Example(rng.integers(1, 250, n).astype(np.int32), rng.random(n) < 0.5) for n in lengths
    ]
    rows = data.to_rows(examples, row, packing=packing, pad_id=0)
    seg = rows["segment_ids"]
    # Every example appears once, contiguous, positions restart at 0 in each segment.
    found = []
    for r in range(len(seg)):
        for s in range(1, seg[r].max() + 1):
            where = np.flatnonzero(seg[r] == s)
            assert (np.diff(where) == 1).all()
            assert (rows["positions"][r, where] == np.arange(len(where))).all()
            found.append(rows["input_tokens"][r, where].tolist())
    assert found == [e.tokens.tolist() for e in examples]
    assert (rows["input_mask"][seg == 0] == 0).all() and (rows["input_tokens"][seg == 0] == 0).all()
    if not packing:
        assert len(seg) == len(lengths)
    else:  # greedy: no row could have taken the next row's first example
        for r in range(len(seg) - 1):
            first_next = np.sum(seg[r + 1] == 1)
            assert np.sum(seg[r] > 0) + first_next > row


def test_batches_carry_the_step_target_count_and_are_deterministic():
    examples = data.encode_dataset(default_data.pydoc_conversations()[:40], TOK, 128)
    rows = data.to_rows(examples, 128, packing=True)
    per_row = data.count_targets(rows)
    a = list(zip(range(6), data.batches(rows, 4, 3, seed=1), strict=False))
    b = list(zip(range(6), data.batches(rows, 4, 3, seed=1), strict=False))
    for (_, x), (_, y) in zip(a, b, strict=True):
        assert all(np.array_equal(x[k], y[k]) for k in x)
    for step in (a[:3], a[3:]):
        total = sum(int(data.count_targets(m).sum()) for _, m in step)
        assert all((m["step_target_tokens"] == total).all() for _, m in step)
    assert per_row.sum() > 0
    # Accumulated micro-batches are the rows of the one large batch, in order.
    ((_, big),) = list(zip(range(1), data.batches(rows, 12, 1, seed=1), strict=False))
    micro = np.concatenate([m["input_tokens"] for _, m in a[:3]])
    assert np.array_equal(micro, big["input_tokens"])


def test_embedded_dataset_is_real_offline_text():
    conversations = default_data.pydoc_conversations()
    assert len(conversations) > 1000
    from pydoc_data.topics import topics

    corpus = " ".join(" ".join(text.split()) for text in topics.values())
    answers = [c[1]["content"] for c in conversations]
    assert all(0 < len(a) <= 160 and a in corpus for a in answers)  # cut, never altered
    assert len(set(answers)) == len(answers)
    for c in conversations[:50]:
        data.validate_messages({"messages": c}, where="embedded")


def test_sharded_batches_are_the_same_global_batches_whoever_reads_which_shard():
    """Two processes each reading one of 2 shards yield, side by side, exactly what one
    process reading both yields; step_target_tokens is the step's count over both
    shards (the collective stood in by summing the two processes' counts); one shard
    is the unsharded order of ``batches``."""
    import itertools

    from posttrain.training.data import batches, sharded_batches

    rng = np.random.default_rng(0)

    def shard(n, s):
        seg = (rng.random((n, 8)) > 0.3).astype(np.int32) * (s + 1)
        return {
            "input_tokens": rng.integers(0, 50, (n, 8)),
            "segment_ids": seg,
            "input_mask": (seg > 0).astype(np.int32),
        }

    def sum_values(counts):  # each "process" alone: its own shard's count
        return sum(counts.values())

    rows = {0: shard(12, 0), 1: shard(10, 1)}
    both = list(itertools.islice(sharded_batches(rows, 2, 4, grad_accum_steps=2, seed=3), 6))
    alone = [
        list(
            itertools.islice(
                sharded_batches(
                    {s: rows[s]}, 2, 4, grad_accum_steps=2, seed=3, step_total=sum_values
                ),
                6,
            )
        )
        for s in (0, 1)
    ]
    for whole, first, second in zip(both, *alone, strict=True):
        np.testing.assert_array_equal(
            whole["input_tokens"], np.concatenate([first["input_tokens"], second["input_tokens"]])
        )
        want = int(first["step_target_tokens"][0]) + int(second["step_target_tokens"][0])
        assert set(whole["step_target_tokens"]) == {want}
    single = next(sharded_batches({0: rows[0]}, 1, 4, seed=3))
    plain = next(batches(rows[0], 4, seed=3))
    assert single.keys() == plain.keys()
    for k in plain:
        np.testing.assert_array_equal(single[k], plain[k])


def test_a_resumed_run_keeps_its_recorded_data_shards():
    """Without --data-shards a resume keeps the count the run trained with (1 for runs
    recorded before the setting), whatever the processes now; another count is refused,
    naming both; a count that does not divide the batch is named."""
    from posttrain import sharding
    from posttrain.sft.run import SFTConfig
    from posttrain.training.shards import data_shards

    mesh = sharding.make_mesh()  # every device on fsdp, all in this one process
    assert data_shards(SFTConfig(), mesh, 8) == (1, range(0, 1))
    assert data_shards(SFTConfig(), mesh, 8, recorded=2) == (2, range(0, 2))
    assert data_shards(SFTConfig(data_shards=4), mesh, 8) == (4, range(0, 4))
    with pytest.raises(ValueError, match="data_shards=4 .*trained with 2 data shards"):
        data_shards(SFTConfig(data_shards=4), mesh, 8, recorded=2)
    with pytest.raises(ValueError, match="the global batch 8 does not divide into it"):
        data_shards(SFTConfig(data_shards=3), mesh, 8)
