"""How a figure quoted in the docs is checked against the output of the command that prints
it: :class:`Figure` (a page's expression, its command's, a tolerance), :func:`agrees` (one
value), :func:`check_figure` and :func:`check_figures` (against the commands
:mod:`harness.tools.docs_run` ran). The figures themselves are
:data:`harness.tools.docs_figures.FIGURES`.
"""

from __future__ import annotations

import dataclasses
import re

NUMBER = re.compile(r"[+-]?\d[\d,]*(\.\d+)?(e[+-]?\d+)?")


@dataclasses.dataclass(frozen=True)
class Figure:
    page: str
    command: str  # a regular expression searched in the command's text (comment left out)
    quoted: str  # a regular expression on the page; its groups are the quoted values
    printed: str | None = None  # one on the command's output (default: ``quoted``)
    tolerance: float = 0.0  # relative, for the numbers
    also: tuple[str, ...] = ()  # other pages whose command may print it (the README's)
    # the quoted numbers are upper bounds: a fresh one at or below its bound agrees (a
    # float32 rounding residue, which differs between CPUs by more than any tolerance)
    bound: bool = False

    def label(self) -> str:
        return f"{self.page}: {self.quoted[:60]}"


def agrees(quoted: str, fresh: str, tolerance: float, *, bound: bool = False) -> bool:
    """Whether a fresh value is the quoted one (numbers: rounded to the quoted precision,
    or within ``tolerance`` relative; with ``bound``, at or below the quoted number; text:
    equal)."""
    if not (NUMBER.fullmatch(quoted) and NUMBER.fullmatch(fresh)):
        return quoted == fresh
    q, f = float(quoted.replace(",", "")), float(fresh.replace(",", ""))
    if bound:
        return f <= q
    digits = len(quoted.partition(".")[2]) if "e" not in quoted.lower() else None
    if digits is not None and round(f, digits) == q:
        return True
    return abs(f - q) <= tolerance * abs(q)


@dataclasses.dataclass(frozen=True)
class Check:
    figure: Figure
    quoted: tuple[str, ...]
    fresh: tuple[str, ...] | None  # None: the command did not run or did not print it
    ok: bool
    why: str = ""

    def line(self) -> str:
        mark = "ok  " if self.ok else "OFF "
        fresh = " / ".join(self.fresh) if self.fresh is not None else self.why
        return f"{mark}{self.figure.label()}: quoted {' / '.join(self.quoted)}, now {fresh}"


def check_figure(figure: Figure, text: str, results) -> Check | None:
    """One figure against the output of the first command run that matches it, on its page
    or on one of ``figure.also`` (``results``: :class:`harness.tools.docs_run.Result`, in
    the order they ran); None when no such command was run."""
    pages = (figure.page, *figure.also)
    ran = [
        r
        for r in results
        if r.command.page in pages and re.search(figure.command, r.command.bare())
    ]
    if not ran:
        return None
    found = re.search(figure.quoted, text, re.M)
    if found is None:
        return Check(figure, (), None, False, "the page no longer quotes it")
    quoted = found.groups()
    printed = re.search(figure.printed or figure.quoted, ran[0].output, re.M)
    if printed is None or len(printed.groups()) != len(quoted):
        return Check(figure, quoted, None, False, "not printed")
    fresh = printed.groups()
    ok = all(
        agrees(q, f, figure.tolerance, bound=figure.bound)
        for q, f in zip(quoted, fresh, strict=True)
    )
    return Check(figure, quoted, fresh, ok)


def check_figures(texts: dict[str, str], results, figures) -> list[Check]:
    """Every figure whose command ran (``texts``: page -> its text)."""
    checks = (check_figure(f, texts[f.page], results) for f in figures)
    return [c for c in checks if c is not None]
