"""The matrix's run cells: a short real ``posttrain`` run per entry, inside its
environment, judged by its exit status and metrics (:data:`CELLS`; the contracts are
:mod:`harness.matrix.matrix`'s). Each cell is ``{"status": "passed" | "failed" | "skipped",
"message"}``; ``skipped`` is n/a there, and its message says why."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.devices.devices import configure_devices
from harness.matrix import distill_cell, vision_cell
from harness.matrix.entries import REPO, Entry
from harness.matrix.envs import EnvResult, Runner, failure, first_error

SFT_RUN: dict[str, Any] = {
    "model": "qwen3-tiny",
    "lora_rank": 4,
    "grad_accum": 2,
    "steps": 4,
    "max_target_length": 64,
    "save_every": 2,
}
"""The matrix's SFT run, as ``SFTConfig`` fields: a release row passes them to
``posttrain sft`` as options (:func:`sft_argv`), an emulated row to ``run_sft``."""


RL_RUN: dict[str, Any] = {
    "model": "qwen3-tiny",
    "lora_rank": 4,
    "steps": 2,
    "warmup_steps": 0,
    "max_new_tokens": 4,
    "eval_samples": 0,
    "save_every": 1,
}
"""The matrix's GRPO run, as ``posttrain grpo`` options."""


DPO_RUN: dict[str, Any] = {
    "model": "qwen3-tiny",
    "lora_rank": 4,
    "grad_accum": 2,
    "steps": 2,
    "max_prompt_length": 48,
    "max_response_length": 48,
    "save_every": 1,
}
"""The matrix's DPO run, as ``posttrain dpo`` options."""


def _argv(command: str, run: dict[str, Any], output: str) -> list[str]:
    options = [x for k, v in run.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    return [command, *options, "--output", output]


def sft_argv(output: str) -> list[str]:
    """``posttrain`` arguments of :data:`SFT_RUN` writing to ``output``."""
    return _argv("sft", SFT_RUN, output)


def rl_argv(output: str) -> list[str]:
    """``posttrain`` arguments of :data:`RL_RUN` writing to ``output``."""
    return _argv("grpo", RL_RUN, output)


def dpo_argv(output: str) -> list[str]:
    """``posttrain`` arguments of :data:`DPO_RUN` writing to ``output``."""
    return _argv("dpo", DPO_RUN, output)


def sft_cell(entry: Entry, env: EnvResult, environ: dict[str, str], run: Runner) -> dict[str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        if entry.emulated:
            code = (
                f"import sys; sys.path.insert(0, {str(REPO)!r})\n"
                f"from harness.matrix.run_cells import emulated_sft; "
                f"emulated_sft({entry.convention!r}, {tmp!r})"
            )
            command = [str(env.python), "-c", code]
        else:
            command = [str(env.python), "-m", "posttrain.cli", *sft_argv(tmp)]
        done = run(command, environ)
        if entry.emulated and done.returncode == NOT_APPLICABLE:
            return {
                "status": "skipped",
                "message": first_error(done.stdout).removeprefix("posttrain: error: "),
            }
        metrics = Path(tmp) / "metrics.jsonl"
        losses = (
            [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
            if metrics.is_file()
            else []
        )
    if done.returncode == 0 and losses and all(x == x and abs(x) < 1e6 for x in losses):
        return {
            "status": "passed",
            "message": f"{len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}",
        }
    return {"status": "failed", "message": failure(done)}


def rl_cell(entry: Entry, env: EnvResult, environ: dict[str, str], run: Runner) -> dict[str, str]:
    if entry.emulated:
        return {
            "status": "skipped",
            "message": "emulated rows emulate SFT's train step; RL is their base release's",
        }
    with tempfile.TemporaryDirectory() as tmp:
        done = run([str(env.python), "-m", "posttrain.cli", *rl_argv(tmp)], environ)
        metrics = Path(tmp) / "metrics.jsonl"
        records = (
            [json.loads(line) for line in metrics.read_text().splitlines()]
            if metrics.is_file()
            else []
        )
    values = [r.get(k) for r in records for k in ("reward/total/mean", "loss")]
    finite = all(isinstance(x, float) and x == x and abs(x) < 1e6 for x in values)
    if done.returncode == 0 and len(records) == RL_RUN["steps"] and finite:
        rewards = [r["reward/total/mean"] for r in records]
        return {
            "status": "passed",
            "message": f"{len(records)} GRPO steps, reward {rewards[0]:.3f} -> {rewards[-1]:.3f}",
        }
    why = failure(done) if done.returncode else f"metrics: {records}"
    return {"status": "failed", "message": why}


def dpo_cell(entry: Entry, env: EnvResult, environ: dict[str, str], run: Runner) -> dict[str, str]:
    if entry.emulated:
        return {
            "status": "skipped",
            "message": "the dpo contracts drive the emulated convention; the run is the base "
            "release's",
        }
    with tempfile.TemporaryDirectory() as tmp:
        done = run([str(env.python), "-m", "posttrain.cli", *dpo_argv(tmp)], environ)
        metrics = Path(tmp) / "metrics.jsonl"
        records = (
            [json.loads(line) for line in metrics.read_text().splitlines()]
            if metrics.is_file()
            else []
        )
    values = [r.get(k) for r in records for k in ("loss", "reward_margin")]
    finite = all(isinstance(x, float) and x == x and abs(x) < 1e6 for x in values)
    if done.returncode == 0 and len(records) == DPO_RUN["steps"] and finite:
        return {
            "status": "passed",
            "message": f"{len(records)} DPO steps, loss {records[0]['loss']:.4f} -> "
            f"{records[-1]['loss']:.4f}, margin {records[-1]['reward_margin']:.4f}",
        }
    why = failure(done) if done.returncode else f"metrics: {records}"
    return {"status": "failed", "message": why}


NOT_APPLICABLE = 3
"""Exit status of :func:`emulated_sft` when the emulation means nothing over the base."""


def emulated_sft(convention: str, output: str) -> None:
    """The matrix's SFT run under an emulated convention (called inside the entry's env);
    over a base not of its era it prints ``n/a: why`` and exits :data:`NOT_APPLICABLE`.

    Devices: ``$POSTTRAIN_DEVICES`` (8 unless set; :func:`~harness.matrix.matrix.entry_environ`
    sets 8), so a caller whose JAX already runs on that count (a test, any ``--devices``)
    can call it in-process."""
    configure_devices()
    from contracts import tunix_emulation
    from posttrain.sft import SFTConfig, run_sft, sft_trainer_class

    reason = tunix_emulation.not_applicable(convention)
    if reason:
        print(f"posttrain: error: {reason}")
        raise SystemExit(NOT_APPLICABLE)

    base = {
        "positional3": tunix_emulation.Positional3PeftTrainer,
        "bound2": tunix_emulation.Bound2PeftTrainer,
        "bound3_update": tunix_emulation.MainPeftTrainer,
    }[convention]
    run_sft(SFTConfig(**SFT_RUN, output=output), trainer_class=sft_trainer_class(base))


Cell = Callable[[Entry, EnvResult, dict[str, str], Runner], dict[str, str]]
CELLS: dict[str, Cell] = {
    "sft": sft_cell,
    "rl": rl_cell,
    "dpo": dpo_cell,
    "distill": distill_cell.run_cell,
    "vision": vision_cell.run_cell,  # #39
}
"""Run cell -> what runs it (a report column each, in this order)."""

START_ORDER = ("vision", "rl", "distill", "dpo", "sft")
"""The order the cells start in when they run side by side (:func:`workers` > 1): the
longest first, so that the last to start are short. Measured from empty caches on 2
cores (2026-12-06, tunix-0.1.7's row, one at a time): vision 33.0 s, rl 20.2, distill
19.1, dpo 15.9, sft 13.8."""


def workers(jobs: str) -> int:
    """How many run cells of a row run at once: the matrix's ``--jobs`` (``auto``: the
    CPU count; 0 or 1: one at a time). Each cell is one process that mostly compiles on
    one core: on 2 cores, from empty caches, tunix-0.1.7's five took 102 s one after
    another and 63-69 s two at a time (2026-12-06, three runs)."""
    if jobs == "auto":
        return os.cpu_count() or 1
    return max(1, int(jobs))
