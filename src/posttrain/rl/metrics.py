"""What a GRPO run logs: one ``metrics.jsonl`` record per step (:func:`step_record`) and
a progress line (:func:`progress_line`)."""

from __future__ import annotations

import json
import pathlib

import numpy as np

from posttrain import atomic
from posttrain.training import record as run_record


def step_record(step: int, tunix: dict, rewards_by_fn: dict, tap) -> dict:
    """One ``metrics.jsonl`` record: ``step``; ``reward/<fn>/mean|std`` per function and
    ``reward/total/mean|std``; Tunix's ``loss``, ``kl``, ``pg_clipfrac`` and
    ``completions/mean_length`` where the release logs them; rollout tokens and
    tokens/s; the step's wall time."""
    record: dict = {"step": step}
    total = None
    for name, values in rewards_by_fn.items():
        record[f"reward/{name}/mean"] = float(np.mean(values))
        record[f"reward/{name}/std"] = float(np.std(values))
        total = values if total is None else total + values
    if total is not None:
        record["reward/total/mean"] = float(np.mean(total))
        record["reward/total/std"] = float(np.std(total))
    # Tunix logs update s's rollout at global step s - 1, beside update s - 1's actor
    # figures (contracts/test_tunix_rl.py pins it): the rollout's at step - 1.
    rollout = tap.records.get(step - 1, {})
    for key, source in (
        ("loss", tunix),
        ("kl", tunix),
        ("pg_clipfrac", tunix),
        ("completions/mean_length", rollout),
    ):
        for name, value in source.items():
            if name == key or name.endswith("/" + key):
                record[key] = value
                break
    seconds = tap.rollout_seconds.get(step - 1)
    if seconds:
        record["rollout_tokens"] = tap.rollout_tokens[step - 1]
        record["rollout_tokens_per_s"] = tap.rollout_tokens[step - 1] / seconds
    return record


def progress_line(record: dict) -> str:
    """``step 15: reward 0.414 (exact_answer 0.180, answer_format 0.234), kl 0.193, ...``"""
    per_fn = ", ".join(
        f"{k.split('/')[1]} {v:.3f}"
        for k, v in record.items()
        if k.startswith("reward/") and k.endswith("/mean") and k != "reward/total/mean"
    )
    parts = [f"step {record['step']}: reward {record.get('reward/total/mean', float('nan')):.3f}"]
    parts[0] += f" ({per_fn})" if per_fn else ""
    if "kl" in record:
        parts.append(f"kl {record['kl']:.3f}")
    if "completions/mean_length" in record:
        parts.append(f"{record['completions/mean_length']:.1f} tokens per completion")
    if "rollout_tokens_per_s" in record:
        parts.append(f"rollout {record['rollout_tokens_per_s']:,.0f} tokens/s")
    return ", ".join(parts)


def write_metrics(
    out: pathlib.Path, restored: int, tap, rewards_seen, *, write: bool = True
) -> list[dict]:
    """Appends the steps after ``restored`` to ``metrics.jsonl`` (dropping any a killed
    run logged past its checkpoint; ``write=False``: only computes them); returns them."""
    steps = sorted(s for s in set(tap.records) | set(rewards_seen) if s > restored)
    history = [step_record(s, tap.records.get(s, {}), rewards_seen.get(s, {}), tap) for s in steps]
    if write:
        run_record.truncate_metrics(out, restored)
        path = out / run_record.METRICS_FILE
        kept = path.read_text(encoding="utf-8") if path.exists() else ""
        atomic.write_text(path, kept + "".join(json.dumps(r) + "\n" for r in history))
    return history
