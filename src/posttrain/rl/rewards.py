"""Reward functions: the built-ins, selectable by name, and a user's by ``module:function``.

Tunix calls each one as ``fn(prompts=[str], completions=[str], **kwargs)`` and expects
one float per completion (``shared/research/tunix-rl.md`` 2.7). ``kwargs`` are exactly
what the installed release passes, untouched: every dataset column other than
``prompts`` (here ``answer``), ``mode`` (``"train"`` / ``"eval"``), ``trajectory_ids``
and, from google-tunix 0.1.6, any ``algo_config`` field whose name is one of the
function's parameters. So a function should take ``**kwargs``.

The metric name Tunix gives a reward is ``rewards/<fn.__name__>``; :func:`recorded` keeps
the name and the signature (``functools.wraps``), which 0.1.6+ inspects.
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Callable, Sequence

import numpy as np

_INTEGER = re.compile(r"^\s*(-?\d+)\s*$")


def _parse(completion: str) -> int | None:
    match = _INTEGER.match(completion)
    return int(match.group(1)) if match else None


def exact_answer(prompts: Sequence[str], completions: Sequence[str], answer, **kwargs):
    """1.0 where the completion is exactly the integer ``answer`` (surrounding whitespace
    allowed), else 0.0. ``answer``: the dataset column, one int per completion."""
    return [1.0 if _parse(c) == int(a) else 0.0 for c, a in zip(completions, answer, strict=True)]


def answer_format(prompts: Sequence[str], completions: Sequence[str], **kwargs):
    """0.25 where the completion is a bare integer (the answer's format), else 0.0."""
    return [0.25 if _parse(c) is not None else 0.0 for c in completions]


BUILTIN: dict[str, Callable] = {"exact_answer": exact_answer, "answer_format": answer_format}
DEFAULT = ("exact_answer", "answer_format")


def resolve(spec: str) -> Callable:
    """The reward function named ``spec``: a built-in (:data:`BUILTIN`) or
    ``module:function`` (imported).

    Raises:
      ValueError: naming ``spec`` and what is wrong (unknown name, import failure,
        missing attribute, not callable).
    """
    if spec in BUILTIN:
        return BUILTIN[spec]
    if ":" not in spec:
        raise ValueError(
            f"reward {spec!r}: expected a built-in ({', '.join(BUILTIN)}) or module:function"
        )
    module_name, _, name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"reward {spec!r}: cannot import {module_name!r} ({err})") from None
    fn = getattr(module, name, None)
    if fn is None:
        raise ValueError(f"reward {spec!r}: module {module_name!r} has no {name!r}")
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: {name!r} is not callable")
    return fn


def recorded(fn: Callable, sink: Callable[[str, np.ndarray], None]) -> Callable:
    """``fn`` that also hands ``(fn.__name__, rewards)`` to ``sink`` on train calls.

    Raises:
      ValueError: ``fn`` returned something other than one finite number per completion
        (named, with what it returned).
    """

    @functools.wraps(fn)
    def call(prompts, completions, **kwargs):
        out = fn(prompts=prompts, completions=completions, **kwargs)
        try:
            values = np.asarray(out, dtype=np.float64).reshape(-1)
        except (TypeError, ValueError):
            raise ValueError(f"reward {fn.__name__} returned {type(out).__name__}") from None
        if values.shape != (len(completions),) or not np.isfinite(values).all():
            raise ValueError(
                f"reward {fn.__name__} returned {values.shape[0]} values "
                f"(finite: {bool(np.isfinite(values).all())}) for {len(completions)} completions"
            )
        if str(kwargs.get("mode", "train")).lower().endswith("train"):
            sink(fn.__name__, values)
        return out

    return call
