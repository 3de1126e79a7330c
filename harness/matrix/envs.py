"""One cached environment per matrix entry: ``uv venv`` + ``uv pip install`` of this
checkout (editable, ``[train]`` extra), the entry's Tunix, pins and test tools.

Kept under the cache root in a directory named by a key hashed from everything that
goes into it (Python, Tunix version or resolved source, pins, the project's dependency
list); a marker file written last makes a half-built environment never reused. pip
when uv is missing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path

from harness.devices.devices import DISTRIBUTIONS
from harness.matrix import sources
from harness.matrix.entries import REPO, Entry

DEFAULT_CACHE = Path(
    os.environ.get("POSTTRAIN_MATRIX_CACHE", Path.home() / ".cache" / "posttrain-harness" / "envs")
)


def project_requirements() -> list[str]:
    """The package's own dependency list (part of every env key)."""
    with open(REPO / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    return [*project["dependencies"], *project["optional-dependencies"]["train"]]


def env_key(entry: Entry) -> str:
    """Hash of what goes into the entry's environment, the checkout included: it is
    installed editable, so two clones sharing the cache root must not share one."""
    blob = json.dumps(
        {
            "python": sys.version_info[:2],
            "spec": entry.install_spec(),
            "project": project_requirements(),
            "checkout": str(REPO),
            # a source entry: the resolved commit or tree, not only where it lives
            "source": entry.resolved[0] if entry.resolved else None,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclasses.dataclass
class EnvResult:
    path: Path | None
    built: bool  # False: reused from the cache
    seconds: float
    error: str | None = None

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"


Runner = Callable[[Sequence[str], dict[str, str] | None], subprocess.CompletedProcess]


#: the longest one matrix command (an environment's build, an entry's contracts, a run
#: cell) may run, in seconds: past it the command and everything it started are killed
#: and its cell reads ``TimeoutError: ...`` (a hung release ends its row, not the matrix).
#: The README's whole matrix takes about 3 minutes here; a cold environment build
#: downloads for a few.
COMMAND_TIMEOUT_S = 1800.0
#: the exit status a command past :data:`COMMAND_TIMEOUT_S` is given (timeout(1)'s)
TIMED_OUT = 124


def run_command(
    command: Sequence[str], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``command``'s output and exit status; past :data:`COMMAND_TIMEOUT_S` its process
    group is killed (it runs in a session of its own: pytest's xdist workers and the
    cells' ``posttrain`` processes go with it) and the status is :data:`TIMED_OUT`, the
    output ending in a ``TimeoutError`` line that :func:`failure` reports. Interrupted
    while it waits (Ctrl-C, which a session of its own does not hear), it kills the group
    before it re-raises."""
    limit = COMMAND_TIMEOUT_S
    with _start(command, env) as process:
        try:
            out, err = process.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            _kill_group(process.pid)
            out, err = process.communicate()
            err += (
                f"\nTimeoutError: {Path(command[0]).name} ran past the matrix's {limit:g} s "
                "limit on one command; killed with what it started\n"
            )
            return subprocess.CompletedProcess(list(command), TIMED_OUT, out, err)
        except BaseException:  # Ctrl-C, a SIGTERM's exit: its own session hears neither
            _kill_group(process.pid)
            raise
        finally:
            with _LOCK:
                _RUNNING.discard(process.pid)
    return subprocess.CompletedProcess(list(command), process.returncode, out, err)


_RUNNING: set[int] = set()  # the process groups of the commands running now
_LOCK = threading.Lock()


def _start(command: Sequence[str], env: dict[str, str] | None) -> subprocess.Popen:
    with _LOCK:
        process = subprocess.Popen(
            list(command),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        _RUNNING.add(process.pid)
    return process


def kill_running() -> None:
    """Kills the process group of every command :func:`run_command` is waiting on, in any
    thread: what an interrupt of the thread that waits for them must do (the run cells go
    side by side in a pool; Ctrl-C reaches only the main thread)."""
    with _LOCK:
        groups = list(_RUNNING)
    for pid in groups:
        _kill_group(pid)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # it ended in between
        os.killpg(pid, signal.SIGKILL)


_FATAL = re.compile(r"^F\d{4} [\d:.]+\s+\d+ (?P<where>\S+\]) (?P<what>.*)")


def failure(done: subprocess.CompletedProcess) -> str:
    """Why a finished run failed, in one line: a run killed by a signal says so, with the
    signal's name and what it printed last: XLA's first fatal log line where it aborted
    (``F1206 ... rendezvous.cc:161] ...``: SIGABRT), else its last line of output (SIGKILL
    prints nothing: most often the kernel's out-of-memory killer). Otherwise
    :func:`first_error` of its output."""
    text = done.stderr + done.stdout
    if done.returncode >= 0:
        return first_error(text)
    try:
        name = signal.Signals(-done.returncode).name
    except ValueError:
        name = f"signal {-done.returncode}"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    fatal = [m for m in map(_FATAL.match, lines) if m]
    if fatal:
        return f"killed by {name}: {fatal[0]['where']} {fatal[0]['what']}"[:300]
    last = lines[-1][:200] if lines else "nothing"
    hint = " (out of memory?)" if name == "SIGKILL" else ""
    return f"killed by {name}, no error printed{hint}; its last output: {last}"


_EXCEPTION = re.compile(r"^(posttrain: error: |[A-Za-z_][\w.]*(Error|Exception|Exit)\b:?)")


def first_error(text: str) -> str:
    """The most telling line of a failed command's output: the last exception line of a
    traceback (or ``posttrain: error:``), else ``error:`` lines with uv's reason."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if _EXCEPTION.match(line):
            return line[:300]
    for marker in ("error:", "Error:", "ERROR", "Traceback"):
        hits = [i for i, line in enumerate(lines) if marker in line]
        if hits and marker == "Traceback":
            return lines[-1][:300]
        if hits:  # the error line and, for uv, its reason on the next line
            i = hits[-1] if marker != "error:" else hits[0]
            reason = []
            if i + 1 < len(lines) and lines[i + 1].startswith(("cause:", "╰", "Because")):
                for line in lines[i + 1 : i + 6]:
                    if line.startswith(("hint:", "error:")):
                        break
                    reason.append(line.removeprefix("cause:").lstrip("╰─▶│ "))
            return " ".join(" ".join([lines[i], *reason]).split())[:400]
    return lines[-1][:300] if lines else "no output"


class EnvCache:
    """Environments keyed by :func:`env_key` under ``root``."""

    def __init__(self, root: Path = DEFAULT_CACHE, run: Runner = run_command) -> None:
        self.root = Path(root)
        self.run = run

    def path(self, entry: Entry) -> Path:
        return self.root / f"{entry.name}-{env_key(entry)}"

    def ensure(self, entry: Entry, rebuild: bool = False) -> EnvResult:
        """The entry's env, built unless a complete one with the same key exists.

        The marker file is written last, so an interrupted or failed build is never
        reused; a failed build is removed and reported in :attr:`EnvResult.error`.
        """
        start = time.monotonic()
        target = self.path(entry)
        marker = target / "posttrain-env.json"
        if marker.is_file() and not rebuild:
            return EnvResult(target, False, time.monotonic() - start)
        if target.exists():
            shutil.rmtree(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            error = self._build(entry, target)
        except BaseException:  # a signal (SIGTERM, Ctrl-C): no half-built environment left
            shutil.rmtree(target, ignore_errors=True)
            raise
        if error:
            shutil.rmtree(target, ignore_errors=True)
            return EnvResult(None, True, time.monotonic() - start, error)
        marker.write_text(
            json.dumps(
                {
                    "entry": entry.name,
                    "key": env_key(entry),
                    "spec": [sources.redact(x) for x in entry.install_spec()],
                    "source": entry.resolved[0] if entry.resolved else None,
                }
            )
        )
        return EnvResult(target, True, time.monotonic() - start)

    def _build(self, entry: Entry, path: Path) -> str | None:
        uv = shutil.which("uv") or os.environ.get("UV")  # `uv run` exports UV
        python = str(path / "bin" / "python")
        if uv:
            steps = [
                [uv, "venv", "--quiet", "--python", sys.executable, str(path)],
                # --no-config: this checkout's [tool.uv] pins the dev env's Tunix.
                [
                    uv,
                    "pip",
                    "install",
                    "--quiet",
                    "--no-config",
                    "--python",
                    python,
                    "-e",
                    f"{REPO}[train]",
                    *entry.install_spec(),
                    # a source tree changes under the same name: never a cached build of it
                    *(["--refresh-package", "google-tunix"] if entry.source else []),
                ],
            ]
        else:
            steps = [
                [sys.executable, "-m", "venv", str(path)],
                [
                    python,
                    "-m",
                    "pip",
                    "install",
                    "--quiet",
                    "-e",
                    f"{REPO}[train]",
                    *entry.install_spec(),
                ],
            ]
        # a source URL's credentials reach git through the environment, never argv
        environ = sources.install_environ(entry.source)
        for step in steps:
            done = self.run(step, environ if "install" in step else None)
            if done.returncode != 0:
                return f"environment build failed: {first_error(done.stderr + done.stdout)}"
        return None


def versions(python: Path, run: Runner = run_command) -> dict[str, str]:
    """Installed versions of the report's distributions in the env."""
    code = (
        "import importlib.metadata as m, json\n"
        "def v(n):\n"
        "    try: return m.version(n)\n"
        "    except m.PackageNotFoundError: return None\n"
        f"print(json.dumps({{n: v(n) for n in {list(DISTRIBUTIONS)!r}}}))"
    )
    done = run([str(python), "-c", code], None)
    if done.returncode != 0:
        return {}
    return {k: v for k, v in json.loads(done.stdout).items() if v}
