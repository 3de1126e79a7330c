"""The embedded default preference data, built offline from ``posttrain sft``'s data.

Each conversation of :func:`posttrain.training.default_data.pydoc_conversations` (a question
about a Python language topic and a paragraph of the reference as the answer) becomes
one pair: ``chosen`` is its own answer, ``rejected`` is the answer to the question
halfway round the list (another topic) with its words in reverse order: off-topic and
disfluent. (Off-topic alone is not learnable by a tiny byte-level model in a few dozen
steps, from scratch or after the default ``posttrain sft``: the held-out margin stayed
at 0.02; word order is, and it carries over to held-out pairs.) Every
:data:`HELD_OUT_EVERY`-th pair is held out, for the evaluation before and after training.
"""

from __future__ import annotations

from posttrain.preference.data import Pair
from posttrain.training.default_data import pydoc_conversations

#: One pair in this many is held out (``pydoc_pairs``' second list).
HELD_OUT_EVERY = 8


def pydoc_pairs() -> tuple[list[Pair], list[Pair]]:
    """``(train pairs, held-out pairs)``, deterministic.

    Raises:
      RuntimeError: this Python was built without ``pydoc_data``.
    """
    conversations = pydoc_conversations()
    n = len(conversations)
    train, held_out = [], []
    for i, (question, answer) in enumerate(conversations):
        other = conversations[(i + n // 2) % n][1]
        reversed_words = " ".join(reversed(other["content"].split()))
        rejected = {"role": "assistant", "content": reversed_words}
        pair = Pair([question], [answer], [rejected], f"(embedded pydoc_data pair {i})")
        (held_out if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else train).append(pair)
    return train, held_out
