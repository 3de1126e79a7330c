"""Directories are written whole or not at all: durable, with the umask's mode, cleaned up
after a kill (SIGTERM, SIGINT, or a dead writer's leftovers swept at the next run)."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import textwrap

import pytest

from posttrain.conversion import directories
from posttrain.conversion import safetensors_io as sio

pytestmark = pytest.mark.host


def fd_path(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


def test_files_the_directory_and_its_parent_are_fsynced(tmp_path, monkeypatch):
    """What a power cut needs (it cannot be simulated): every file and the directory are
    flushed before the rename, the parent directory after it."""
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd_path(fd)), real_fsync(fd)))
    dst = tmp_path / "out"
    with directories.atomic_directory(dst) as tmp:
        (tmp / "config.json").write_text("{}\n")
        (tmp / "weights.bin").write_bytes(b"\0" * 10)
    tmp_config = next(p for p in synced if p.endswith("config.json"))
    assert ".out.tmp-" in tmp_config  # flushed before the rename
    assert any(p.endswith("weights.bin") for p in synced)
    assert synced.index(str(tmp_path)) == len(synced) - 1  # the parent, last
    assert any(".out.tmp-" in p and not p.endswith((".json", ".bin")) for p in synced)


def test_without_fsync_nothing_is_flushed(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "fsync", lambda fd: pytest.fail(f"fsync of {fd_path(fd)}"))
    with directories.atomic_directory(tmp_path / "out", fsync=False) as tmp:
        (tmp / "config.json").write_text("{}\n")
    assert (tmp_path / "out" / "config.json").is_file()


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_the_directory_mode_follows_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        with directories.atomic_directory(tmp_path / "out", fsync=False):
            pass
    finally:
        os.umask(old)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o777 & ~umask


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_stale_temporaries_of_dead_writers_are_swept_and_nothing_else(tmp_path):
    """Every dead writer's temporary in the parent goes, whatever destination it was for
    (a killed conversion to another name leaked 30-220 MB until a conversion to that same
    name, #40); a live writer's and a name not provably ours stay."""
    stale = tmp_path / f".out.tmp-{dead_pid()}-abc123"
    live = tmp_path / f".out.tmp-{os.getpid()}-def456"  # a writer still running
    foreign = tmp_path / ".out.tmp-q8x7"  # no pid: not provably ours
    other = tmp_path / f".other.tmp-{dead_pid()}-xyz"  # another destination's
    converting = tmp_path / f".run.convert-{dead_pid()}-k2"  # a run's on-the-fly conversion
    for d in (stale, live, foreign, other, converting):
        d.mkdir()
        (d / "shard").write_bytes(b"x")
    with directories.atomic_directory(tmp_path / "out", fsync=False):
        pass
    assert not stale.exists() and not other.exists() and not converting.exists()
    assert live.is_dir() and foreign.is_dir()


def test_convert_names_the_temporaries_it_swept(tmp_path, capsys):
    from posttrain import cli
    from posttrain.conversion import save_native
    from posttrain.models import build_model, flat_params, get_config

    cfg = get_config("llama3-tiny")
    native = save_native(flat_params(build_model(cfg)), cfg, tmp_path / "native")
    pid = dead_pid()
    stale = [tmp_path / f".a.tmp-{pid}-x1", tmp_path / f".b.convert-{pid}-y2"]
    for d in stale:
        (d / "sub").mkdir(parents=True)
    argv = ["convert", "--from", "native", "--to", "hf", str(native), str(tmp_path / "hf")]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    names = ", ".join(sorted(d.name for d in stale))
    assert f"swept 2 temporaries of killed writers in {tmp_path}: " in out, out
    assert sorted(out.split(": ", 1)[1].splitlines()[0].split(", ")) == names.split(", ")
    assert not any(d.exists() for d in stale)


WRITER = textwrap.dedent(
    """
    import signal, time
    from posttrain import cli

    # Python leaves SIGINT ignored when it starts ignored, as in a job a script started
    # with `&`; the user's Ctrl-C reaches a foreground process, which this one stands for.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from posttrain.conversion import safetensors_io as sio

    real = sio.CheckpointWriter.write
    def slow(self, *args, **kwargs):
        real(self, *args, **kwargs)
        print("writing", flush=True)
        time.sleep(60)
    sio.CheckpointWriter.write = slow
    cli.run()  # the posttrain script
    """
)


@pytest.mark.parametrize(
    "sig",
    [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)],  # gate: one signal
    ids=["SIGTERM", "SIGINT"],
)
def test_a_killed_conversion_leaves_nothing_and_prints_one_line(tmp_path, sig):
    from posttrain.conversion import save_native
    from posttrain.models import build_model, flat_params, get_config

    cfg = get_config("llama3-tiny")
    native = save_native(flat_params(build_model(cfg)), cfg, tmp_path / "native")
    out = tmp_path / "out"
    out.mkdir()
    argv = ["convert", "--from", "native", "--to", "hf", str(native), str(out / "hf")]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout.readline().strip() == "writing"
    assert any(p.name.startswith(".hf.tmp-") for p in out.iterdir())  # mid-write
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == (143 if sig == signal.SIGTERM else 130), err
    assert err == f"posttrain: interrupted ({sig.name})\n"
    assert list(out.iterdir()) == []


def test_sweep_ignores_a_missing_parent(tmp_path):
    assert directories.sweep_stale_temporaries(pathlib.Path(tmp_path / "no")) == []


def test_unwritable_destinations_are_refused_up_front(tmp_path, monkeypatch, capsys):
    """A parent the user cannot write (seen as non-root; emulated here, where root may
    write anywhere): convert and sft refuse with one line before reading their input."""
    from posttrain import cli

    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(
        os, "access", lambda p, mode: False if pathlib.Path(p) == locked else real_access(p, mode)
    )
    argv = ["convert", "--from", "hf", "--to", "native", str(tmp_path / "nope"), str(locked / "x")]
    assert cli.main(argv) == 2
    assert f"output parent directory {locked} is not writable" in capsys.readouterr().err
    assert cli.main(["sft", "--output", str(locked / "run")]) == 2
    assert f"{locked} is not writable" in capsys.readouterr().err
    assert list(locked.iterdir()) == []


# --- interrupts at each point, and another user's writer ------------------------------

INTERRUPTS = [KeyboardInterrupt, SystemExit, OSError]  # Ctrl-C / SIGTERM, sys.exit, an error


class _FailingFile:
    """A file object whose ``write`` raises ``error`` (an interrupt mid-write)."""

    def __init__(self, inner, error):
        self._inner, self._error = inner, error

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._inner.close()

    def write(self, text):
        self._inner.write(text[: len(text) // 2])
        raise self._error

    def __getattr__(self, name):
        return getattr(self._inner, name)


@pytest.mark.parametrize("error", INTERRUPTS, ids=lambda e: e.__name__)
@pytest.mark.parametrize("point", ["write", "fsync", "chmod", "replace"])
def test_an_atomic_file_write_interrupted_at_any_point_leaves_the_old_file(
    tmp_path, monkeypatch, error, point
):
    """``atomic.write_text`` interrupted by KeyboardInterrupt, SystemExit or an OSError
    raised at each of its steps (mid-write, the fsync, the chmod, the rename): the
    exception propagates, the old file is whole, and no temporary is left."""
    from posttrain import atomic

    path = tmp_path / "report.json"
    path.write_text("old")
    raised = error("at " + point)

    def fail(*args, **kwargs):
        raise raised

    if point == "write":
        fdopen = os.fdopen
        monkeypatch.setattr(
            atomic.os, "fdopen", lambda *a, **k: _FailingFile(fdopen(*a, **k), raised)
        )
    else:
        monkeypatch.setattr(atomic.os, point, fail)
    with pytest.raises(error, match=f"at {point}"):
        atomic.write_text(path, "new" * 1000)
    monkeypatch.undo()
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


@pytest.mark.parametrize("error", INTERRUPTS, ids=lambda e: e.__name__)
@pytest.mark.parametrize("point", ["block", "chmod", "fsync", "rename"])
def test_an_atomic_directory_interrupted_at_any_point_leaves_nothing(
    tmp_path, monkeypatch, error, point
):
    """``atomic_directory`` interrupted inside its block or at its chmod, fsync or rename
    (KeyboardInterrupt, SystemExit, OSError): no ``dst``, no temporary sibling."""
    raised = error("at " + point)

    def fail(*args, **kwargs):
        raise raised

    if point != "block":
        target = {
            "chmod": (directories.os, "chmod"),
            "fsync": (directories, "fsync_path"),
            "rename": (directories.os, "rename"),
        }
        monkeypatch.setattr(*target[point], fail)
    out = tmp_path / "out"
    with pytest.raises(error, match=f"at {point}"), directories.atomic_directory(out) as tmp:
        (tmp / "model.safetensors").write_bytes(b"x" * 64)
        if point == "block":
            raise raised
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """A native llama3-tiny checkpoint directory (written once for this module)."""
    from posttrain.conversion import save_native
    from posttrain.models import build_model, flat_params, get_config

    cfg = get_config("llama3-tiny")
    return save_native(flat_params(build_model(cfg)), cfg, tmp_path_factory.mktemp("native") / "n")


def _is_link(fd: int) -> bool:
    try:
        fd_path(fd)
    except OSError:  # closed between listing and reading
        return False
    return True


@pytest.mark.parametrize("error", [KeyboardInterrupt, SystemExit], ids=lambda e: e.__name__)
@pytest.mark.parametrize("point", ["write", "finish"])
def test_a_conversion_interrupted_mid_shard_leaves_nothing(
    tmp_path, monkeypatch, native, error, point
):
    """An in-process conversion (native -> HF) interrupted while its writer writes the
    second tensor or finishes its shards: the exception propagates, the shard files are
    closed, and the output's parent holds nothing."""
    from posttrain.conversion import convert_native_to_hf

    calls = []
    real = getattr(sio.CheckpointWriter, point)

    def interrupted(self, *args, **kwargs):
        calls.append(point)
        if point == "finish" or len(calls) == 2:
            raise error(f"at {point}")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(sio.CheckpointWriter, point, interrupted)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(error, match=f"at {point}"):
        convert_native_to_hf(native, out / "hf", fsync=False)
    assert list(out.iterdir()) == []
    fds = [fd_path(int(fd)) for fd in os.listdir("/proc/self/fd") if _is_link(int(fd))]
    assert not [f for f in fds if f.startswith(str(out))], fds  # every shard closed


@pytest.mark.parametrize(
    ("raised", "swept"),
    [(None, False), (PermissionError, False), (ProcessLookupError, True)],
    ids=["own-live", "other-users-live", "dead"],
)
def test_a_temporary_is_swept_only_when_its_writer_is_gone(tmp_path, monkeypatch, raised, swept):
    """The sweep asks ``os.kill(pid, 0)``: no error (our live process), PermissionError
    (alive, another user's: a shared output directory) keep the temporary; only
    ProcessLookupError (no such process) sweeps it."""
    pid = 4_000_000  # beyond pid_max: only the fake below answers for it
    asked = []

    def kill(p, sig):
        asked.append((p, sig))
        if raised is not None:
            raise raised(1, "from os.kill")

    monkeypatch.setattr(directories.os, "kill", kill)
    temporary = tmp_path / f".out.tmp-{pid}-abc123"
    temporary.mkdir()
    assert directories.sweep_stale_temporaries(tmp_path, "out") == ([temporary] if swept else [])
    assert asked == [(pid, 0)]
    assert temporary.exists() is not swept


def test_the_destination_is_refused_in_one_line_naming_the_path(tmp_path):
    """``check_destination``: an existing output, a missing parent, a parent that is a
    file: each its own line naming the path; a new path under a directory passes."""
    from posttrain.conversion.errors import ConversionError

    (tmp_path / "there").mkdir()
    (tmp_path / "file").write_text("x")
    cases = {
        tmp_path / "there": f"output directory {tmp_path / 'there'} exists; give a new path",
        tmp_path / "no" / "x": f"output parent directory {tmp_path / 'no'} does not exist",
        tmp_path / "file" / "x": f"output parent {tmp_path / 'file'} is a file; expected a "
        "directory",
    }
    for path, message in cases.items():
        with pytest.raises(ConversionError) as raised:
            directories.check_destination(path)
        assert str(raised.value) == message
    directories.check_destination(tmp_path / "new")  # nothing raised, nothing made
    assert not (tmp_path / "new").exists()
