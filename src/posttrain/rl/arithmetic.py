"""The embedded RL task: single-digit addition with a verifiable answer, offline.

Every pair ``a + b`` with ``a, b`` in 0..9: 100 problems, all of them in the warm-up SFT,
the GRPO prompts and the evaluation (the task measures whether RL raises the policy's
reward, not whether a 92k-parameter model generalises addition: it does not, from 100
examples). The prompt is the user turn ``"{a}+{b}="`` rendered by the chat template
with its generation prompt (default: the built-in ChatML, ``<|im_start|>user\n1+2=
<|im_end|>\n<|im_start|>assistant\n``), exactly as ``posttrain sft`` trains and
``posttrain generate --chat`` prompts; the answer is the integer ``a + b`` and a correct
completion is its digits then the template's end of turn (ChatML: ``<|im_end|>``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator

import numpy as np

from posttrain import atomic, chat


@dataclasses.dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def question(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> int:
        return self.a + self.b

    @property
    def prompt(self) -> str:
        """The prompt text in the built-in ChatML (user turn, then the assistant header)."""
        return self.prompt_in()

    def prompt_in(self, template=None) -> str:
        """The prompt text in ``template`` (a :class:`posttrain.chat.ChatTemplate`;
        default: the built-in ChatML): the user turn with the generation prompt."""
        messages = [{"role": "user", "content": self.question}]
        return chat.prompt_text(messages, template or chat.chatml())


def problems() -> list[Problem]:
    """All 100 problems, ``0+0`` to ``9+9``."""
    return [Problem(a, b) for a in range(10) for b in range(10)]


def write_warmup_jsonl(problems: list[Problem], path: str | os.PathLike, repeats: int) -> None:
    """Chat JSONL (``posttrain sft --data``) of ``problems``, ``repeats`` times each."""
    lines = [
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": p.question},
                    {"role": "assistant", "content": str(p.answer)},
                ]
            }
        )
        for _ in range(repeats)
        for p in problems
    ]
    atomic.write_text(path, "\n".join(lines) + "\n")


def batches(
    problems: list[Problem], batch: int, steps: int, seed: int, template=None
) -> Iterator[dict]:
    """``steps`` batches of ``batch`` problems (``{"prompts": str array, "answer": int
    array}``, what Tunix's learners take; prompts in ``template``, default the built-in
    ChatML), reshuffled by ``seed`` every epoch."""
    rng = np.random.default_rng(seed)
    order: list[int] = []
    for _ in range(steps):
        while len(order) < batch:
            order += list(rng.permutation(len(problems)))
        take, order = order[:batch], order[batch:]
        yield {
            "prompts": np.array([problems[i].prompt_in(template) for i in take]),
            "answer": np.array([problems[i].answer for i in take], np.int32),
        }
