"""A full disk during a training run (#40): one line naming what was being written and
the bytes that did not fit, exit 2, no tracebacks, no unfinished checkpoint left
(:mod:`posttrain.training.stops`).

Emulation: the gate raises ``OSError(errno.ENOSPC)`` at a write point of a real run (the
run record) and feeds the recognisers the messages tensorstore really gives; the slow
tier runs ``sft`` and ``dpo`` in a subprocess under a tiny ``RLIMIT_FSIZE`` (a tmpfs needs
root), where Orbax's real writes fail with ``EFBIG`` ("File too large"), the same path as
``ENOSPC``.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from posttrain import cli, signals
from posttrain.training import stops

pytestmark = pytest.mark.host

TENSORSTORE = (
    'OUT_OF_RANGE: Error writing "model.embed_tokens.embedding.value/0.0" in OCDBT database '
    'at local file "/r/checkpoints/2.orbax-checkpoint-tmp/model_params.orbax-checkpoint-tmp/'
    'ocdbt.process_0/": Failed writing: "/r/checkpoints/2.orbax-checkpoint-tmp/model_params.'
    'orbax-checkpoint-tmp/ocdbt.process_0/d/fc70": Failed to write 289023 bytes to file 23: '
    "{reason} [os_error_code='{code}']"
)


@pytest.fixture
def restored_hooks():
    """A failed :func:`stops.clean_stop` leaves its hooks and filter for the exit: put
    them back for the next tests."""
    hooks, filters = (sys.excepthook, sys.unraisablehook), list(logging.getLogger("absl").filters)
    yield
    sys.excepthook, sys.unraisablehook = hooks
    logging.getLogger("absl").filters[:] = filters


@pytest.mark.parametrize(
    ("error", "line"),
    [
        (
            ValueError(TENSORSTORE.format(reason="No space left on device", code=28)),
            "disk full (No space left on device) writing checkpoint step 2 in /r/checkpoints; "
            "a write of 289,023 bytes did not fit; the unfinished checkpoint is removed",
        ),
        (
            ValueError(TENSORSTORE.format(reason="File too large", code=27)),
            "disk full (File too large) writing checkpoint step 2 in /r/checkpoints; a write",
        ),
        (
            OSError(errno.ENOSPC, "No space left on device", "/r/model-step4/model.safetensors"),
            "disk full (No space left on device) writing /r/model-step4/model.safetensors; the",
        ),
        (
            OSError(errno.EDQUOT, "Disk quota exceeded"),
            "disk full (Disk quota exceeded) writing /r;",
        ),
    ],
    ids=["tensorstore-enospc", "tensorstore-efbig", "oserror-enospc", "oserror-quota"],
)
def test_a_full_disk_is_one_line_naming_what_was_written(error, line):
    assert stops.disk_full_line(error, "/r").startswith(line)


@pytest.mark.parametrize(
    "error",
    [
        ValueError("OUT_OF_RANGE: other [os_error_code='2']"),
        OSError(errno.ENOENT, "No such file"),
        RuntimeError("boom"),
    ],
)
def test_other_errors_are_not_a_full_disk(error):
    assert stops.disk_full_line(error, "/r") is None


def test_orbax_records_of_a_full_disk_and_the_cascade_after_are_dropped():
    logger = logging.getLogger("absl.test_disk_full")  # a child: records reach "absl"
    seen = []
    handler = logging.Handler()
    handler.emit = seen.append
    quiet = stops.DiskFullFilter()
    logger.addHandler(handler)
    logger.addFilter(quiet)
    try:
        logger.warning("a warning before")
        logger.error("no commit: %s", TENSORSTORE.format(reason="File too large", code=27))
        logger.error("Save Finalize thread (save_finalize) failed.")
        logger.warning("a warning after")
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in seen] == ["a warning before", "a warning after"]
    assert quiet.dropped == 2


@pytest.mark.slow  # builds the model and the trainer (~4 s quiet); the gate has the next
@pytest.mark.devices(8)
def test_enospc_at_a_write_point_of_a_real_run_is_one_line(tmp_path, capsys, monkeypatch):
    """``OSError(ENOSPC)`` raised where the run writes its record (after the model and
    the trainer are built): one line, exit 2."""
    from posttrain.training import supervised

    def full(out, *args):
        raise OSError(errno.ENOSPC, "No space left on device", str(out / "run.json"))

    monkeypatch.setattr(supervised.run_record, "begin_segment", full)
    out = tmp_path / "run"
    assert cli.main(["sft", "--steps", "2", "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"posttrain: error: disk full (No space left on device) writing {out / 'run.json'}; "
        "the unfinished checkpoint is removed: free space and rerun with the same --output "
        "to resume\n"
    )


def test_enospc_inside_a_run_is_a_disk_full_error_and_sweeps_at_exit(
    tmp_path, monkeypatch, restored_hooks
):
    registered = []
    monkeypatch.setattr(signals.atexit, "register", lambda *a: registered.append(a))
    monkeypatch.setattr(signals, "_AT_EXIT", [])
    with pytest.raises(stops.DiskFullError) as error, stops.clean_stop(str(tmp_path)):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "metrics.jsonl"))
    assert str(error.value).startswith(
        f"disk full (No space left on device) writing {tmp_path / 'metrics.jsonl'}; "
    )
    assert isinstance(error.value, ValueError)  # the CLI: one line, exit 2
    assert len(registered) == 1


LIMITED = textwrap.dedent(
    """
    import os, resource, signal, sys
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill
    resource.setrlimit(resource.RLIMIT_FSIZE, (30_000, 30_000))
    from posttrain import cli
    sys.exit(cli.main(sys.argv[1:]))
    """
)


@pytest.mark.slow  # a real run in a subprocess (~30 s each)
@pytest.mark.parametrize("command", ["sft", "dpo"])
def test_a_real_run_out_of_room_for_its_checkpoint(tmp_path, command):
    out = tmp_path / "run"
    argv = [command, "--devices", "2", "--steps", "4", "--save-every", "2", "--output", str(out)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    # stderr is a pipe: a file there would be cut at the limit too
    done = subprocess.run(
        [sys.executable, "-c", LIMITED, *argv], capture_output=True, text=True, env=env
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.count("\n") == 1, done.stderr[-2000:]
    assert done.stderr.startswith(
        f"posttrain: error: disk full (File too large) writing checkpoint step 2 in "
        f"{out / 'checkpoints'}; a write of "
    ), done.stderr
    assert not [p for p in out.rglob("*") if "orbax-checkpoint-tmp" in p.name]
    assert signal.SIGXFSZ  # the limit's signal exists on this platform


def test_other_threads_say_nothing_of_the_closed_loop_or_after_a_full_disk():
    """tensorstore's callbacks fail on the event loop Orbax closed, in their own threads,
    sometimes before Orbax logs the full disk: silenced; anything else before a full
    disk, and the main thread always, still print."""
    import threading

    printed = []
    quiet = stops.DiskFullFilter()
    on_exception, _ = stops._after_disk_full(quiet, lambda *a: printed.append(a[1]), lambda u: None)

    def in_a_thread(error):
        thread = threading.Thread(target=on_exception, args=(type(error), error, None))
        thread.start()
        thread.join()

    closed, other = RuntimeError("Event loop is closed"), RuntimeError("other")
    in_a_thread(closed)
    in_a_thread(other)
    on_exception(RuntimeError, closed, None)  # the main thread
    assert printed == [other, closed]
    quiet.first = "disk full"
    in_a_thread(other)
    assert printed == [other, closed] and quiet.dropped == 2
