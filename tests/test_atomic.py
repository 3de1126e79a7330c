"""posttrain.atomic's file writer and output check, directly (test_atomic_writes.py holds
the interrupted writers, the directories and the sweeps): where the temporary file is
made, the mode it ends with, its text, the parents it creates, and the kernel file
systems an output path is refused under."""

from __future__ import annotations

import os
import pathlib

import pytest

from posttrain import atomic


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
def test_the_file_gets_the_mode_open_would_give_it(tmp_path, umask):
    """0666 less the umask, as a plain ``open`` creates it (mkstemp's own 0600 would hide
    a file from the group a umask of 0022 lets read it)."""
    old = os.umask(umask)
    try:
        atomic.write_text(tmp_path / "f.json", "{}")
    finally:
        os.umask(old)
    assert (tmp_path / "f.json").stat().st_mode & 0o777 == 0o666 & ~umask
    assert atomic.current_umask() == old  # read, and left as it was


def test_the_temporary_is_a_hidden_sibling_renamed_over_the_file(tmp_path, monkeypatch):
    """The temporary lives in the file's own directory (a rename across file systems is
    no rename), named ``.<name>.<random>.tmp``, and the text arrives whole as UTF-8."""
    renamed = []
    replace = os.replace

    def spy(src, dst):
        renamed.append((pathlib.Path(src), pathlib.Path(dst)))
        replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    target = tmp_path / "out" / "metrics.jsonl"
    atomic.write_text(target, "ü ∑ 🙂\n", fsync=False)
    [(src, dst)] = renamed
    assert dst == target and src.parent == target.parent
    assert src.name.startswith(".metrics.jsonl.") and src.name.endswith(".tmp")
    assert target.read_bytes() == "ü ∑ 🙂\n".encode()
    assert sorted(p.name for p in target.parent.iterdir()) == ["metrics.jsonl"]


def test_missing_parents_are_made(tmp_path):
    target = tmp_path / "a" / "b" / "c.txt"
    atomic.write_text(target, "x")
    assert target.read_text() == "x"


@pytest.mark.parametrize("output", ["/proc/self/out.jsonl", "/sys/out.jsonl", "/dev/out.jsonl"])
def test_an_output_under_a_kernel_file_system_is_refused(output):
    """/proc, /sys and /dev hold no files a run writes, even where a root user may write
    there; the refusal names the path."""
    with pytest.raises(ValueError, match="is under a kernel file system; expected a file"):
        atomic.check_output_file(output)
    with pytest.raises(ValueError, match=f"^--json '{output}' is under"):
        atomic.check_output_file(output, flag="--json")
