"""The matrix's vision cell: one short ``posttrain sft --vision`` run per release entry whose
``TrainingInput`` has an ``images`` field (google-tunix >= 0.1.6, and main); n/a, with
the reason, where it has none or the row is emulated."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from harness.matrix.envs import failure, first_error

VISION_RUN: dict[str, Any] = {
    "steps": 3,
    "max_target_length": 160,
    "save_every": 1,
}
"""The matrix's vision run, as ``posttrain sft`` options beyond ``--vision`` and ``--data``
(8 drawings): the default model (``gemma4-vision-tiny``), its tower frozen; 3 steps, so
that the last loss follows an update (the first step's learning rate is 0)."""

#: exit status of :data:`PROBE` when the release's ``TrainingInput`` has no images field
NO_FIELD = 3

PROBE = (
    "import dataclasses, sys\n"
    "from tunix.sft.peft_trainer import TrainingInput\n"
    "if 'images' not in {f.name for f in dataclasses.fields(TrainingInput)}:\n"
    f"    sys.exit({NO_FIELD})\n"
    "from posttrain.vision import write_dataset\n"
    "write_dataset(sys.argv[1], count=8, seed=1)\n"
)
"""Run in the entry's environment: exits :data:`NO_FIELD` without ``TrainingInput.images``,
else draws the run's 8 images into the directory it is given."""


def vision_argv(data: str, output: str) -> list[str]:
    """``posttrain`` arguments of :data:`VISION_RUN` on ``data``, writing to ``output``."""
    options = [x for k, v in VISION_RUN.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    return ["sft", "--vision", "--data", data, *options, "--output", output]


def run_cell(entry, env, environ: dict[str, str], run) -> dict[str, str]:
    """The cell of ``entry``: ``passed`` with the first and last step's loss, ``skipped``
    (n/a) without ``TrainingInput.images`` or on an emulated row, else ``failed`` with the
    first error line."""
    if entry.emulated:
        return {
            "status": "skipped",
            "message": "the vision run drives the installed trainer; the run is the base release's",
        }
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        probe = run([str(env.python), "-c", PROBE, str(data)], environ)
        if probe.returncode == NO_FIELD:
            return {
                "status": "skipped",
                "message": "this Tunix's TrainingInput has no images field (google-tunix "
                ">= 0.1.6 has it)",
            }
        if probe.returncode:
            return {"status": "failed", "message": first_error(probe.stderr + probe.stdout)}
        argv = vision_argv(str(data / "data.jsonl"), str(Path(tmp) / "run"))
        done = run([str(env.python), "-m", "posttrain.cli", *argv], environ)
        metrics = Path(tmp) / "run" / "metrics.jsonl"
        records = (
            [json.loads(line) for line in metrics.read_text().splitlines()]
            if metrics.is_file()
            else []
        )
    losses = [r.get("loss") for r in records]
    finite = all(isinstance(x, float) and x == x and abs(x) < 1e6 for x in losses)
    if done.returncode == 0 and len(records) == VISION_RUN["steps"] and finite:
        return {
            "status": "passed",
            "message": f"{len(records)} vision steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}",
        }
    why = failure(done) if done.returncode else f"metrics: {records}"
    return {"status": "failed", "message": why}
