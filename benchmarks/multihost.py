"""``posttrain sft`` on 2 processes x 4 fake CPU devices against 1 process x 8, in the
same run: what the gloo collectives across the process boundary cost.

Usage::

    python benchmarks/multihost.py [--steps 12] [--lora-rank 0] [--grad-accum 1]

Both runs are the default SFT run (qwen3-tiny, every device on ``fsdp``, 256-token rows,
8 rows per step), shortened to ``--steps``. They run one after the other, the two
processes through ``posttrain-harness launch``. The figures are the medians of
``step_time_s`` in each run's ``metrics.jsonl``, the first two steps excluded (compile
and warm-up), and the wall time of each whole command (start-up, compile and export
included). Printed: ms per step, tokens/s and the ratio 2 x 4 / 1 x 8.

On one 2-core machine both layouts share the same cores, so the ratio measures the
collectives' overhead (gloo over TCP on 127.0.0.1 and one more process), not a speed-up.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time


def run(command: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True)
    return time.perf_counter() - started


def step_times(run_dir: pathlib.Path) -> tuple[float, float]:
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in records[2:] if r["step_time_s"]]
    return (
        statistics.median(r["step_time_s"] for r in steady),
        statistics.median(r["tokens_per_s"] for r in steady),
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--lora-rank", type=int, default=0)
    parser.add_argument("--grad-accum", type=int, default=1)
    args = parser.parse_args(argv)
    sft = ["sft", "--steps", str(args.steps), "--lora-rank", str(args.lora_rank)]
    sft += ["--grad-accum", str(args.grad_accum), "--save-every", str(args.steps)]
    with tempfile.TemporaryDirectory() as tmp:
        one, two = pathlib.Path(tmp, "one"), pathlib.Path(tmp, "two")
        wall_one = run(
            [sys.executable, "-m", "posttrain.cli", *sft, "--devices", "8", "--output", str(one)]
        )
        launcher = [sys.executable, "-m", "harness.cli", "launch", "-n", "2"]
        wall_two = run(
            [*launcher, "--devices-per-process", "4", "--", "posttrain", *sft, "--output", str(two)]
        )
        (step_one, tps_one), (step_two, tps_two) = step_times(one), step_times(two)
    print(
        f"posttrain sft, qwen3-tiny, fsdp=8, 8 x 256 tokens per step, lora_rank "
        f"{args.lora_rank}, grad_accum {args.grad_accum}, {args.steps} steps; medians of "
        f"steps 3-{args.steps}"
    )
    print(f"{'layout':<22}{'ms/step':>10}{'tokens/s':>11}{'wall s':>9}")
    print(f"{'1 process x 8':<22}{step_one * 1e3:>10.1f}{tps_one:>11,.0f}{wall_one:>9.1f}")
    print(f"{'2 processes x 4':<22}{step_two * 1e3:>10.1f}{tps_two:>11,.0f}{wall_two:>9.1f}")
    print(f"step time 2 x 4 / 1 x 8: {step_two / step_one:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
