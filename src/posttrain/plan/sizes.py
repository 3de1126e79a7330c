"""The sizes a plan can represent, checked before anything is built or compiled (#56 7).

A plan past them did not fail in a line: ``--seq 1000000000000`` aborted libtpu with a
core dump (``overflow in static extent product``), a ``config.json`` with a vocabulary of
10**12 ended in ``internal error: OverflowError`` (a jitted argument past int32). Bounds:

- :data:`MAX_INDEX` (2**31 - 1): every dimension of the model and every count of the
  options (token ids, positions and the iota / gather indices of a step are int32);
- the tokens of one row, the prompt and what follows it (``new_tokens``), under the same
  bound (positions);
- :data:`MAX_ARRAY_BYTES` (2**63 - 1): the bytes of each large array of the step (the
  tokens, the logits, one layer's attention scores, the embedding, an expert stack),
  float32 where the step computes in it; XLA counts elements and bytes in int64.

Each refusal is one line naming the value and its flag (or the config field) and the
bound, e.g. ``seq=1000000000000 (--seq): expected at most 2147483647 tokens per row
(2**31 - 1: positions and token indices are int32)``.
"""

from __future__ import annotations

import math

from posttrain import flags
from posttrain.config import MAX_DIM, ModelConfig
from posttrain.plan.options import PlanOptions

#: The largest dimension or count: int32 indices (token ids, positions, iota, gathers).
MAX_INDEX = MAX_DIM
#: The largest array in bytes: XLA's element and byte counts are int64.
MAX_ARRAY_BYTES = 2**63 - 1
_FLOAT32 = 4


def check(options: PlanOptions, cfg: ModelConfig, batch: int) -> None:
    """Refuses a plan whose model, options or arrays leave the representable sizes.

    Args:
      options: the plan's options (checked: every count >= 1).
      cfg: the model config it compiles.
      batch: the global batch (rows per micro-step).

    Raises:
      ValueError: one line naming the first value past a bound and the bound.
    """
    _check_counts(options, cfg, batch)
    generates = options.workflow != "sft"  # generate, dpo, grpo: a prompt + what follows
    row = options.seq + (options.new_tokens if generates else 0)
    if row > MAX_INDEX:
        raise ValueError(
            f"tokens per row: seq={options.seq} + new_tokens={options.new_tokens} = {row}; "
            f"expected at most {MAX_INDEX} (2**31 - 1: positions are int32)"
        )
    heads = max(a.num_heads for a in cfg.attention.values())
    arrays = [
        ("the tokens", ("batch", "seq"), (batch, row), _FLOAT32),
        ("the logits", ("batch", "seq", "vocab_size"), (batch, row, cfg.vocab_size), _FLOAT32),
        (
            "the attention scores",
            ("batch", "num_heads", "seq", "seq"),
            (batch, heads, row, row),
            _FLOAT32,
        ),
        ("the embedding", ("vocab_size", "d_model"), (cfg.vocab_size, cfg.d_model), _FLOAT32),
    ]
    if cfg.moe is not None:
        shape = (cfg.moe.num_experts, cfg.d_model, cfg.moe.moe_d_ff)
        arrays.append(("an expert stack", ("num_experts", "d_model", "moe_d_ff"), shape, _FLOAT32))
    for what, names, shape, itemsize in arrays:
        size = math.prod(shape) * itemsize
        if size > MAX_ARRAY_BYTES:
            dims = ", ".join(f"{n}={s}" for n, s in zip(names, shape, strict=True))
            raise ValueError(
                f"{_lead(options, batch, names)}: {what} [{dims}] would be {size:.3g} bytes; an "
                f"array must be under 2**63 bytes (XLA counts them in int64)"
            )


def _check_counts(options: PlanOptions, cfg: ModelConfig, batch: int) -> None:
    """Every count of ``options`` and dimension of ``cfg`` at most :data:`MAX_INDEX` (the
    attention's heads and head_dim, the experts' count and width: ``ModelConfig`` checks
    the others)."""
    values = {
        "batch": batch,
        "per_device_batch_size": options.per_device_batch_size,
        "seq": options.seq,
        "new_tokens": options.new_tokens,
        "grad_accum": options.grad_accum,
        "lora_rank": options.lora_rank,
    }
    for name, value in values.items():
        if value > MAX_INDEX:
            flag = flags.flag_of(PlanOptions, name)
            if name == "batch" and options.batch is None:
                flag = "--per-device-batch-size x the data-parallel size"
            raise ValueError(f"{name}={value} ({flag}): expected at most {MAX_INDEX} (2**31 - 1)")
    # vocab_size, d_model and d_ff: ModelConfig refuses them past MAX_DIM (every command)
    dims: dict[str, int] = {}
    for attention in cfg.attention.values():
        dims.update(
            num_heads=max(dims.get("num_heads", 0), attention.num_heads),
            head_dim=max(dims.get("head_dim", 0), attention.head_dim),
        )
    if cfg.moe is not None:
        dims.update(num_experts=cfg.moe.num_experts, moe_d_ff=cfg.moe.moe_d_ff)
    for name, value in dims.items():
        if value > MAX_INDEX:
            raise ValueError(
                f"{name}={value}: expected at most {MAX_INDEX} (2**31 - 1: token ids and "
                f"indices are int32)"
            )


def _lead(options: PlanOptions, batch: int, names: tuple[str, ...]) -> str:
    """The plan's values among ``names`` (``batch=4, seq=N (--seq)``), else the model."""
    parts = [f"batch={batch}"] if "batch" in names else []
    parts += [f"seq={options.seq} (--seq)"] if "seq" in names else []
    return ", ".join(parts) or f"--model {options.model}"
