"""What a run checks about its directory beyond its settings (:mod:`posttrain.training.record`),
and what it leaves when it stops before its first step (#40).

- A run stopped by a non-finite loss before it ever checkpointed (``--beta 1e30`` at step
  1) leaves nothing: :func:`discard_unstarted` removes what it wrote (``run.json``,
  ``metrics.jsonl``, ``tensorboard/``, an empty ``checkpoints/``) and the directory when
  that leaves it empty. A resumed run keeps its directory (its checkpoints are whole).
- A resume is refused when its facts differ from the recorded run's though its settings
  do not (:func:`check_same_run`): the global batch (``--devices`` changes it) and the
  sha256 of the ``--data`` file's content; and when a ``model-step<N>`` there is neither
  empty nor an export (:func:`check_exports`), which would have made the run skip its
  export without a word.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pathlib
import shutil

import jax

from posttrain.conversion.native import is_native_dir
from posttrain.lora.adapters import ADAPTER_FILE, CONFIG_FILE
from posttrain.training.record import METRICS_FILE, RUN_FILE, read

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


def data_digest(path: str | None) -> str | None:
    """The sha256 (hex) of data file ``path``'s bytes; None for the embedded data."""
    if path is None or not os.path.isfile(path):  # a missing file: the reader says so
        return None
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_same_run(cfg, global_batch: int) -> dict:
    """Refuses to resume the run in ``cfg.output`` with facts its settings do not show:
    another global batch (``--devices`` changed it: the losses would differ) or a
    ``--data`` file whose content changed; and a ``model-step<N>`` / ``adapter-step<N>``
    there that is not an export (:func:`check_exports`). Returns the facts to record for
    the next resume: ``devices`` and ``data_sha256``.

    Raises:
      ValueError: one line naming the recorded and the new value of what differs.
    """
    out = pathlib.Path(cfg.output)
    facts = {"devices": jax.device_count(), "data_sha256": data_digest(cfg.data)}
    recorded = read(out)
    if recorded is None:
        return facts
    check_global_batch(out, recorded, global_batch)
    digest = recorded.get("data_sha256")
    if digest is not None and facts["data_sha256"] is not None and digest != facts["data_sha256"]:
        raise ValueError(
            f"--data {cfg.data}: its content changed since the run in {out} recorded it "
            f"(sha256 {digest[:16]}... then, {facts['data_sha256'][:16]}... now): refusing "
            "to resume it: use a new --output, or the recorded data"
        )
    check_exports(out)
    return facts


def check_global_batch(out: str | os.PathLike, recorded: dict | None, global_batch: int) -> None:
    """Refuses to resume the run ``recorded`` (its ``run.json``) in ``out`` with another
    global batch: ``--devices`` (or a mesh) changes it, and the losses with it.

    Raises:
      ValueError: one line naming the recorded and the new batch and device counts.
    """
    was = (recorded or {}).get("global_batch")
    if was is not None and was != global_batch:
        devices = recorded.get("devices")
        then = f" on {devices} devices" if devices is not None else ""
        raise ValueError(
            f"{out} holds a run with global batch {was}{then}; this one has {global_batch} "
            f"on {jax.device_count()} devices (--devices changes it, and the losses with it): "
            f"refusing to resume it: use a new --output, or the recorded devices"
        )


def check_exports(out: str | os.PathLike) -> None:
    """Every ``model-step<N>`` and ``adapter-step<N>`` in run directory ``out`` is empty
    (the export replaces it) or a whole export (kept): both are written atomically, so
    anything else was put there by something else.

    Raises:
      ValueError: naming the directory and what it lacks.
    """
    out = pathlib.Path(out)
    if not out.is_dir():
        return
    for path in sorted(out.glob("*-step*")):
        if not path.is_dir() or not any(path.iterdir()):
            continue
        if path.name.startswith("model-step") and not is_native_dir(path):
            lacks = "a posttrain-native config.json"
        elif path.name.startswith("adapter-step") and not (
            (path / CONFIG_FILE).is_file() and (path / ADAPTER_FILE).is_file()
        ):
            lacks = f"{CONFIG_FILE} and {ADAPTER_FILE}"
        else:
            continue
        raise ValueError(
            f"{path} exists and is not an export (no {lacks}); the run would not write its "
            "export there: remove it or use a new --output"
        )


def replace_empty(path: pathlib.Path) -> bool:
    """Removes ``path`` when it is an empty directory (an export then takes its place);
    returns whether ``path`` is now free to be written."""
    if path.is_dir() and not any(path.iterdir()):
        path.rmdir()
    return not path.exists()


#: The marker of a checkpoint Orbax has not finished (``<step>.orbax-checkpoint-tmp``
#: and its items' own temporaries): never restored, removed when a run is interrupted.
PARTIAL_CHECKPOINT = ".orbax-checkpoint-tmp"


def sweep_partial_checkpoints(root: str | os.PathLike) -> list[pathlib.Path]:
    """Removes the checkpoints under ``root`` that Orbax did not finish; returns them.
    Registered with ``atexit`` by an interrupted run (:mod:`posttrain.commands.training`),
    so it runs once Orbax's save threads have stopped: the checkpoints left are whole or
    absent."""
    root = pathlib.Path(root)
    if not root.is_dir():
        return []
    # grpo keeps its actor's checkpoints one level down (checkpoints/actor/<step>)
    roots = [root, *(p for p in root.iterdir() if p.is_dir() and not p.name[:1].isdigit())]
    partial = [p for r in roots for p in r.iterdir() if PARTIAL_CHECKPOINT in p.name]
    for path in partial:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return partial
