"""The checks of the conversion package's inputs; its one exception type,
:class:`ConversionError`, is :mod:`posttrain.hf_schema`'s (the rows and transforms raise it too)."""

from __future__ import annotations

import json
import pathlib
from typing import Any

from posttrain.hf_schema.errors import ConversionError

__all__ = ["ConversionError", "check_source_dir", "read_json_object"]


def check_source_dir(directory: pathlib.Path) -> None:
    """Raises :class:`ConversionError` unless ``directory`` is an existing directory."""
    if not directory.exists():
        raise ConversionError(f"source {directory} does not exist")
    if not directory.is_dir():
        raise ConversionError(f"source {directory} is a file; expected a checkpoint directory")


def read_json_object(path: pathlib.Path) -> dict[str, Any]:
    """The JSON object stored in ``path``.

    Raises:
      ConversionError: ``path`` is missing, a directory or unreadable, is not valid JSON
        (undecodable bytes included), or holds something other than an object.
    """
    if path.is_dir():
        raise ConversionError(f"{path} is a directory; expected a JSON file")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConversionError(f"{path} does not exist") from None
    except OSError as error:
        raise ConversionError(f"{path}: {error.strerror or error}") from None
    except UnicodeDecodeError as error:
        raise ConversionError(
            f"{path}: not UTF-8 text ({error.reason} at byte {error.start})"
        ) from None
    try:
        body = json.loads(text)
    except (ValueError, RecursionError) as error:
        raise ConversionError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(body, dict):
        raise ConversionError(f"{path}: expected a JSON object, got {type(body).__name__}")
    return body
