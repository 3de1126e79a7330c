"""Wall time of the pre-merge gate and of one matrix entry, cold against warm.

Usage::

    python benchmarks/harness_wall.py [--gate] [--matrix tunix-0.1.7] [--jobs auto]

``--gate``: clones this checkout into a temporary directory (what CI sees: no
``reports/``, nothing untracked) and runs ``posttrain-harness gate`` there twice
with this interpreter, first with an empty JAX persistent compilation cache in the
temporary directory (cold; the user's cache is not touched), then with the cache
the first run filled (warm). ``--matrix ENTRY``: runs
``posttrain-harness matrix --only ENTRY`` twice against an empty environment
cache (cold: uv builds the environment) and then the filled one (warm). Prints
each wall time in seconds and warm / cold ratios; the targets (issue 6) are gate
<= 300 s cold and <= 120 s warm, and a warm matrix entry <= 120 s. Exit status
1 if any run failed. Other load on the machine slows every run; compare figures
from one invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def timed(command: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, int, str]:
    """(seconds, exit status, last output line) of ``command``."""
    start = time.perf_counter()
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    lines = (done.stdout + done.stderr).strip().splitlines()
    return time.perf_counter() - start, done.returncode, lines[-1] if lines else ""


def gate(tmp: Path, jobs: str) -> bool:
    clone = tmp / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    env = dict(os.environ, PYTHONPATH=f"{clone / 'src'}{os.pathsep}{clone}", CI="true")
    command = [
        sys.executable,
        "-m",
        "harness.cli",
        "gate",
        "--jobs",
        jobs,
        "--compile-cache",
        str(tmp / "jax-compile"),
    ]
    times, ok = {}, True
    for label in ("cold", "warm"):
        seconds, status, last = timed(command, clone, env)
        times[label] = seconds
        ok &= status == 0
        print(f"gate {label}: {seconds:7.1f} s  exit {status}  {last}", flush=True)
        summary = clone / "reports" / "gate-summary.json"
        if status != 0 and summary.is_file():
            for failure in json.loads(summary.read_text()).get("failures", []):
                print(f"  {failure['id']}: {failure['message']}", flush=True)
    print(
        f"gate warm / cold: {times['warm'] / times['cold']:.2f}  "
        f"(targets: cold <= 300 s, warm <= 120 s)"
    )
    return ok


def matrix(tmp: Path, entry: str, jobs: str) -> bool:
    cache, ok = tmp / "envs", True
    for label in ("cold", "warm"):
        reports = tmp / f"reports-{label}"
        command = [
            sys.executable,
            "-m",
            "harness.cli",
            "matrix",
            "--only",
            entry,
            "--jobs",
            jobs,
            "--cache",
            str(cache),
            "--report-dir",
            str(reports),
        ]
        seconds, status, last = timed(command, ROOT, dict(os.environ))
        ok &= status == 0
        row = next(iter(json.loads((reports / "compat-matrix.json").read_text())["entries"]), {})
        build = row.get("env", {}).get("seconds", 0.0)
        print(
            f"matrix {entry} {label}: {seconds:7.1f} s wall (environment {build:.1f} s, "
            f"built={row.get('env', {}).get('built')})  exit {status}  {last}",
            flush=True,
        )
    return ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gate", action="store_true", help="time the gate from a fresh clone")
    parser.add_argument("--matrix", metavar="ENTRY", help="time one matrix entry")
    parser.add_argument("--jobs", default="auto", help="xdist workers (gate) ")
    args = parser.parse_args(argv)
    if not args.gate and not args.matrix:
        parser.error("give --gate and/or --matrix ENTRY")
    ok = True
    with tempfile.TemporaryDirectory(prefix="harness-wall-") as tmp:
        if args.gate:
            ok &= gate(Path(tmp), args.jobs)
        if args.matrix:
            ok &= matrix(Path(tmp), args.matrix, "2" if args.jobs == "auto" else args.jobs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
