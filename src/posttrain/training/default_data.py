"""The embedded default dataset: Q/A pairs from CPython's ``pydoc_data`` topics.

``pydoc_data.topics.topics`` (shipped with every CPython, the text ``help()``
prints for language topics) maps 79 topic names to reference text. Each
distinct paragraph becomes one conversation: the user asks about the topic, the assistant
answers with the paragraph, cut at a sentence end to at most ``max_chars``.
Real English text, available offline, deterministic.
"""

from __future__ import annotations

import re

from posttrain.training.data import Messages

try:
    from pydoc_data.topics import topics as _TOPICS
except ImportError:  # some distributions strip it: pydoc_conversations says so when called
    _TOPICS = None

_SENTENCE_END = re.compile(r"(?<=[.!?:])\s")


def _answer(paragraph: str, max_chars: int) -> str:
    text = " ".join(paragraph.split())
    if len(text) <= max_chars:
        return text
    cut = [m.start() for m in _SENTENCE_END.finditer(text) if m.start() <= max_chars]
    return text[: cut[-1]] if cut else text[:max_chars]


def pydoc_conversations(max_chars: int = 160, min_chars: int = 60) -> list[Messages]:
    """Conversations from ``pydoc_data`` topics, in topic order.

    Raises:
      RuntimeError: this Python was built without ``pydoc_data``.
    """
    if _TOPICS is None:
        raise RuntimeError(
            "the embedded dataset needs CPython's pydoc_data module; pass --data FILE.jsonl instead"
        )
    conversations, seen = [], set()
    for name in sorted(_TOPICS):
        subject = name.replace("-", " ")
        paragraphs = [p for p in re.split(r"\n\s*\n", _TOPICS[name]) if len(p.strip()) >= min_chars]
        for i, paragraph in enumerate(paragraphs):
            answer = _answer(paragraph, max_chars)
            if answer in seen:  # topics share sections; keep the first
                continue
            seen.add(answer)
            question = (
                f"What does the Python reference say about {subject}?"
                if i == 0
                else f"Tell me more about {subject} in Python (part {i + 1})."
            )
            conversations.append(
                [
                    {"role": "user", "content": question},
                    {"role": "assistant", "content": answer},
                ]
            )
    return conversations
