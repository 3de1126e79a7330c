"""The matrix report's "fits" section: the seed's scale configurations, each compiled for
its TPU slice by ``posttrain plan`` (libtpu on CPU, the tpu extra), one row each.

The rows are real plans' results, written to ``reports/plan-fits.json`` by
``python -m harness.report.fits`` (minutes per configuration on two cores; the weekly job runs it
under ``tox -e aot``; ``--only NAME`` runs one and keeps the other rows). The report reads
that file; a configuration without a row is shown as not run, with the command that runs
it. :data:`SEEDS` is the one list of the configurations (``tests/test_plan_seeds.py``
asserts their verdicts and figures).

Row (JSON object): ``name``, ``what`` (the plan's description), ``topology``, ``verdict``
(one of :data:`VERDICTS`), ``expected`` (the seed's), ``peak_bytes``, ``hbm_bytes``,
``headroom`` (``null`` when refused), ``stage`` (a workflow's tightest program),
``compile_seconds``, ``floor_seconds``, ``estimate_seconds``, ``mfu``, ``line`` (the
compiler's refusal), ``measured`` (UTC date), ``machine``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import re
import sys
import time
from pathlib import Path
from typing import Any

from posttrain import atomic
from posttrain.plan import DoesNotFit, PlanOptions, get_topology, plan

FITS_NAME = "plan-fits.json"
VERDICTS = ("fits", "does not fit", "refused")
"""``fits``: the compiler accepted it and its peak is within HBM; ``does not fit``: accepted,
peak over HBM; ``refused``: the compiler rejected it for lack of HBM."""


@dataclasses.dataclass(frozen=True)
class Seed:
    """One seed configuration: ``options`` are :class:`posttrain.plan.PlanOptions` fields;
    ``expected`` the verdict the seed's history says (one of :data:`VERDICTS`)."""

    name: str
    options: dict[str, Any]
    expected: str
    history: str


_QWEN_MESH = {"tensor": 4, "fsdp": 2, "expert": 2}
SEEDS: tuple[Seed, ...] = (
    Seed(
        "qwen3-30b-a3b lora sft",
        dict(
            model="qwen3_moe-30b-a3b",
            topology="v5p-32",
            mesh=_QWEN_MESH,
            lora_rank=16,
            batch=16,
            seq=2048,
        ),
        "fits",
        "re-meshed onto v5p-32 at tensor=4, fsdp=2, expert=2",
    ),
    Seed(
        "qwen3-30b-a3b lora grpo",
        dict(
            model="qwen3_moe-30b-a3b",
            topology="v5p-32",
            mesh=_QWEN_MESH,
            workflow="grpo",
            lora_rank=16,
            batch=16,
            seq=1024,
            new_tokens=1024,
        ),
        "fits",
        "GRPO on the same mesh",
    ),
    Seed(
        "llama3.1-70b sft remat none",
        dict(model="llama3-70b", topology="v5p-128", remat="none", seq=2048),
        "refused",
        "ran out of memory until remat_policy=full",
    ),
    Seed(
        "llama3.1-70b sft remat full",
        dict(model="llama3-70b", topology="v5p-128", remat="full", seq=2048),
        "fits",
        "fits with remat_policy=full",
    ),
    Seed(
        "llama3.1-70b lora sft fsdp=64",
        dict(model="llama3-70b", topology="v5p-128", mesh={"fsdp": 64}, lora_rank=16),
        "fits",
        "LoRA's dummy inputs raised IndivisibleError at fsdp=64",
    ),
    Seed(
        "gpt-oss-20b lora sft",
        dict(model="gpt_oss-20b", topology="v5p-8", lora_rank=16, seq=2048),
        "fits",
        "needed its hard-coded fsdp=64 removed to auto-shard on v5p-8",
    ),
    Seed(
        "gpt-oss-20b rollout",
        dict(model="gpt_oss-20b", topology="v5p-8", workflow="generate", seq=1024, new_tokens=256),
        "fits",
        "rollout at tensor=1",
    ),
    Seed(
        "llama3.1-70b unsharded on one v5e",
        dict(model="llama3-70b", topology="v5e-1", seq=512),
        "refused",
        "cannot fit (the plan's own check)",
    ),
)


def seed(name: str) -> Seed:
    """The seed ``name``.

    Raises:
      ValueError: no such seed (naming the known ones).
    """
    for s in SEEDS:
        if s.name == name:
            return s
    raise ValueError(f"unknown seed {name!r}; expected one of {', '.join(s.name for s in SEEDS)}")


def row_of(s: Seed, record: dict | None = None, refused: str | None = None) -> dict[str, Any]:
    """The report row of seed ``s`` from its plan's JSON record (``Plan.record()``, what
    ``posttrain plan --json`` writes), or from the compiler's refusal line ``refused``."""
    row: dict[str, Any] = {
        "name": s.name,
        "topology": s.options["topology"],
        "expected": s.expected,
        "hbm_bytes": get_topology(s.options["topology"]).hbm_bytes,
        "measured": time.strftime("%Y-%m-%d", time.gmtime()),
        "machine": f"{platform.machine()}, {platform.python_version()}",
    }
    if record is None:
        return {**row, "verdict": "refused", "what": "", "line": refused, "headroom": None}
    stages = record.get("stages") or {"": record}
    return {
        **row,
        "what": record["what"],
        "verdict": "fits" if record["fits"] else "does not fit",
        "peak_bytes": max(x["peak_bytes"] for x in stages.values()),
        "headroom": record["headroom"],
        "stage": record.get("stage", ""),
        "compile_seconds": sum(x["compile_seconds"] for x in stages.values()),
        "floor_seconds": record["floor_seconds"],
        "estimate_seconds": record["estimate_seconds"],
        "mfu": record["mfu"],
        "line": None,
    }


def run(s: Seed) -> dict[str, Any]:
    """Plans seed ``s`` (minutes) and returns its row."""
    try:
        return row_of(s, plan(PlanOptions(**s.options)).record())
    except DoesNotFit as e:
        return row_of(s, refused=str(e))


def load(report_dir: Path) -> list[dict[str, Any]] | None:
    """The rows in ``report_dir/plan-fits.json`` (None when there is no file).

    Raises:
      ValueError: the file is not a list of rows (one line naming it and the first bad row).
    """
    path = Path(report_dir) / FITS_NAME
    if not path.is_file():
        return None
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not a fits file ({error})") from None
    if not isinstance(rows, list):
        raise ValueError(f"{path} is not a fits file (a {type(rows).__name__}; expected a list)")
    for i, r in enumerate(rows):
        if not isinstance(r, dict) or not isinstance(r.get("name"), str):
            raise ValueError(f"{path}: row {i} is {r!r}; expected an object with a name")
        if r.get("verdict") not in VERDICTS:
            raise ValueError(
                f"{path}: row {i} ({r['name']}) has verdict {r.get('verdict')!r}; "
                f"expected one of {', '.join(VERDICTS)}"
            )
    return rows


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / (1 << 30):.2f} GiB"


_OVERFLOW = re.compile(r"temporaries \(([\d.]+\w)\) exceeds available HBM \(([\d.]+\w)\)")


def _refusal(line: str) -> str:
    """The compiler's reason in a refusal line: its figures where libtpu's wording gives
    them (``RESOURCE_EXHAUSTED: 215.39G of temporaries > 95.74G of HBM``), else its words
    from the first parenthesis (90 characters)."""
    found = _OVERFLOW.search(line)
    if found:
        return f"RESOURCE_EXHAUSTED: {found[1]} of temporaries > {found[2]} of HBM"
    return line.split(" (", 1)[-1][:90]


def markdown_lines(rows: list[dict[str, Any]] | None) -> list[str]:
    """The section's Markdown: one line per seed in :data:`SEEDS` order; a row whose
    verdict is not the expected one is marked, a seed without a row is "not run"."""
    by_name = {r["name"]: r for r in rows or []}
    out = [
        "| configuration | slice | verdict | peak per device | HBM | headroom | compile | "
        "measured |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in SEEDS:
        r = by_name.get(s.name)
        if r is None:
            out.append(
                f"| {s.name} | {s.options['topology']} | not run: `python -m harness.report.fits "
                f"--only '{s.name}'` | | | | | |"
            )
            continue
        verdict = r["verdict"] + ("" if r["verdict"] == s.expected else f" ⚠ expected {s.expected}")
        if r["verdict"] == "refused":
            verdict += f" ({_refusal(r.get('line') or '')})"
        elif r.get("stage"):
            verdict += f" (tightest: {r['stage']})"
        seconds = r.get("compile_seconds")
        out.append(
            f"| {s.name} | {r['topology']} | {verdict} | {_gib(r.get('peak_bytes'))} | "
            f"{_gib(r['hbm_bytes'])} | {_gib(r.get('headroom'))} | "
            f"{'-' if seconds is None else f'{seconds:.0f} s'} | {r['measured']} |"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m harness.report.fits [--only NAME ...] [--report-dir reports]``: plans the
    seeds and writes their rows (the others kept); exit 1 when a verdict is not the
    expected."""
    p = argparse.ArgumentParser(
        prog="python -m harness.report.fits", description=__doc__.split("\n")[0]
    )
    p.add_argument("--only", action="append", default=None, help="a seed name (repeatable)")
    p.add_argument("--report-dir", type=Path, default=Path("reports"))
    args = p.parse_args(argv)
    try:
        chosen = [seed(n) for n in args.only] if args.only else list(SEEDS)
        kept = {r["name"]: r for r in load(args.report_dir) or []}
    except ValueError as e:
        p.error(str(e))
    for s in chosen:
        kept[s.name] = run(s)
        print(f"{s.name}: {kept[s.name]['verdict']}", flush=True)
    order = [s.name for s in SEEDS]
    rows = sorted(kept.values(), key=lambda r: order.index(r["name"]) if r["name"] in order else 99)
    args.report_dir.mkdir(parents=True, exist_ok=True)
    atomic.write_text(args.report_dir / FITS_NAME, json.dumps(rows, indent=2) + "\n")
    return 1 if any(kept[s.name]["verdict"] != s.expected for s in chosen) else 0


if __name__ == "__main__":
    sys.exit(main())
