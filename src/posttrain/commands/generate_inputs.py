"""``posttrain generate``'s inputs, checked before any model is read: the prompts
(``--prompt``, ``--prompts``), the ``--output`` path, the sampling numbers. Each refusal
is one ``ValueError`` line naming the value (the file and line of a prompt) and what was
expected; ``posttrain`` prints it and exits 2.
"""

from __future__ import annotations

from posttrain.atomic import check_output_file
from posttrain.training.data import jsonl_records, validate_messages


def check_options(opts) -> None:
    """The options of ``posttrain generate`` that need no model: the sampling numbers
    (:class:`posttrain.generate.SamplingConfig`'s own rules, checked here before the
    model is read), ``--cache-size`` and the ``--output`` path.

    Raises:
      ValueError: naming the first bad value.
    """
    from posttrain.generate import SamplingConfig

    given = {k: getattr(opts, k) for k in ("temperature", "top_k", "top_p")}
    # None: the checkpoint's generation_config.json decides (checked when it is read)
    SamplingConfig(
        max_new_tokens=opts.max_new_tokens,
        seed=opts.seed,
        **{k: v for k, v in given.items() if v is not None},
    )
    if opts.cache_size is not None and opts.cache_size < 1:
        raise ValueError(f"--cache-size {opts.cache_size}: expected >= 1")
    if opts.output is not None:
        check_output_file(opts.output)


def check_text(text: str, where: str) -> None:
    """A prompt's text: not empty, and valid Unicode (a lone surrogate, from JSON's
    ``"\\ud800"`` or bytes that are not UTF-8 in ``argv``, is not text a tokenizer takes).

    Raises:
      ValueError: naming ``where``.
    """
    if not text:
        raise ValueError(f"{where}: empty prompt; expected some text")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{where}: not valid Unicode ({e.reason}: U+{ord(text[e.start]):04X} at "
            f"character {e.start})"
        ) from None


_STUB = {"role": "assistant", "content": ""}  # validate_messages wants an assistant turn


def read_prompts(texts, path: str | None) -> list[dict]:
    """``[{"prompt": text} | {"messages": [...]}]`` from ``--prompt`` ``texts`` and the
    ``--prompts`` JSONL file ``path`` (blank lines skipped).

    Raises:
      ValueError: no prompt at all; naming the ``--prompt`` (its number) or the file and
        line: not UTF-8, not JSON (or nested too deeply), neither ``{"prompt": text}`` nor
        ``{"messages": [...]}``, an empty or invalid text, bad messages.
    """
    prompts = []
    for number, text in enumerate(texts or (), 1):
        check_text(text, f"--prompt {number}")
        prompts.append({"prompt": text})
    if path:
        expected = 'a JSONL file of {"prompt": ...} or {"messages": [...]}'
        for where, record in jsonl_records(path, expected, flag="--prompts"):
            if isinstance(record, dict) and isinstance(record.get("prompt"), str):
                check_text(record["prompt"], where)
                prompts.append({"prompt": record["prompt"]})
            elif isinstance(record, dict) and "messages" in record:
                messages = record["messages"]
                if not isinstance(messages, list) or not messages:
                    raise ValueError(f"{where}: 'messages' must be a non-empty list")
                validate_messages({"messages": [*messages, _STUB]}, where=where)
                prompts.append({"messages": messages})
            else:
                raise ValueError(f'{where}: expected {{"prompt": "..."}} or {{"messages": [...]}}')
    if not prompts:
        where = f" ({path} has only blank lines)" if path else ""
        raise ValueError(
            f"no prompt{where}: pass --prompt TEXT (repeatable) or --prompts FILE.jsonl"
        )
    return prompts
