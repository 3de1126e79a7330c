"""The figures README.md and docs/*.md quote from a command's output, each beside the
command that prints it and the tolerance it is held to (:data:`FIGURES`, read by
:mod:`harness.tools.docs_run`).

A figure is a regular expression on the page (its groups: the quoted values) and one on
the output of the first command run matching ``command`` (its groups: the fresh values;
the page's own expression by default), a command of that page or of a page in ``also``
(the README, whose run a page repeats or reads). Numbers agree when the fresh one rounds to
the quoted one at the quoted precision, or lies within ``tolerance`` (relative) of it
(:data:`RUN` for a training run's or a plan's); text agrees when equal. Figures of a
machine (seconds, tokens/s) are not checked here: the README states once on which machine
they were measured.
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

    def label(self) -> str:
        return f"{self.page}: {self.quoted[:60]}"


def agrees(quoted: str, fresh: str, tolerance: float) -> bool:
    """Whether a fresh value is the quoted one (numbers: rounded to the quoted precision,
    or within ``tolerance`` relative; text: equal)."""
    if not (NUMBER.fullmatch(quoted) and NUMBER.fullmatch(fresh)):
        return quoted == fresh
    q, f = float(quoted.replace(",", "")), float(fresh.replace(",", ""))
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
    ok = all(agrees(q, f, figure.tolerance) for q, f in zip(quoted, fresh, strict=True))
    return Check(figure, quoted, fresh, ok)


def check_figures(texts: dict[str, str], results, figures) -> list[Check]:
    """Every figure whose command ran (``texts``: page -> its text)."""
    checks = (check_figure(f, texts[f.page], results) for f in figures)
    return [c for c in checks if c is not None]


_F = r"([\d.]+)"
_S = r"(?s:.*?)"  # across lines
_SFT = r"posttrain sft$"
_DISTILL = r"posttrain distill$"
# Training and plans are deterministic on CPU: a figure moves only when the code, the
# upstreams or the CPU's rounding do. RUN: 0.2% for another CPU's float rounding; a changed
# figure (GRPO's eval 0.343 -> 0.342 is 0.3%) is off.
RUN = 0.002

FIGURES: tuple[Figure, ...] = (
    # README 2: the default SFT run
    Figure(
        "README.md",
        _SFT,
        r"model qwen3-tiny: ([\d,]+) params, [\d,]+ trained; ([\d,]+) rows of (\d+)",
    ),
    Figure("README.md", _SFT, rf"step 6: loss {_F}, grad_norm {_F}", tolerance=RUN),
    Figure("README.md", _SFT, rf"steps 1-60: loss {_F} -> {_F} \(perplexity {_F}\)", tolerance=RUN),
    # README 3: the default chat answer (greedy), and the vision run's
    Figure("README.md", r"generate --chat", r"^(n te te te[ te]*)$"),
    Figure(
        "README.md",
        r"sft --vision",
        rf"held-out accuracy {_F} -> {_F}",
        rf"held-out answers .*accuracy {_F} -> {_F}",
        tolerance=RUN,
    ),
    Figure("README.md", r"generate .*--image", r"picture\?\"\s+# (.+)$", r"^(A .+\.)$"),
    # README 4
    Figure(
        "README.md",
        r"posttrain dpo",
        rf"steps 1-40: loss {_F} -> {_F}, preference accuracy {_F}, margin {_F}",
        tolerance=RUN,
    ),
    Figure(
        "README.md",
        r"posttrain dpo",
        rf"held-out \((\d+) pairs\): preference accuracy {_F} -> {_F}, reward margin {_F} -> {_F}",
        tolerance=RUN,
    ),
    Figure(
        "README.md",
        r"posttrain grpo$",
        rf"steps 1-150: reward {_F} -> {_F}; eval reward .*?{_F} -> {_F}",
        tolerance=RUN,
    ),
    Figure(
        "README.md",
        _DISTILL,
        rf"held-out KL to the teacher falls {_F} -> {_F}",
        rf"held-out KL to the teacher {_F} -> {_F}",
        tolerance=RUN,
    ),
    # README 5: the plan example's row of the seeds' table, and the chip's HBM
    Figure(
        "README.md",
        r"posttrain plan --model llama3-70b",
        r"\| the same, remat full \| [^|]+\| ([\d.]+) GiB \| fits "
        r"\(step estimate ([\d.]+) ms.*?MFU ([\d.]+)%",
        rf"peak per device +{_F} GiB{_S}step estimate +{_F} ms{_S}MFU \(estimated\) +{_F}%",
        tolerance=RUN,
    ),
    Figure(
        "README.md",
        r"posttrain plan --model llama3-70b",
        rf"a v5p chip's {_F} GiB HBM",
        rf"HBM per chip +{_F} GiB",
    ),
    # docs/distill.md: the teacher runs/sft's (the page's first command, or the README's
    # run). The default run's figures are its first run's: the README's after the README
    # (the page's own then resumes it and trains nothing), else the page's.
    Figure(
        "docs/distill.md",
        _DISTILL,
        r"^\| `posttrain distill` \(T 1, alpha 0\.5: the defaults\) \| ([\d,]+), ([\d,]+) \| "
        rf"{_F} -> {_F} \|$",
        rf": ([\d,]+) params, ([\d,]+) trained;{_S}held-out KL to the teacher {_F} -> {_F}$",
        tolerance=RUN,
        also=("README.md",),
    ),
    Figure(
        "docs/distill.md",
        r"--lora-rank 8 --output runs/distill-lora$",
        r"^\| LoRA r8, T 2, alpha 0\.5 \(`runs/distill-lora`\) \| ([\d,]+), ([\d,]+) \| "
        rf"{_F} -> {_F} \|$",
        rf": ([\d,]+) params, ([\d,]+) trained;{_S}held-out KL to the teacher {_F} -> {_F}$",
        tolerance=RUN,
    ),
    *(
        Figure(
            "docs/distill.md",
            command,
            rf"^\| {row} \| {_F} \| {_F} -> {_F} \|$",
            rf"^step 40: loss [\d.]+, (?:kl [\d.]+, )?task {_F},{_S}"
            rf"held-out KL to the teacher {_F} -> {_F}$",
            tolerance=RUN,
            also=("README.md",) if command == _DISTILL else (),
        )
        for row, command in (
            (r"logit \(T 1: the default run, first block\)", _DISTILL),
            ("feature-pooling", "--strategy feature-pooling "),
            ("attention-transfer", "--strategy attention-transfer "),
            ("feature-projection", "--strategy feature-projection "),
        )
    ),
    Figure(
        "docs/distill.md",
        "--strategy feature-projection ",
        r"`\[1, 72\] -> \[2, 72\]`: ([\d,]+) parameters trained with it",
        r": ([\d,]+) params, [\d,]+ trained;",
    ),
    # docs/generation.md: the benchmark's cache (its speeds are the machine's)
    Figure(
        "docs/generation.md",
        r"benchmarks/generate\.py",
        r"cache: ([\d,]+) bytes \((\d+) x (\d+) slots, (\d+) layers",
    ),
    # docs/sharding.md: a mesh the model cannot use (the gate runs this page)
    Figure(
        "docs/sharding.md",
        r"forward --mesh tensor=8",
        r"^(posttrain: error: num_kv_heads=\d+ is not divisible by mesh axes tensor=8)$",
    ),
)
