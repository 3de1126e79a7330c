"""Output directories written whole or not at all: a temporary sibling renamed into
place (:func:`atomic_directory`), the destination checked before any work
(:func:`check_destination`), and a killed writer's temporaries swept
(:func:`sweep_stale_temporaries`). Files: :mod:`posttrain.atomic`."""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import shutil
import tempfile
from collections.abc import Iterator

from posttrain.atomic import current_umask, fsync_path
from posttrain.conversion.errors import ConversionError


def check_destination(dst: str | os.PathLike) -> None:
    """Raises :class:`ConversionError` unless ``dst`` can become a new directory: it does
    not exist, and its parent is an existing, writable directory."""
    dst = pathlib.Path(dst)
    if dst.exists():
        raise ConversionError(f"output directory {dst} exists; give a new path")
    if not dst.parent.exists():
        raise ConversionError(f"output parent directory {dst.parent} does not exist")
    if not dst.parent.is_dir():
        raise ConversionError(f"output parent {dst.parent} is a file; expected a directory")
    if not os.access(dst.parent, os.W_OK | os.X_OK):
        raise ConversionError(f"output parent directory {dst.parent} is not writable")


def temporary_prefix(dst: str | os.PathLike, kind: str = "tmp") -> str:
    """``.<dst name>.<kind>-<pid>-``: the prefix of this process's temporaries for ``dst``
    (``kind`` ``tmp``: an atomic write; ``convert``: an on-the-fly conversion)."""
    return f".{pathlib.Path(dst).name}.{kind}-{os.getpid()}-"


_TEMPORARY = re.compile(r"\.(?P<name>.+)\.(?:tmp|convert)-(?P<pid>[0-9]+)-[^-/]+")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def sweep_stale_temporaries(
    parent: str | os.PathLike, name: str | None = None
) -> list[pathlib.Path]:
    """Removes temporaries in ``parent`` left by killed writers; returns them.

    Only directories provably ours are removed: named by :func:`temporary_prefix`
    (``.<name>.tmp-<pid>-<random>``, ``.<name>.convert-<pid>-<random>``), for ``name``
    when given, whose writer process ``<pid>`` no longer exists.
    """
    parent = pathlib.Path(parent)
    removed: list[pathlib.Path] = []
    if not parent.is_dir():
        return removed
    for sibling in parent.iterdir():
        match = _TEMPORARY.fullmatch(sibling.name)
        if not match or (name is not None and match["name"] != name):
            continue
        if sibling.is_dir() and not _pid_alive(int(match["pid"])):
            shutil.rmtree(sibling, ignore_errors=True)
            removed.append(sibling)
    return removed


@contextlib.contextmanager
def atomic_directory(dst: str | os.PathLike, *, fsync: bool = True) -> Iterator[pathlib.Path]:
    """Yields a temporary sibling of ``dst``, renamed to ``dst`` when the block succeeds.

    The sibling is ``.<dst>.tmp-<pid>-<random>``: a later call in the same directory
    sweeps those whose writer died, whatever their name (:func:`sweep_stale_temporaries`);
    an exception, Ctrl-C or SIGTERM (which the CLI turns into KeyboardInterrupt) removes
    it at once. ``dst`` gets the mode the
    umask gives a new directory. With ``fsync`` the files written in the block and the
    directory are flushed before the rename, and the parent directory after it, so a
    power cut leaves either no ``dst`` or a complete one.

    Raises:
      ConversionError: ``dst`` exists, or its parent does not, is a file or is not
        writable (nothing is written).
    """
    dst = pathlib.Path(dst)
    check_destination(dst)
    sweep_stale_temporaries(dst.parent)  # a killed writer's, whatever it was writing
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=temporary_prefix(dst), dir=dst.parent))
    try:
        yield tmp
        if dst.exists():
            raise ConversionError(f"output directory {dst} appeared during conversion")
        os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp makes it 0700
        if fsync:
            for path in sorted(tmp.rglob("*")):
                fsync_path(path)
            fsync_path(tmp)
        os.rename(tmp, dst)
        if fsync:
            fsync_path(dst.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
