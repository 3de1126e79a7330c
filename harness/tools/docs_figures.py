"""The figures README.md and docs/*.md quote from a command's output, each beside the
command that prints it and the tolerance it is held to (:data:`FIGURES`, read by
:mod:`harness.tools.docs_run`; checked by :mod:`harness.tools.figure_checks`).

A figure is a regular expression on the page (its groups: the quoted values) and one on
the output of the first command run matching ``command`` (its groups: the fresh values;
the page's own expression by default), a command of that page or of a page in ``also``
(the README, whose run a page repeats or reads). Numbers agree when the fresh one rounds to
the quoted one at the quoted precision, or lies within ``tolerance`` (relative) of it
(:data:`RUN` for a training run's or a plan's); text agrees when equal. Figures of a
machine (seconds, tokens/s, ratios of times) are not checked here: the README states once
on which machine they were measured; a figure measured on a lent chip names its command
and date on its page instead. docs/scale.md's seed rows are read cell by cell
(:func:`_row`), its fits section against the committed ``reports/plan-fits.json``.
"""

from __future__ import annotations

import re

from harness.tools.figure_checks import Figure

_F = r"([\d.]+)"
_S = r"(?s:.*?)"  # across lines
_SFT = r"posttrain sft$"
_DISTILL = r"posttrain distill$"
# Training and plans are deterministic on CPU: a figure moves only when the code, the
# upstreams or the CPU's rounding do. RUN: 0.2% for another CPU's float rounding; a changed
# figure (GRPO's eval 0.343 -> 0.342 is 0.3%) is off.
RUN = 0.002

_U = r"([\d.]+) ([KMG]iB)"  # a size and its unit
_E = r"([\d.]+e\+?\d+)"  # FLOPs: 2.35e13 quoted, 2.353e+13 printed


def _row(page: str, command: str, label: str, cells, also: tuple[str, ...] = ()) -> tuple:
    """A table row's figures (``label``: how its first cell starts), each cell
    ``(column, its pattern, the pattern of the output line that prints it)``, its columns
    counted from 1; held to :data:`RUN`."""
    return tuple(
        Figure(
            page,
            command,
            rf"^\| {label}[^|]*\|(?:[^|]*\|){{{column - 2}}} {cell} \|",
            printed,
            tolerance=RUN,
            also=also,
        )
        for column, cell, printed in cells
    )


# docs/scale.md's seed table: the columns a plan's table prints (one program: SFT)
_PLAN_CELLS = (
    (3, _U, rf"^  parameters +{_U}$"),
    (4, _U, rf"^  optimizer state +{_U}$"),
    (5, _U, rf"^  gradients +{_U}$"),
    (6, _U, rf"^arguments \(compiled\) +{_U}$"),
    (7, _U, rf"^temporaries \(compiled\) +{_U}$"),
    (8, _U, rf"^peak per device +{_U}$"),
    (9, _U, rf"^headroom +{_U}$"),
    (12, _E, rf"^FLOPs per device +{_E} "),
    (13, rf"{_F} ms, (\w+)-bound", rf"^step estimate +{_F} ms \((\w+)-bound"),
    (14, rf"{_F}%", rf"^MFU \(estimated\) +{_F}%$"),
)
_STAGES = rf"{_U} \| {_U} \| {_U}$"  # rollout | reference forward | train step
_KINDS = ((3, "parameters"), (4, "optimizer state"), (5, "gradients"))
_GRPO_CELLS = (
    *((c, _U, rf"^  {kind} +.*\| {_U}$") for c, kind in _KINDS),
    (6, rf"{_U} \(step\)", rf"^arguments \(compiled\) +.*\| {_U}$"),
    (7, rf"rollout {_U}, reference {_U}, step {_U}", rf"^temporaries \(compiled\) +{_STAGES}"),
    (8, rf"rollout {_U}, reference {_U}, step {_U} \([^)]*\)", rf"^peak per device +{_STAGES}"),
    (8, rf"[^|]*KV cache {_U}\)", rf"^  KV cache +{_U} \|"),
    (9, rf"{_U} \(step\)", rf"^headroom +{_U} \(train step\)$"),
    (
        12,
        rf"rollout {_E}, reference {_E}, step {_E}",
        rf"^FLOPs per device +{_E} [^|]*\| {_E} [^|]*\| {_E} ",
    ),
    *_PLAN_CELLS[-2:],
)
_QWEN = r"--mesh tensor=4,fsdp=2,expert=2 "
_SCALE_SFT = _QWEN + r"--lora-rank 16 --batch 16 --seq 2048 --json scratch/plan\.json$"
_SCALE_GRPO = _QWEN + r"--workflow grpo --lora-rank 16 --batch 16 --seq 1024 --new-tokens 1024$"
_FITS = r"fits\.markdown_lines\(fits\.load\('reports'\)\)"  # the section from the committed file
_SEEDS = (  # harness.report.fits.SEEDS' names (tools import no report)
    "qwen3-30b-a3b lora sft",
    "qwen3-30b-a3b lora grpo",
    "llama3.1-70b sft remat none",
    "llama3.1-70b sft remat full",
    "llama3.1-70b lora sft fsdp=64",
    "gpt-oss-20b lora sft",
    "gpt-oss-20b rollout",
    "llama3.1-70b unsharded on one v5e",
)


def _fits_line(seed: str, peak: str = _U, headroom: str = _U) -> str:
    """The pattern of seed ``seed``'s line in the fits section: its peak and headroom."""
    return rf"^\| {re.escape(seed)} \| [^|]+\| [^|]+\| {peak} \| [^|]+\| {headroom} \|"


def _refused(seed: str, hbm: str = r"([\d.]+)") -> str:
    """The pattern of a refused seed's line in the fits section: temporaries > HBM."""
    return rf"^\| {re.escape(seed)} \|.*RESOURCE_EXHAUSTED: ([\d.]+)G of temporaries > {hbm}G"


_SCALE: tuple[Figure, ...] = (
    *_row("docs/scale.md", _SCALE_SFT, r"Qwen3-30B-A3B SFT LoRA r16", _PLAN_CELLS),
    *_row("docs/scale.md", _SCALE_GRPO, r"Qwen3-30B-A3B GRPO LoRA r16", _GRPO_CELLS),
    Figure(
        "docs/scale.md",
        _SCALE_GRPO,
        r"own `lora_b` \(([\d.]+) MiB\); the step holds the reference's zeroed\s+`lora_b` "
        r"beside it \(([\d.]+) MiB\)",
        rf"^held outside it +{_F} MiB \| [\d.]+ MiB \| {_F} MiB$",
        tolerance=RUN,
    ),
    # the README's example: its command prints the whole row
    *_row(
        "docs/scale.md",
        r"posttrain plan --model llama3-70b",
        r"Llama 3\.1 70B full SFT, 64 x 2048, remat full",
        _PLAN_CELLS,
        also=("README.md",),
    ),
    # the plan's estimate against the v5e's steps, line by line (tests/plan_chip_table.py):
    # rows whose sixth cell is the left-out error (the table of the sixth session, quoted
    # above it without its command, has the bound there)
    *(
        Figure(
            "docs/scale.md",
            r"tests\.plan_chip_table",
            rf"^(\| {re.escape(o)} \|(?: [^|]* \|){{4}} [+-][\d.]+% \| \w+ \|)$",
        )
        for o in (
            "--per-device-batch-size 4 --seq 2048 --remat full",
            "--per-device-batch-size 2 --seq 2048 --remat full",
            "--lora-rank 16 --per-device-batch-size 4 --seq 2048 --remat full",
            "--seq 2048 --per-device-batch-size 4 --attention-kernel splash --remat save_dots",
            "--seq 2048 --per-device-batch-size 4 --remat full",
            "--per-device-batch-size 8 --seq 1024 --remat full --lora-rank 16",
            "--per-device-batch-size 8 --seq 1024 --remat full",
            "--per-device-batch-size 8 --seq 1024 --remat save_dots --attention-kernel splash",
            *(
                f"--seq 1024 --lora-rank 0 --remat {o}"
                for o in (
                    "full --per-device-batch-size 8 --attention-kernel splash",
                    "full --per-device-batch-size 8",
                    "full --per-device-batch-size 16 --attention-kernel splash",
                    "none --per-device-batch-size 4 --attention-kernel splash",
                    "save_dots --per-device-batch-size 4",
                )
            ),
        )
    ),
    Figure(
        "docs/scale.md",
        r"tests\.plan_chip_table",
        r"^(v5e: flop_efficiency [\d.]+, hbm_share [\d.]+)$",
    ),
    Figure(
        "docs/scale.md",
        r"tests\.plan_chip_table",
        r"fitted the same way: ([\d.]+) and ([\d.]+), worst ([\d.]+)%; each left out: "
        r"worst ([\d.]+)%",
    ),
    # the fits section as the committed file has it, line by line
    *(Figure("docs/scale.md", _FITS, rf"^(\| {re.escape(s)} \| .*)$") for s in _SEEDS),
    *(
        Figure(
            "docs/scale.md",
            _FITS,
            rf"^\| {label}[^|]*\|(?:[^|]*\|){{6}} {_U} \| {_U} \|",
            _fits_line(seed),
        )
        for label, seed in (
            (r"Llama 3\.1 70B full SFT, 64 x 2048, remat full", "llama3.1-70b sft remat full"),
            (r"Llama 3\.1 70B SFT LoRA r16", "llama3.1-70b lora sft fsdp=64"),
            (r"GPT-OSS-20B SFT LoRA r16", "gpt-oss-20b lora sft"),
            (r"GPT-OSS-20B rollout", "gpt-oss-20b rollout"),
        )
    ),
    *(
        Figure(
            "docs/scale.md",
            _FITS,
            rf"^\| {label}[^|]*\|(?:[^|]*\|){{5}} ([\d.]+) GB \(compiler\) \|",
            _refused(seed, hbm=r"[\d.]+"),
        )
        for label, seed in (
            (r"Llama 3\.1 70B full SFT, 64 x 2048, remat none", "llama3.1-70b sft remat none"),
            (r"Llama 3\.1 70B full SFT unsharded", "llama3.1-70b unsharded on one v5e"),
        )
    ),
    Figure(
        "docs/scale.md",
        _FITS,
        r"HLO temporaries \(([\d.]+)G\) exceeds available\s+HBM \(([\d.]+)G\)",
        _refused("llama3.1-70b sft remat none"),
    ),
    Figure(
        "docs/scale.md",
        _FITS,
        r"compiler refuses it\) and peaks at ([\d.]+) GiB with remat full",
        _fits_line("llama3.1-70b sft remat full", _F + " GiB", r"[\d.]+ GiB"),
    ),
    Figure(
        "docs/scale.md",
        _FITS,
        r"remat full fits with\s+([\d.]+) GiB to spare",
        _fits_line("llama3.1-70b sft remat full", r"[\d.]+ GiB", _F + " GiB"),
    ),
)

# docs/benchmarks.md: what its fenced commands print besides the machine's times and ratios
_MODEL_STEP = r"benchmarks/model_step\.py$"
_GRAD_DIFF = r"max \|grad diff\| ([\d.]+e-\d+)"  # model_ab.py's new form against the old
_BENCHMARKS: tuple[Figure, ...] = tuple(
    Figure("docs/benchmarks.md", command, quoted, printed, tolerance)
    for command, quoted, printed, tolerance in (
        (
            _MODEL_STEP,
            r"before each run; ([\d,]+)\s+parameters:",
            r"^qwen3: ([\d,]+) parameters",
            0,
        ),
        (_MODEL_STEP, r"against ([\d.]+) model GFLOP\)", r"\(([\d.]+) model GFLOP;", RUN),
        (
            r"distill_step\.py --devices 1 ",
            r"^(\S+) one layer deep from (\S+) \((\d+) layers\), batch (\d+) x (\d+),",
            r"^student (\S+) \(1 layers\), teacher (\S+) \((\d+) layers, \w+\), "
            r"batch (\d+) x (\d+),",
            0,
        ),
    )
)
# float32 rounding residues of model_ab.py's forms: bounds, not values (3.73e-9 on one
# machine, 8.85e-9 on another with the same code)
_GRAD_BOUNDS: tuple[Figure, ...] = (
    Figure(
        "docs/benchmarks.md",
        r"--form tokens ",
        r"difference is at most ([\d.]+e-\d+)\s+\(tokens;",
        _GRAD_DIFF,
        bound=True,
    ),
    Figure(
        "docs/benchmarks.md",
        r"--form grouped ",
        r"differ from the scan's by at most ([\d.]+e-\d+)",
        _GRAD_DIFF,
        bound=True,
    ),
)

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
    # docs/testing.md: the chip's committed compile report, read back
    Figure(
        "docs/testing.md",
        r"harness\.gate\.compile_report reports/compile-tpu-v5e\.jsonl --top",
        r"reports/compile-tpu-v5e\.jsonl: (\d+) tests, ([\d.]+) s; XLA compiles ([\d.]+) s"
        r"\s+\((\d+) programs, (\d+) from the cache\)",
    ),
    # ... the chip's selection (collected here) priced from it, and the selection's own run
    Figure(
        "docs/testing.md",
        r"compile-tpu-v5e\.jsonl --tests /tmp/chip-tier\.txt",
        r"--tests /tmp/chip-tier\.txt: (\d+) of its (\d+) tests have a line here \((\d+)\s+none\)",
    ),
    Figure(
        "docs/testing.md",
        r"compile-tpu-v5e\.jsonl --tests /tmp/chip-tier\.txt",
        r"`reports/compile-tpu-v5e\.jsonl: (\d+) tests, ([\d.]+) s; XLA compiles ([\d.]+) s`",
        printed=r"reports/compile-tpu-v5e\.jsonl: (\d+) tests, ([\d.]+) s; XLA compiles ([\d.]+) s",
    ),
    Figure(
        "docs/testing.md",
        r"compile_report reports/compile-tpu-v5e-sampled\.jsonl",
        r"reports/compile-tpu-v5e-sampled\.jsonl: (\d+) tests, ([\d.]+) s; XLA compiles"
        r"\s+([\d.]+) s\s+\((\d+) programs, (\d+) from the cache\)",
    ),
    *_SCALE,
    *_BENCHMARKS,
    *_GRAD_BOUNDS,
)
