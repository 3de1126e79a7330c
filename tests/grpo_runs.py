"""The smallest real GRPO run of the tests and contracts."""

from __future__ import annotations

from posttrain.rl.run import GRPORunConfig


def tiny(tmp_path, **overrides) -> GRPORunConfig:
    """A 2-step run of the embedded task into ``tmp_path / "run"`` without warm-up, 1
    prompt per shard x 2 completions of at most 3 tokens, no evaluation; ``overrides``
    change any field."""
    fields = dict(
        steps=2,
        warmup_steps=0,
        per_device_batch_size=1,
        num_generations=2,
        max_new_tokens=3,
        eval_samples=0,
        output=str(tmp_path / "run"),
    )
    return GRPORunConfig(**{**fields, **overrides})
