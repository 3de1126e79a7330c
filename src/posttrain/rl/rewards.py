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
    except SyntaxError as err:  # the user's file, named with its line
        raise ValueError(
            f"reward {spec!r}: module {module_name!r} has a syntax error ({err.msg}, "
            f"{err.filename} line {err.lineno})"
        ) from None
    except (Exception, SystemExit) as err:  # its top level raised or exited
        raise ValueError(
            f"reward {spec!r}: importing module {module_name!r} {_what_went_wrong(err)}"
        ) from None
    fn = getattr(module, name, None)
    if fn is None:
        raise ValueError(f"reward {spec!r}: module {module_name!r} has no {name!r}")
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: {name!r} is not callable")
    return fn


def recorded(fn: Callable, sink: Callable[[str, np.ndarray], None]) -> Callable:
    """``fn`` that also hands ``(fn.__name__, rewards)`` to ``sink`` on train calls.

    Raises:
      RewardError: ``fn`` raised, called ``sys.exit``, or returned something other than
        one finite number per completion (named, with what it returned).
    """

    @functools.wraps(fn)
    def call(prompts, completions, **kwargs):
        try:
            out = fn(prompts=prompts, completions=completions, **kwargs)
        except (Exception, SystemExit) as err:  # the run stops with one line, not silently
            raise RewardError(f"reward {fn.__name__} {_what_went_wrong(err)}") from None
        values = checked_values(fn.__name__, out, len(completions))
        if str(kwargs.get("mode", "train")).lower().endswith("train"):
            sink(fn.__name__, values)
        return out

    return call


class RewardError(ValueError):
    """A reward function raised, exited or returned something other than one finite
    number per completion."""


def _what_went_wrong(err: BaseException) -> str:
    if isinstance(err, SystemExit):
        return f"called sys.exit({err.code!r})"
    first = str(err).strip().splitlines()
    return f"raised {type(err).__name__}" + (f": {first[0]}" if first else "")


def checked_values(name: str, out, completions: int) -> np.ndarray:
    """``out``, what reward ``name`` returned for ``completions`` completions, as float64
    ``[completions]``.

    Raises:
      RewardError: not a sequence of ``completions`` real numbers (a string, a bool or
        None among them included), or one not finite; naming what it was.
    """
    items = list(out) if isinstance(out, list | tuple | np.ndarray) else None
    if items is None:
        raise RewardError(
            f"reward {name} returned {type(out).__name__}; expected a list of "
            f"{completions} floats, one per completion"
        )
    wrong = next(
        (
            x
            for x in items
            if isinstance(x, bool | np.bool_) or not isinstance(x, int | float | np.number)
        ),
        None,
    )
    if wrong is not None or (isinstance(out, np.ndarray) and out.ndim != 1):
        what = type(wrong).__name__ if wrong is not None else f"a {out.ndim}-d array"
        raise RewardError(f"reward {name} returned {what} values; expected floats")
    values = np.asarray(items, dtype=np.float64).reshape(-1)
    if values.shape != (completions,):
        raise RewardError(
            f"reward {name} returned {values.shape[0]} values for {completions} completions"
        )
    if not np.isfinite(values).all():
        bad = values[~np.isfinite(values)][0]
        raise RewardError(f"reward {name} returned {bad} (expected finite values)")
    return values


def probe(spec: str, fn: Callable) -> None:
    """Calls reward ``fn`` (``spec``) once on a probe batch as Tunix would (two prompts
    of the embedded task, one completion right and one not, their ``answer`` column,
    ``mode="train"``): a run refuses a reward that raises, exits or returns the wrong
    thing before it writes anything.

    Raises:
      ValueError: one line naming ``spec`` (module and function) and what was wrong.
    """
    from posttrain.rl.arithmetic import problems

    batch = problems()[:2]
    completions = [str(batch[0].answer), "no"]
    try:
        out = fn(
            prompts=[p.prompt for p in batch],
            completions=completions,
            answer=[p.answer for p in batch],
            mode="train",
        )
    except (Exception, SystemExit) as err:
        raise ValueError(f"reward {spec!r} on a probe batch {_what_went_wrong(err)}") from None
    try:
        checked_values(getattr(fn, "__name__", spec), out, len(completions))
    except RewardError as err:
        raise ValueError(f"reward {spec!r} on a probe batch of 2 completions: {err}") from None
