"""What a run checks about its directory beyond its settings (:mod:`posttrain.runs.record`),
and what it leaves when it stops before its first step (#40).

- A run stopped by a non-finite loss before it ever checkpointed (``--beta 1e30`` at step
  1) leaves nothing: :func:`discard_unstarted` removes what it wrote (``run.json``,
  ``metrics.jsonl``, ``tensorboard/``, an empty ``checkpoints/``) and the directory when
  that leaves it empty. A resumed run keeps its directory (its checkpoints are whole).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil

from posttrain.runs.record import METRICS_FILE, RUN_FILE

#: What a run writes before its first checkpoint, removed when it never reaches one.
STARTED_FILES = (RUN_FILE, METRICS_FILE, "tensorboard", "checkpoints")


def discard_unstarted(out: str | os.PathLike, restored: int) -> bool:
    """Removes what a run that started from scratch (``restored`` 0) wrote into ``out``
    when it holds no checkpoint; returns whether it did. Called by the writing process
    when training stopped with a non-finite loss."""
    out = pathlib.Path(out)
    checkpoints = out / "checkpoints"
    if restored or (checkpoints.is_dir() and any(_steps(checkpoints))):
        return False
    for name in STARTED_FILES:
        path = out / name
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists():
            path.unlink()
    with contextlib.suppress(OSError):  # only when nothing else is there
        out.rmdir()
    return True


def _steps(checkpoints: pathlib.Path):
    return (p for p in checkpoints.iterdir() if p.is_dir() and p.name.isdigit())
