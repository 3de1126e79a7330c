"""A training run's formats: the chat template it trains in, the stop ids and the special
tokens its export writes (``docs/formats.md``).

``posttrain sft``, ``dpo`` and ``grpo`` call :func:`run_formats` once, before anything is
written: the template is ``--chat-template`` (a Jinja file or ``chatml``), else the model
directory's own (an HF checkpoint's ``chat_template.jinja`` / ``tokenizer_config.json``,
or an earlier run's export), else the tokenizer directory's, else the built-in ChatML
(the embedded byte tokenizer). ChatML with a tokenizer that lacks its markers is refused
(:func:`posttrain.chat.check_template_tokens`), and so is a rerun into an output whose
``run.json`` names another template (its SHA-256): a resumed run must keep training the
format it started in.

The export (:meth:`RunFormats.write`) carries ``chat_template.jinja`` and the special
tokens (``tokenizer_config.json``), ``generation_config.json`` with the run's stop ids
(ChatML's ``<|im_end|>`` first when the run trains the built-in ChatML,
:func:`posttrain.chat.run_stop_ids`), the checkpoint's pad and BOS ids and sampling
defaults, and the run's ``tokenizer.json``: ``posttrain generate --model
runs/sft/model-step<N>`` then prompts and stops in the format the run trained.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any

from posttrain import atomic, chat
from posttrain.tokenizer import load_tokenizer
from posttrain.training import record
from posttrain.training.loading import run_tokenizer_path

#: run.json keys (a segment's facts) naming the template a run trained in.
TEMPLATE_KEY, TEMPLATE_SHA_KEY = "chat_template_origin", "chat_template_sha256"


@dataclasses.dataclass(frozen=True)
class RunFormats:
    """What one run trains in and what its export writes.

    Attributes:
      template: the chat template conversations and prompts are rendered with.
      eos_ids: the stop ids the export writes (the run's end of turn first); empty when
        nothing names one (the export then has no ``generation_config.json``).
      pad_id: the checkpoint's pad id (:func:`posttrain.chat.pad_id`), None if unnamed.
      bos_id: the id of the template's ``bos_token``, None without one.
      sampling: the checkpoint's sampling defaults (:func:`posttrain.chat.sampling_defaults`).
      tokenizer: the run's ``tokenizers.Tokenizer``.
      tokenizer_path: where it was loaded from (None: the embedded one).
    """

    template: chat.ChatTemplate
    eos_ids: tuple[int, ...]
    pad_id: int | None
    bos_id: int | None
    sampling: dict[str, Any]
    tokenizer: Any
    tokenizer_path: str | None = None

    def facts(self) -> dict[str, Any]:
        """What ``run.json`` records of the formats (a segment's facts)."""
        return {
            TEMPLATE_KEY: self.template.origin,
            TEMPLATE_SHA_KEY: self.template.sha256,
            "eos_ids": list(self.eos_ids),
        }

    def write(self, directory: str | os.PathLike) -> None:
        """Writes the formats into an export ``directory`` (module docstring); each file
        atomically."""
        directory = pathlib.Path(directory)
        chat.save_template(directory, self.template)
        atomic.write_text(directory / "tokenizer.json", self.tokenizer.to_str())
        if not self.eos_ids:  # nothing names a stop token: no generation config to write
            return
        sampling = self.sampling
        chat.write_generation_config(
            directory,
            eos_ids=self.eos_ids,
            bos_id=self.bos_id,
            pad_id=self.pad_id,
            temperature=sampling.get("temperature"),
            top_k=sampling.get("top_k"),
            top_p=sampling.get("top_p"),
        )


def run_formats(cfg, tok, tokenizer_path: str | None) -> RunFormats:
    """The formats of the run ``cfg`` (its ``model``, ``chat_template`` and ``output``)
    with the tokenizer ``tok`` loaded from ``tokenizer_path`` (None: the embedded one).

    Raises:
      ValueError: the template cannot be read or parsed, ChatML without its markers in
        the tokenizer, a source naming a token the tokenizer lacks, or ``cfg.output`` holds a
        run trained in another template (:func:`check_unchanged`); one line each.
    """
    formats = chat.checkpoint_formats(
        cfg.model, tok, tokenizer_path=tokenizer_path, chat_template=cfg.chat_template
    )
    template = formats.template
    chat.check_template_tokens(template, tok)
    # the tokenizer's directory, else the checkpoint's (stop_ids' own fallback)
    eos = chat.run_stop_ids(
        template, tok, checkpoint=formats.checkpoint, tokenizer_dir=tokenizer_path
    )
    bos = template.bos_token
    run = RunFormats(
        template=template,
        eos_ids=eos,
        pad_id=formats.pad_id,
        bos_id=None if bos is None else tok.token_to_id(bos),
        sampling=chat.sampling_defaults(formats.checkpoint),
        tokenizer=tok,
        tokenizer_path=tokenizer_path,
    )
    check_unchanged(cfg.output, run)
    return run


def check_unchanged(out: str | os.PathLike, formats: RunFormats) -> None:
    """Refuses to resume the run in ``out`` in another template than it trained in (its
    ``run.json``'s :data:`TEMPLATE_SHA_KEY`; a run recorded before templates were read
    trained the built-in ChatML).

    Raises:
      ValueError: one line naming both templates.
    """
    recorded = record.read(out)
    if recorded is None:
        return
    sha = recorded.get(TEMPLATE_SHA_KEY, chat.chatml().sha256)
    if sha != formats.template.sha256:
        origin = recorded.get(TEMPLATE_KEY, "chatml")
        raise ValueError(
            f"{pathlib.Path(out)} holds a run trained in chat template {origin} (sha256 "
            f"{sha[:12]}), not {formats.template.origin} (sha256 "
            f"{formats.template.sha256[:12]}); refusing to resume it: use a new --output, "
            "or the run's template (--chat-template)"
        )


def run_tokenizer_and_formats(cfg) -> tuple[Any, RunFormats]:
    """``(tokenizer, formats)`` of the run ``cfg``: the tokenizer at
    :func:`posttrain.training.loading.run_tokenizer_path` and :func:`run_formats`.

    Raises:
      ValueError: as :func:`run_formats`, or a tokenizer that cannot be loaded.
    """
    path = run_tokenizer_path(cfg, cfg.model if os.path.isdir(cfg.model) else None)
    tok = load_tokenizer(path)
    return tok, run_formats(cfg, tok, path)
