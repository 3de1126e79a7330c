"""Files written whole or not at all: a temporary sibling, then ``os.replace``; and the
check that an output path can be written, before the work that ends in writing it.

Standard library only, so the harness (which must not need JAX) writes its reports
with the same code as ``posttrain``. Directories: :func:`posttrain.conversion.
directories.atomic_directory`.
"""

from __future__ import annotations

import os
import pathlib
import tempfile


def current_umask() -> int:
    """The process umask (read by setting and restoring it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def fsync_path(path: pathlib.Path) -> None:
    """``fsync`` of a file or a directory (a directory: its entries, e.g. after a rename)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text(path: str | os.PathLike, text: str, *, fsync: bool = True) -> None:
    """Writes ``text`` (UTF-8) to ``path``: readers see the old file or the new one,
    never a part. Creates missing parent directories; the file gets the mode a plain
    ``open`` would (0666 less the umask).

    Raises:
      OSError: the directory cannot be written (nothing is left behind).
    """
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise


def check_output_file(output: str, flag: str = "--output") -> None:
    """Checks that ``output`` (the value of ``flag``) can be written: a path that is not a
    directory, under an existing writable directory.

    Raises:
      ValueError: naming the path and what is wrong with it.
    """
    if not output.strip():
        raise ValueError(f"{flag} {output!r}: expected a file path")
    if os.path.isdir(output):
        raise ValueError(f"{flag} {output!r} is a directory; expected a file path")
    parent = os.path.dirname(os.path.abspath(output))
    if os.path.exists(parent) and not os.path.isdir(parent):
        raise ValueError(f"{flag} {output!r}: {parent} is not a directory")
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {output!r}: directory {parent} does not exist")
    if parent.split(os.sep)[1:2] in (["proc"], ["sys"], ["dev"]):
        raise ValueError(f"{flag} {output!r} is under a kernel file system; expected a file")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {output!r}: directory {parent} is not writable")
    if os.path.exists(output) and not os.access(output, os.W_OK):
        raise ValueError(f"{flag} {output!r} is not writable")
