"""A checkpoint's stop tokens and sampling defaults, read from its own files; the
``generation_config.json`` an export writes.

Stop (EOS) ids, the first source that names any (one id or a list):

1. ``generation_config.json`` ``eos_token_id`` (Llama 3.1 lists three: ``<|end_of_text|>``,
   ``<|eom_id|>``, ``<|eot_id|>``; Qwen3 two; GPT-OSS ``<|return|>``, ``<|endoftext|>``,
   ``<|call|>``);
2. ``config.json`` ``eos_token_id`` (or its ``text_config``'s, for multimodal configs);
3. the tokenizer's ``eos_token`` in ``tokenizer_config.json``, looked up in its vocabulary;
4. only when none of these says anything (the embedded byte tokenizer, a preset):
   :data:`DEFAULT_STOP_TOKENS`, the tokens of those names the vocabulary has.

transformers 5.12 reads ``generation_config.json`` when the checkpoint has one, else
builds a generation config from ``config.json`` (``GenerationMixin`` loading in
``generation/utils.py``); where a generation config names no EOS it stops at none, and
here ``config.json`` is read next, then the tokenizer.

Sampling defaults, as transformers reads generation_config.json: ``do_sample`` not true is
greedy (temperature 0 here); otherwise its ``temperature`` (1.0, ``GenerationConfig``'s
default, when absent), ``top_k`` and ``top_p``, each only when present. A value the user
gives wins, one by one.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib

from posttrain import atomic
from posttrain.chat.template import (
    CHATML,
    ChatTemplate,
    TemplateError,
    load_template,
    resolve_template,
    special_tokens,
    tokenizer_directory,
)

GENERATION_CONFIG = "generation_config.json"
MODEL_CONFIG = "config.json"
#: The names ``posttrain generate`` stopped on before it read checkpoints; now only the
#: last resort, for a checkpoint and tokenizer that name no EOS at all.
DEFAULT_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>", "</s>")
SAMPLING_KEYS = ("temperature", "top_k", "top_p")


def _json(path: pathlib.Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TemplateError(
            f"{path}: not a readable JSON file ({' '.join(str(e).split())})"
        ) from None
    if not isinstance(value, dict):
        raise TemplateError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _ids(value, where: str, vocab: int, key: str = "eos_token_id") -> tuple[int, ...] | None:
    """``eos_token_id`` as a tuple (None when absent or null), each id below ``vocab``
    (the tokenizer's size: an id past it is never generated, and may not fit int32)."""
    if value is None:
        return None
    values = value if isinstance(value, list) and key == "eos_token_id" else [value]
    if not values or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values
    ):
        expected = "an id >= 0 or a list of them" if key == "eos_token_id" else "an id >= 0"
        raise TemplateError(f"{where}: {key}={value!r}; expected {expected}")
    if past := [v for v in values if v >= vocab]:
        raise TemplateError(
            f"{where}: {key}={value!r}; id {past[0]} is past the tokenizer's vocabulary "
            f"of {vocab} ids"
        )
    return tuple(dict.fromkeys(values))


def _vocab(tokenizer) -> int:
    return tokenizer.get_vocab_size()


def stop_ids_with_source(
    tokenizer,
    *,
    checkpoint: str | os.PathLike | None = None,
    tokenizer_dir: str | os.PathLike | None = None,
) -> tuple[tuple[int, ...], str]:
    """The stop ids (module docstring) and the file (or rule) they came from.

    Args:
      tokenizer: the ``tokenizers.Tokenizer`` the ids are looked up in (sources 3, 4).
      checkpoint: the HF checkpoint directory (sources 1, 2); ``None`` for a preset.
      tokenizer_dir: where ``tokenizer_config.json`` is (default: ``checkpoint``).

    Raises:
      TemplateError: a source file that is not a JSON object, an ``eos_token_id`` that is
        not an id or a list of ids, or a tokenizer ``eos_token`` missing from the vocabulary.
    """
    if checkpoint is not None:
        directory = pathlib.Path(checkpoint)
        for name in (GENERATION_CONFIG, MODEL_CONFIG):
            config = _json(directory / name)
            if config is None:
                continue
            value = config.get("eos_token_id")
            if value is None and isinstance(config.get("text_config"), dict):
                value = config["text_config"].get("eos_token_id")
            ids = _ids(value, str(directory / name), _vocab(tokenizer))
            if ids is not None:
                return ids, str(directory / name)
    where = tokenizer_dir if tokenizer_dir is not None else checkpoint
    if where is not None:
        token = special_tokens(where).get("eos_token")
        if token is not None:
            token_id = tokenizer.token_to_id(token)
            if token_id is None:
                raise TemplateError(
                    f"{tokenizer_directory(where)}/tokenizer_config.json: eos_token {token!r} "
                    "is not in the tokenizer's vocabulary"
                )
            return (token_id,), f"{tokenizer_directory(where)}/tokenizer_config.json"
    ids = tuple(i for name in DEFAULT_STOP_TOKENS if (i := tokenizer.token_to_id(name)) is not None)
    return ids, "default token names " + ", ".join(DEFAULT_STOP_TOKENS)


def stop_ids(tokenizer, *, checkpoint=None, tokenizer_dir=None) -> tuple[int, ...]:
    """:func:`stop_ids_with_source`'s ids."""
    return stop_ids_with_source(tokenizer, checkpoint=checkpoint, tokenizer_dir=tokenizer_dir)[0]


#: The pad tokens ``posttrain generate`` looked up by name before it read checkpoints; now
#: only the last resort, for a checkpoint and tokenizer that name no pad token.
DEFAULT_PAD_TOKENS = ("<|pad|>", "<pad>")


def pad_id(tokenizer, *, checkpoint=None, tokenizer_dir=None) -> int | None:
    """The checkpoint's pad id: ``generation_config.json`` ``pad_token_id``, then
    ``config.json``'s, then ``tokenizer_config.json``'s ``pad_token`` in the vocabulary,
    then (only when none of them says) the tokens of :data:`DEFAULT_PAD_TOKENS`; None when
    nothing names one (the caller pads with 0: masks, not this id, mark padding).

    Raises:
      TemplateError: a source file that is not a JSON object, a ``pad_token_id`` that is
        not an id, or a ``pad_token`` missing from the vocabulary.
    """
    if checkpoint is not None:
        directory = pathlib.Path(checkpoint)
        for name in (GENERATION_CONFIG, MODEL_CONFIG):
            config = _json(directory / name)
            value = None if config is None else config.get("pad_token_id")
            if value is None:
                continue
            return _ids(value, str(directory / name), _vocab(tokenizer), "pad_token_id")[0]
    where = tokenizer_dir if tokenizer_dir is not None else checkpoint
    token = special_tokens(where).get("pad_token") if where is not None else None
    if token is not None:
        token_id = tokenizer.token_to_id(token)
        if token_id is None:
            raise TemplateError(
                f"{tokenizer_directory(where)}/tokenizer_config.json: pad_token {token!r} "
                "is not in the tokenizer's vocabulary"
            )
        return token_id
    return next(
        (i for name in DEFAULT_PAD_TOKENS if (i := tokenizer.token_to_id(name)) is not None),
        None,
    )


CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")


def check_template_tokens(template: ChatTemplate, tokenizer) -> None:
    """Refuses the built-in ChatML with a tokenizer that lacks its markers as tokens: the
    model would learn ``<|im_end|>`` as plain text and never emit a stop id.

    Raises:
      TemplateError: naming the missing token and the way out (``--chat-template``).
    """
    if template.source != CHATML:
        return
    for token in CHATML_TOKENS:
        if tokenizer.token_to_id(token) is None:
            raise TemplateError(
                f"the tokenizer has no chat template and no {token} token, so ChatML would "
                "be split into plain text; pass --chat-template FILE (a Jinja template in "
                "the model's format)"
            )


def run_stop_ids(template: ChatTemplate, tokenizer, *, checkpoint=None, tokenizer_dir=None):
    """The stop ids an export of a run trained in ``template`` writes: the checkpoint's
    (:func:`stop_ids`), with ChatML's ``<|im_end|>`` first when the run trains the built-in
    ChatML (what the model learns to end a turn with), each once."""
    ids = stop_ids(tokenizer, checkpoint=checkpoint, tokenizer_dir=tokenizer_dir)
    end = tokenizer.token_to_id("<|im_end|>") if template.source == CHATML else None
    return tuple(dict.fromkeys(ids if end is None else (end, *ids)))


def sampling_defaults(checkpoint: str | os.PathLike | None) -> dict[str, float | int]:
    """``temperature`` / ``top_k`` / ``top_p`` from ``generation_config.json`` (module
    docstring); ``{}`` without one.

    Raises:
      TemplateError: the file is not a JSON object, or a value is not a number.
    """
    if checkpoint is None:
        return {}
    path = pathlib.Path(checkpoint) / GENERATION_CONFIG
    config = _json(path)
    if config is None:
        return {}
    if config.get("do_sample") is not True:
        return {"temperature": 0.0}
    out: dict[str, float | int] = {"temperature": 1.0}  # GenerationConfig's default
    for key in SAMPLING_KEYS:
        value = config.get(key)
        if value is not None:
            out[key] = _sampling_value(key, value, path)
    return out


SAMPLING_RANGES = {
    "temperature": "a number: finite and >= 0",
    "top_k": "a number: an integer in [1, 2**31 - 1]",
    "top_p": "a number in (0, 1]",
}


def _sampling_value(key: str, value, path: pathlib.Path) -> float | int:
    """``value`` of ``key`` as SamplingConfig takes it, or one line naming the file (the
    JSON may hold NaN, Infinity, a fraction of a token or an id past int32)."""
    number = not isinstance(value, bool) and isinstance(value, int | float)
    fits = number and {
        "temperature": lambda v: math.isfinite(v) and v >= 0,
        "top_k": lambda v: math.isfinite(v) and v == int(v) and 1 <= v <= 2**31 - 1,
        "top_p": lambda v: 0 < v <= 1,
    }[key](value)
    if not fits:
        raise TemplateError(f"{path}: {key}={value!r}; expected {SAMPLING_RANGES[key]}")
    return int(value) if key == "top_k" else float(value)


def resolve_sampling(
    checkpoint: str | os.PathLike | None, *, temperature=None, top_k=None, top_p=None
) -> dict[str, float | int | None]:
    """The sampling options a run uses: each the user's (not None), else the checkpoint's
    (:func:`sampling_defaults`), else greedy / unlimited (``temperature=0.0``, ``top_k`` and
    ``top_p`` None)."""
    given = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    defaults = {"temperature": 0.0, "top_k": None, "top_p": None, **sampling_defaults(checkpoint)}
    return {k: given[k] if given[k] is not None else defaults[k] for k in given}


def write_generation_config(
    directory: str | os.PathLike,
    *,
    eos_ids: tuple[int, ...],
    bos_id: int | None = None,
    pad_id: int | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
) -> None:
    """Writes ``generation_config.json`` (atomically) the way transformers reads it: one
    ``eos_token_id`` or a list, ``do_sample`` true with the sampling values when
    ``temperature`` > 0, greedy otherwise.

    Raises:
      ValueError: no stop id, or one below 0.
    """
    if not eos_ids or any(i < 0 for i in eos_ids):
        raise ValueError(f"eos_ids={eos_ids!r}: expected one id >= 0 or more")
    config: dict = {"eos_token_id": eos_ids[0] if len(eos_ids) == 1 else list(eos_ids)}
    if bos_id is not None:
        config["bos_token_id"] = bos_id
    if pad_id is not None:
        config["pad_token_id"] = pad_id
    sampled = temperature is not None and temperature > 0
    config["do_sample"] = sampled
    if sampled:
        config["temperature"] = temperature
        config.update({k: v for k, v in (("top_k", top_k), ("top_p", top_p)) if v is not None})
    atomic.write_text(
        pathlib.Path(directory) / GENERATION_CONFIG, json.dumps(config, indent=2) + "\n"
    )


@dataclasses.dataclass(frozen=True)
class CheckpointFormats:
    """What a model's files say about its formats (:func:`checkpoint_formats`).

    Attributes:
      template: the chat template prompts are rendered with.
      eos_ids: the stop ids (:func:`stop_ids_with_source`), ``eos_source`` where from.
      checkpoint: the checkpoint directory read (None for a preset).
      pad_id: the pad id (:func:`pad_id`), None when nothing names one.
    """

    template: ChatTemplate
    eos_ids: tuple[int, ...]
    eos_source: str
    checkpoint: str | None
    pad_id: int | None = None

    def sampling(self, *, temperature=None, top_k=None, top_p=None) -> dict:
        """:func:`resolve_sampling` of this checkpoint with the user's values."""
        return resolve_sampling(self.checkpoint, temperature=temperature, top_k=top_k, top_p=top_p)


def checkpoint_formats(
    spec: str | os.PathLike | None,
    tokenizer,
    *,
    tokenizer_path: str | os.PathLike | None = None,
    chat_template: str | None = None,
) -> CheckpointFormats:
    """The formats of the model ``spec`` (a checkpoint or export directory; anything else,
    e.g. a preset name, has no files) used with ``tokenizer`` (loaded from
    ``tokenizer_path``, default the checkpoint). The template: ``chat_template`` (``chatml``
    or a file), else the checkpoint's own (an export carries the one it was trained
    with), else the tokenizer directory's, else the built-in ChatML.

    Raises:
      TemplateError: as :func:`~posttrain.chat.template.resolve_template`,
        :func:`stop_ids_with_source` and :func:`pad_id`.
    """
    checkpoint = os.fspath(spec) if spec is not None and os.path.isdir(spec) else None
    tokenizer_dir = tokenizer_path if tokenizer_path is not None else checkpoint
    own = load_template(checkpoint) if checkpoint is not None and chat_template is None else None
    template = own or resolve_template(tokenizer_dir, chat_template)
    ids, source = stop_ids_with_source(
        tokenizer, checkpoint=checkpoint, tokenizer_dir=tokenizer_dir
    )
    pad = pad_id(tokenizer, checkpoint=checkpoint, tokenizer_dir=tokenizer_dir)
    return CheckpointFormats(template, ids, source, checkpoint, pad)
