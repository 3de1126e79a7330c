"""Chat encoding: the template's rendering and mask against the piecewise ChatML encode.

Usage::

    python benchmarks/chat_encode.py [--repeats 3]

On the embedded ``pydoc_data`` conversations and the embedded byte tokenizer, prints (the
best of ``--repeats``, all measured in this run):

- the piecewise ChatML encode ``posttrain sft`` used before it read templates (each
  ``<|im_start|>{role}\\n``, content, ``<|im_end|>``, ``\\n`` encoded on its own, the mask
  following the pieces; reproduced below from ``sft/data.py`` at 449e105^ as the baseline);
- :func:`posttrain.chat.encode_conversations` with the built-in ChatML (rendered in the
  Jinja sandbox, generation blocks, offsets to mask), and the ratio template / piecewise;
- the same template without generation blocks (the mask by prefix rendering: one
  rendering per assistant turn plus two prefixes), and its ratio;

and checks that the built-in ChatML gives exactly the piecewise ids and masks.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np


def piecewise_chatml(conversations, tokenizer) -> list[tuple[np.ndarray, np.ndarray]]:
    """The encode ``posttrain sft`` used before templates (``sft/data.py`` at 449e105^)."""
    out = []
    for first in range(0, len(conversations), 1024):
        chunk = conversations[first : first + 1024]
        pieces: list[str] = []
        targets: list[bool] = []
        for messages in chunk:
            for m in messages:
                target = m["role"] == "assistant"
                pieces += [f"<|im_start|>{m['role']}\n", m["content"], "<|im_end|>", "\n"]
                targets += [False, target, target, False]
        encodings = tokenizer.encode_batch(pieces, add_special_tokens=False)
        start = 0
        for messages in chunk:
            end = start + 4 * len(messages)
            ids = [e.ids for e in encodings[start:end]]
            mask = [t for piece, t in zip(ids, targets[start:end], strict=True) for _ in piece]
            out.append((np.asarray([i for p in ids for i in p], np.int32), np.asarray(mask, bool)))
            start = end
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from _timing import best_time

    from posttrain import chat
    from posttrain.tokenizer import load_tokenizer
    from posttrain.training.default_data import pydoc_conversations

    conversations = pydoc_conversations()
    tok = load_tokenizer(None)
    template = chat.chatml()
    no_blocks = chat.ChatTemplate(
        chat.CHATML.replace("{%- generation -%}", "").replace("{%- endgeneration -%}", ""),
        origin="chatml without generation blocks",
    )
    old = piecewise_chatml(conversations, tok)
    new = chat.encode_conversations(conversations, tok, template)
    same = all(
        np.array_equal(a, c) and np.array_equal(b, d)
        for (a, b), (c, d) in zip(old, new, strict=True)
    )
    if not same:
        print("the built-in ChatML's ids or masks differ from the piecewise encode")
        return 1
    base = best_time(lambda: piecewise_chatml(conversations, tok), args.repeats)
    blocks = best_time(
        lambda: chat.encode_conversations(conversations, tok, template), args.repeats
    )
    prefixes = best_time(
        lambda: chat.encode_conversations(conversations, tok, no_blocks), args.repeats
    )
    n = len(conversations)
    print(f"{n:,} conversations, best of {args.repeats}; ids and masks identical")
    print(f"piecewise ChatML encode:            {base:.2f} s")
    print(f"template, generation blocks:        {blocks:.2f} s  ({blocks / base:.2f}x)")
    print(f"template, prefix rendering:         {prefixes:.2f} s  ({prefixes / base:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
