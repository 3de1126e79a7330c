"""A run's directory: checked before any work, created with what a killed run left
swept (see each workflow's module docstring for its layout)."""

from __future__ import annotations

import os
import pathlib

from posttrain import distributed


def check_output_dir(output: str) -> None:
    """Checks, before any work, that ``output`` can be a run directory: a non-empty path
    that is a directory or does not exist yet, under a writable directory.

    Raises:
      ValueError: naming the path and what is wrong with it.
    """
    if not output or not output.strip():
        raise ValueError("output=''; expected a run directory path")
    path = pathlib.Path(output)
    if path.absolute().parts[1:2] in (("proc",), ("sys",), ("dev",)):
        raise ValueError(f"output {output!r} is under a kernel file system; expected a directory")
    if path.exists() and not path.is_dir():
        raise ValueError(f"output {output!r} exists and is not a directory")
    probe = path if path.exists() else next(p for p in path.absolute().parents if p.exists())
    if not probe.is_dir():
        raise ValueError(f"output {output!r}: {probe} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        where = "" if probe == path else f": {probe}"
        raise ValueError(f"output {output!r}{where} is not writable")


def prepare_output(output: str) -> pathlib.Path:
    """Creates run directory ``output`` and sweeps what a killed run left: its exports'
    temporaries and its on-the-fly HF conversion beside it."""
    from posttrain.conversion.directories import sweep_stale_temporaries

    out = pathlib.Path(output)
    out.mkdir(parents=True, exist_ok=True)
    if distributed.is_writer():
        sweep_stale_temporaries(out)
        sweep_stale_temporaries(out.absolute().parent, out.name)
    return out
