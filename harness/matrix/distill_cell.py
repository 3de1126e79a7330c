"""The matrix's distill cell: one short ``posttrain distill`` run per release entry that has
``tunix.distillation`` (n/a, with the reason, where it does not or the row is emulated)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from harness.matrix.envs import failure

DISTILL_RUN: dict[str, Any] = {
    "model": "qwen3-tiny",
    "teacher": "llama3-tiny",
    "student_layers": 1,
    "lora_rank": 4,
    "grad_accum": 2,
    "steps": 2,
    "max_target_length": 64,
    "save_every": 1,
}
"""The matrix's distillation run, as ``posttrain distill`` options: a preset teacher (no
on-the-fly SFT run), a LoRA student one layer deep, gradient accumulation."""


def distill_argv(output: str) -> list[str]:
    """``posttrain`` arguments of :data:`DISTILL_RUN` writing to ``output``."""
    options = [x for k, v in DISTILL_RUN.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    return ["distill", *options, "--output", output]


def run_cell(entry, env, environ: dict[str, str], run) -> dict[str, str]:
    """The cell of ``entry``: ``passed`` with the loss and KL of the first and last step,
    ``skipped`` (n/a) without ``tunix.distillation`` or on an emulated row, else
    ``failed`` with the first error line."""
    if entry.emulated:
        return {
            "status": "skipped",
            "message": "the distill contracts drive the installed trainer; the run is the "
            "base release's",
        }
    probe = run([str(env.python), "-c", "import tunix.distillation.strategies"], environ)
    if probe.returncode:
        return {"status": "skipped", "message": "this Tunix has no tunix.distillation"}
    with tempfile.TemporaryDirectory() as tmp:
        done = run([str(env.python), "-m", "posttrain.cli", *distill_argv(tmp)], environ)
        metrics = Path(tmp) / "metrics.jsonl"
        records = (
            [json.loads(line) for line in metrics.read_text().splitlines()]
            if metrics.is_file()
            else []
        )
    values = [r.get(k) for r in records for k in ("loss", "kl")]
    finite = all(isinstance(x, float) and x == x and abs(x) < 1e6 for x in values)
    if done.returncode == 0 and len(records) == DISTILL_RUN["steps"] and finite:
        first, last = records[0], records[-1]
        return {
            "status": "passed",
            "message": f"{len(records)} distill steps, loss {first['loss']:.4f} -> "
            f"{last['loss']:.4f}, kl {first['kl']:.4f} -> {last['kl']:.4f}",
        }
    why = failure(done) if done.returncode else f"metrics: {records}"
    return {"status": "failed", "message": why}
