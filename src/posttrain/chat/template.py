"""A checkpoint's chat template: found, loaded, rendered in a sandbox, saved.

Where it comes from (the order transformers' ``AutoTokenizer`` reads, 5.x):
``chat_template.jinja`` beside the tokenizer, else ``tokenizer_config.json``'s
``chat_template`` (a string, or a list of ``{"name", "template"}`` of which ``default``
is used), else none: the caller falls back to :func:`chatml`, the built-in ChatML that
renders exactly the text ``posttrain sft`` always trained (``<|im_start|>{role}\\n
{content}<|im_end|>\\n`` per message).

Rendering: ``jinja2.sandbox.ImmutableSandboxedEnvironment`` with the globals and options
transformers gives chat templates (``trim_blocks``, ``lstrip_blocks``, the
``loopcontrols`` extension, ``raise_exception``, ``strftime_now``, a ``tojson`` filter
with ``ensure_ascii=False``; the tokenizer's special tokens ``bos_token``, ``eos_token``
... as variables; ``add_generation_prompt``). Reference: transformers 5.12
``utils/chat_template_utils.py`` (``_cached_compile_jinja_template``). Bounded in time,
output and template size (:mod:`posttrain.chat.sandbox`).

``{% generation %}...{% endgeneration %}`` blocks (transformers' ``AssistantTracker``
tag) mark the text an assistant turn trains on; :meth:`ChatTemplate.render_spans` returns
their character spans. Here the block writes two sentinel strings (unique per rendering)
around its body, removed after rendering; their positions are the spans.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import re
import secrets

import jinja2
import jinja2.ext
import jinja2.nodes

from posttrain import atomic
from posttrain.chat import bounds, sandbox

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
#: The tokenizer_config.json keys transformers passes to a template as variables.
SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")

#: The built-in ChatML (Qwen's template without tools), assistant turns in generation
#: blocks: content and ``<|im_end|>`` train, the header and the newline do not.
CHATML = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- generation -%}{{- message['content'] + '<|im_end|>' -}}{%- endgeneration -%}"
    "{%- else -%}{{- message['content'] + '<|im_end|>' -}}{%- endif -%}"
    "{{- '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


class TemplateError(ValueError):
    """A template that cannot be loaded, or refuses a conversation (its ``raise_exception``)."""


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template and the special tokens it is rendered with.

    Attributes:
      source: the Jinja text.
      special_tokens: ``bos_token``, ``eos_token`` ... (strings) from the tokenizer's
        ``tokenizer_config.json``, passed to the template as variables.
      origin: where it came from (a file path, or ``"chatml"``), for messages.
    """

    source: str
    special_tokens: dict[str, str] = dataclasses.field(default_factory=dict)
    origin: str = "chatml"

    @property
    def sha256(self) -> str:
        """Hex SHA-256 of :attr:`source` (UTF-8): what a run records to name its format."""
        return hashlib.sha256(self.source.encode("utf-8")).hexdigest()

    @property
    def has_generation_blocks(self) -> bool:
        """Whether the template marks assistant text with ``{% generation %}``."""
        return bool(_GENERATION_TAG.search(self.source))

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    def render(self, messages: list[dict], *, add_generation_prompt: bool = False, **extra) -> str:
        """The text of ``messages`` (``extra``: more template variables, e.g. a family's
        ``enable_thinking``).

        Raises:
          TemplateError: the template's ``raise_exception``, or another Jinja error,
            as one line.
        """
        return self.render_spans(messages, add_generation_prompt=add_generation_prompt, **extra)[0]

    def render_spans(
        self, messages: list[dict], *, add_generation_prompt: bool = False, **extra
    ) -> tuple[str, list[tuple[int, int]]]:
        """The text and the ``[start, end)`` character spans of its generation blocks, in
        order (empty when the template has none).

        Raises:
          TemplateError: as :meth:`render`.
        """
        begin, end = (f"\x00gen{secrets.token_hex(8)}{c}\x00" for c in "[]")
        variables = {
            **self.special_tokens,
            **extra,
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "_generation_markers": (begin, end),
        }
        template = _compile(self.source)
        try:
            text = sandbox.render(template, variables)
        except (
            jinja2.TemplateError,
            TypeError,
            ValueError,
            LookupError,
            AttributeError,
            ArithmeticError,
            bounds.BoundExceeded,
        ) as e:
            # raise_exception, the sandbox and its bounds, undefined names; a value of the
            # wrong type (a list where the template adds strings) fails in Python's own
            # operators, 1e308 ** 2 in its arithmetic
            raise TemplateError(f"chat template {self.origin}: {_one_line(e)}") from None
        return _strip_markers(text, begin, end)


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def _strip_markers(text: str, begin: str, end: str) -> tuple[str, list[tuple[int, int]]]:
    """``text`` without the markers, and the spans they enclosed."""
    pieces = re.split(f"({re.escape(begin)}|{re.escape(end)})", text)
    out: list[str] = []
    spans: list[tuple[int, int]] = []
    length, start = 0, None
    for piece in pieces:
        if piece == begin:
            start = length
        elif piece == end:
            if start is None:  # cannot happen: the block writes both
                raise TemplateError("chat template: unbalanced generation block")
            if length > start:
                spans.append((start, length))
            start = None
        else:
            out.append(piece)
            length += len(piece)
    return "".join(out), spans


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}body{% endgeneration %}``: the body between two markers the
    caller passes as ``_generation_markers`` (the body alone when none are given)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        markers = jinja2.nodes.Name("_generation_markers", "load")
        call = self.call_method("_wrap", [markers])
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    @staticmethod
    def _wrap(markers, caller):
        body = caller()
        if isinstance(markers, jinja2.Undefined) or not markers:
            return body
        return f"{markers[0]}{body}{markers[1]}"


def _raise_exception(message):
    raise jinja2.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' options: no HTML escaping (Jinja's own filter escapes <, >, &)
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@functools.lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    env = sandbox.BoundedEnvironment(  # strftime_now and the bounds: chat.sandbox, chat.bounds
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.bound_filters()
    try:
        sandbox.check_source(source)
        return env.from_string(source)
    except bounds.BoundExceeded as e:
        raise TemplateError(f"chat template: {e}") from None
    except RecursionError:
        raise TemplateError(
            "chat template does not parse: nested deeper than Python's recursion limit"
        ) from None
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(
            f"chat template does not parse: {_one_line(e)} (line {e.lineno})"
        ) from None


def chatml(special_tokens: dict[str, str] | None = None) -> ChatTemplate:
    """The built-in ChatML template (:data:`CHATML`)."""
    return ChatTemplate(CHATML, dict(special_tokens or {}), "chatml")


def _read_json(path: pathlib.Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TemplateError(f"{path}: not a readable JSON file ({_one_line(e)})") from None
    if not isinstance(value, dict):
        raise TemplateError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken
    dict ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def tokenizer_directory(path: str | os.PathLike) -> pathlib.Path:
    """The directory of a tokenizer (``path`` itself, or the folder of a ``tokenizer.json``)."""
    path = pathlib.Path(path)
    return path if path.is_dir() else path.parent


def special_tokens(path: str | os.PathLike) -> dict[str, str]:
    """The special tokens of :data:`SPECIAL_TOKEN_KEYS` in the ``tokenizer_config.json``
    beside ``path`` (a tokenizer directory or file); ``{}`` without one.

    Raises:
      TemplateError: the file is not a JSON object.
    """
    config = tokenizer_directory(path) / TOKENIZER_CONFIG
    if not config.is_file():
        return {}
    values = _read_json(config)
    return {k: t for k in SPECIAL_TOKEN_KEYS if (t := _token_text(values.get(k))) is not None}


def load_template(path: str | os.PathLike) -> ChatTemplate | None:
    """The chat template beside ``path`` (a checkpoint or tokenizer directory, or its
    ``tokenizer.json``): ``chat_template.jinja``, else tokenizer_config.json's
    ``chat_template``; ``None`` when it has neither.

    Raises:
      TemplateError: an unreadable file, a ``chat_template`` that is neither a string nor
        a list of ``{"name", "template"}`` with a ``default``, or a template that does
        not parse.
    """
    directory = tokenizer_directory(path)
    tokens = special_tokens(directory)
    jinja_file = directory / TEMPLATE_FILE
    if jinja_file.is_file():
        return _checked(_read_source(jinja_file), tokens, str(jinja_file))
    config = directory / TOKENIZER_CONFIG
    if not config.is_file():
        return None
    value = _read_json(config).get("chat_template")
    if value is None:
        return None
    where = f"{config} chat_template"
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if "default" not in named:
            raise TemplateError(
                f"{where}: a list of templates without a 'default' "
                f"(names: {sorted(map(str, named))})"
            )
        value = named["default"]
    if not isinstance(value, str):
        raise TemplateError(f"{where}: expected a Jinja string, got {type(value).__name__}")
    return _checked(value, tokens, where)


def _read_source(path: pathlib.Path) -> str:
    """A template file's text (:func:`posttrain.chat.sandbox.read_source`: its size bounded)."""
    try:
        return sandbox.read_source(path)
    except bounds.BoundExceeded as e:
        raise TemplateError(f"{path}: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise TemplateError(f"{path}: not a readable template ({_one_line(e)})") from None


def _checked(source: str, tokens: dict[str, str], origin: str) -> ChatTemplate:
    template = ChatTemplate(source, tokens, origin)
    try:
        _compile(source)
    except TemplateError as e:
        raise TemplateError(f"{origin}: {e}") from None
    return template


def resolve_template(
    tokenizer: str | os.PathLike | None, override: str | None = None
) -> ChatTemplate:
    """The template a run uses: ``override`` (``"chatml"`` or a Jinja file: what
    ``--chat-template`` takes), else the tokenizer's own (:func:`load_template`), else
    the built-in ChatML. Special tokens come from the tokenizer's config either way.

    Raises:
      TemplateError: ``override`` is neither ``chatml`` nor a readable file, or as
        :func:`load_template`.
    """
    tokens = special_tokens(tokenizer) if tokenizer is not None else {}
    if override == "chatml":
        return chatml(tokens)
    if override is not None:
        path = pathlib.Path(override)
        if not path.is_file():
            raise TemplateError(
                f"--chat-template {override!r} is not a file; expected a Jinja file or 'chatml'"
            )
        return _checked(_read_source(path), tokens, str(path))
    own = load_template(tokenizer) if tokenizer is not None else None
    return own if own is not None else chatml(tokens)


def save_template(directory: str | os.PathLike, template: ChatTemplate) -> None:
    """Writes ``template`` into an export ``directory`` the way transformers 5 saves one:
    ``chat_template.jinja``, and its special tokens in ``tokenizer_config.json`` (merged
    into an existing one, whose own ``chat_template`` is removed so the file is the only
    source). Both writes are atomic."""
    directory = pathlib.Path(directory)
    config_path = directory / TOKENIZER_CONFIG
    config = _read_json(config_path) if config_path.is_file() else {}
    config.pop("chat_template", None)
    config.update(template.special_tokens)
    atomic.write_text(directory / TEMPLATE_FILE, template.source)
    atomic.write_text(config_path, json.dumps(config, indent=2, ensure_ascii=False) + "\n")
