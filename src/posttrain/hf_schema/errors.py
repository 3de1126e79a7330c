"""The one exception type of HF <-> native conversion (:mod:`posttrain.conversion` raises
it too, through :mod:`posttrain.conversion.errors`)."""

from __future__ import annotations


class ConversionError(ValueError):
    """A checkpoint or config cannot be converted.

    The message is one line naming the tensor, file or config field and what
    was expected (the CLI prints it and exits with status 2).
    """
