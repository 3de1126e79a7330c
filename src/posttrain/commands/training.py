"""``posttrain sft``, ``dpo`` and ``grpo``: one run of their checked options, then its
closing lines."""

from __future__ import annotations

import sys

from posttrain import distributed
from posttrain.training.stops import clean_stop


def sft(cfg) -> int:
    """``posttrain sft``: one :class:`~posttrain.sft.options.SFTConfig` run (with
    ``--vision``, :func:`posttrain.vision.run.run_vision`'s)."""
    from posttrain.sft.run import run_sft
    from posttrain.vision.run import run_vision

    # Tunix's tqdm bar shows on a terminal only; elsewhere print ~10 progress lines.
    log_every = None if sys.stderr.isatty() else max(1, cfg.steps // 10)
    with clean_stop(cfg.output):
        result = (run_vision if cfg.vision else run_sft)(cfg, log_every=log_every)
    if log_every is None and distributed.is_writer():
        print(
            f"model {cfg.model}: {result.params:,} params, {result.trainable:,} trained; "
            f"global batch {result.global_batch}; Tunix convention {result.convention}"
        )
    _print_closing(result, f"checkpoint step {result.checkpoint_step} in ")
    return 0


def _print_closing(result, checkpoints: str = "checkpoints in ") -> None:
    """The closing lines of a training command, printed by the writer process only: the
    run's summary, where checkpoints and metrics are, and each directory exported."""
    if not distributed.is_writer():
        return
    print(result.summary())
    output = result.output
    print(f"{checkpoints}{output / 'checkpoints'}; metrics in {output / 'metrics.jsonl'}")
    for path in result.exported:
        print(f"wrote {path}")


def grpo(cfg) -> int:
    """``posttrain grpo``: one :class:`~posttrain.rl.options.GRPORunConfig` run."""
    from posttrain.rl.run import run_grpo

    with clean_stop(cfg.output):
        result = run_grpo(cfg, log_every=None if sys.stderr.isatty() else max(1, cfg.steps // 10))
    _print_closing(result)
    return 0


def dpo(cfg) -> int:
    """``posttrain dpo``: one :class:`~posttrain.preference.options.DPORunConfig` run."""
    from posttrain.preference.run import run_dpo

    with clean_stop(cfg.output):
        result = run_dpo(cfg, log_every=None if sys.stderr.isatty() else max(1, cfg.steps // 10))
    _print_closing(result)
    return 0


def distill(cfg) -> int:
    """``posttrain distill``: one :class:`~posttrain.distill.options.DistillRunConfig` run;
    its last line is the held-out KL to the teacher before and after."""
    from posttrain.distill.run import run_distill

    with clean_stop(cfg.output):
        result = run_distill(
            cfg, log_every=None if sys.stderr.isatty() else max(1, cfg.steps // 10)
        )
    if distributed.is_writer():
        print(f"teacher {result.teacher}")
    _print_closing(result)
    return 0
