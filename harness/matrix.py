"""The Tunix compatibility matrix: one cached environment per ``compat/entries.toml``
entry, the contracts and a short real SFT run inside each, and a report.

Per entry:

1. Environment (:class:`EnvCache`): ``uv venv`` + ``uv pip install`` of this checkout
   (editable, ``[train]`` extra), ``google-tunix==X``, the entry's pins and the test
   tools; pip when uv is missing. Kept under the cache root in a directory named by a
   key hashed from everything that goes into it (Python, Tunix version, pins, the
   project's dependency list); a marker file written last makes a half-built env
   never reused. A failed build is an ``error`` row, not a crash.
2. Contracts: ``pytest contracts/`` in that env on 8 fake CPU devices, JUnit XML to
   ``<report-dir>/matrix/<entry>.xml``. ``POSTTRAIN_CONTRACT_CONVENTIONS`` selects the
   conventions the SFT contracts drive: ``installed`` for a release row, the emulated
   convention for an emulated row (run in the env of its ``base``).
3. SFT: ``posttrain sft`` (qwen3-tiny, LoRA rank 4, gradient accumulation 2, 4 steps,
   8 fake devices); passes when it exits 0 and its metrics hold finite losses.

The report (``compat-matrix.{md,json,html}``): rows = entries, columns = contracts
(tests grouped by their ``contract(name)`` marker, else by test function) plus
``sft``; each cell pass / fail / skip / error with the first error line; and for each
contract that fails somewhere, the first failing entry after a passing one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from harness import junit
from harness.devices import DISTRIBUTIONS, suite_env
from posttrain.sft import tunix_compat

REPO = Path(__file__).resolve().parent.parent
ENTRIES_FILE = REPO / "compat" / "entries.toml"
DEFAULT_CACHE = Path(
    os.environ.get("POSTTRAIN_MATRIX_CACHE", Path.home() / ".cache" / "posttrain-harness" / "envs")
)
CONVENTIONS: tuple[str, ...] = tuple(tunix_compat.KNOWN.values())
FLAVOURS = ("current", "era", "emulated")
TEST_TOOLS = ("pytest>=8", "pytest-xdist>=3.5", "hypothesis>=6.100")
SFT_RUN: dict[str, Any] = {
    "model": "qwen3-tiny",
    "lora_rank": 4,
    "grad_accum": 2,
    "steps": 4,
    "max_target_length": 64,
    "save_every": 2,
}
"""The matrix's SFT run, as ``SFTConfig`` fields: a release row passes them to
``posttrain sft`` as options (:func:`sft_argv`), an emulated row to ``run_sft``."""


def sft_argv(output: str) -> list[str]:
    """``posttrain`` arguments of :data:`SFT_RUN` writing to ``output``."""
    options = [x for k, v in SFT_RUN.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    return ["sft", *options, "--output", output]


@dataclasses.dataclass(frozen=True)
class Entry:
    """One matrix row (see ``compat/entries.toml`` for the fields)."""

    name: str
    tunix: str
    flavour: str
    convention: str
    pins: tuple[str, ...] = ()
    default: bool = False
    emulated: bool = False
    base: str | None = None
    broken: str | None = None
    requirements: tuple[str, ...] | None = None  # tests: replaces the whole install spec

    def install_spec(self) -> list[str]:
        """What ``uv pip install`` gets besides the editable checkout."""
        if self.requirements is not None:
            return list(self.requirements)
        return [f"google-tunix=={self.tunix}", *self.pins, *TEST_TOOLS]


def load_entries(path: Path = ENTRIES_FILE) -> list[Entry]:
    """Reads and checks the entries.

    Raises:
      ValueError: naming the file, entry or field: a missing or malformed file, an entry
        that is not a table, an unknown key, flavour or convention, a field of the wrong
        type (``pins`` a string), a duplicate name, an emulated entry without ``base``.
    """
    path = Path(path)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise ValueError(f"entries file {path} {what}; expected a TOML file")
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f).get("entry", [])
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"entries file {path}: not valid TOML ({e})") from None
    if not isinstance(raw, list):
        raise ValueError(f"{path}: 'entry' is a {type(raw).__name__}; expected [[entry]] tables")
    fields = {f.name for f in dataclasses.fields(Entry)}
    entries: list[Entry] = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise ValueError(f"{path}: entry {i} is a {type(item).__name__}; expected a table")
        where = f"{path}: entry {i} ({item.get('name', '?')})"
        unknown = sorted(set(item) - fields)
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown}; expected {sorted(fields)}")
        for name in ("name", "tunix", "flavour", "convention"):
            if not isinstance(item.get(name), str):
                raise ValueError(f"{where}: {name} = {item.get(name)!r}; expected a string")
        pins = item.get("pins", [])
        if not (isinstance(pins, list) and all(isinstance(p, str) for p in pins)):
            raise ValueError(f"{where}: pins = {pins!r}; expected a list of requirement strings")
        try:
            entry = Entry(**{**item, "pins": tuple(pins)})
        except TypeError as e:
            raise ValueError(f"{where}: {e}") from None
        if entry.flavour not in FLAVOURS:
            raise ValueError(f"{where}: flavour {entry.flavour!r}; expected one of {FLAVOURS}")
        if entry.convention not in CONVENTIONS:
            raise ValueError(
                f"{where}: convention {entry.convention!r}; expected one of {CONVENTIONS}"
            )
        if any(e.name == entry.name for e in entries):
            raise ValueError(f"{where}: duplicate name")
        entries.append(entry)
    names = {e.name for e in entries}
    for e in entries:
        if e.emulated and e.base not in names:
            raise ValueError(f"{path}: entry {e.name}: base {e.base!r} is not an entry")
    return entries


def select(
    entries: list[Entry], only: Sequence[str] = (), all_entries: bool = False
) -> list[Entry]:
    """``--only`` names (or prefixes), else every entry with ``--all``, else the defaults.

    Raises:
      ValueError: an ``--only`` value matches no entry.
    """
    if only:
        chosen = []
        for name in only:
            match = [e for e in entries if e.name == name] or [
                e for e in entries if e.name.startswith(name)
            ]
            if not match:
                raise ValueError(
                    f"--only {name!r} matches no entry; entries: "
                    f"{', '.join(e.name for e in entries)}"
                )
            chosen += [e for e in match if e not in chosen]
        return chosen
    return list(entries) if all_entries else [e for e in entries if e.default]


def project_requirements() -> list[str]:
    """The package's own dependency list (part of every env key)."""
    with open(REPO / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    return [*project["dependencies"], *project["optional-dependencies"]["train"]]


def env_key(entry: Entry) -> str:
    """Hash of what goes into the entry's environment."""
    blob = json.dumps(
        {
            "python": sys.version_info[:2],
            "spec": entry.install_spec(),
            "project": project_requirements(),
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


def _run(command: Sequence[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(list(command), capture_output=True, text=True, env=env, check=False)


_EXCEPTION = re.compile(r"^(posttrain: error: |[A-Za-z_][\w.]*(Error|Exception|Exit)\b:?)")


def _first_error(text: str) -> str:
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

    def __init__(self, root: Path = DEFAULT_CACHE, run: Runner = _run) -> None:
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
        error = self._build(entry, target)
        if error:
            shutil.rmtree(target, ignore_errors=True)
            return EnvResult(None, True, time.monotonic() - start, error)
        marker.write_text(
            json.dumps({"entry": entry.name, "key": env_key(entry), "spec": entry.install_spec()})
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
        for step in steps:
            done = self.run(step, None)
            if done.returncode != 0:
                return f"environment build failed: {_first_error(done.stderr + done.stdout)}"
        return None


def versions(python: Path, run: Runner = _run) -> dict[str, str]:
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


def junit_cells(path: Path) -> dict[str, dict[str, str]]:
    """Contract -> ``{"status", "message"}`` from one JUnit file (status: one of
    :data:`harness.junit.OUTCOMES`).

    Tests group by their ``contract`` property (the plugin records the marker) or,
    without one, by test function; a group takes its worst test's outcome and message.
    """
    cells: dict[str, dict[str, str]] = {}
    for case in junit.read(path, width=300).cases:
        name = case.properties.get("contract") or case.name.split("[")[0]
        old = cells.get(name)
        if old is None or junit.worst([old["status"], case.outcome]) != old["status"]:
            cells[name] = {"status": case.outcome, "message": case.message}
    return cells


def run(
    chosen: Sequence[Entry],
    entries: Sequence[Entry],
    cache: EnvCache,
    report_dir: Path,
    jobs: str,
    *,
    rebuild: bool = False,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
    runner: Runner | None = None,
) -> list[dict[str, Any]]:
    """Builds (or reuses) each chosen entry's environment and runs it; its report rows,
    one per entry in order (:func:`run_entry`). ``entries``: all of them, where an
    emulated entry finds the release whose environment it borrows. Progress goes to
    ``log``, one line per stage; ``runner`` runs the commands (tests: a fake)."""
    by_name = {e.name: e for e in entries}
    rows = []
    for i, entry in enumerate(chosen, 1):
        env_entry = by_name[entry.base] if entry.emulated else entry
        where = f"[{i}/{len(chosen)}] {entry.name}"
        log(f"{where}: environment {cache.path(env_entry).name}")
        env = (
            EnvResult(None, False, 0.0)
            if entry.broken
            else cache.ensure(env_entry, rebuild=rebuild)
        )
        log(
            f"{where}: {'env error: ' + env.error if env.error else 'running contracts and sft'}"
            f" ({'built' if env.built else 'cached'} in {env.seconds:.0f} s)"
        )
        row = run_entry(entry, env, report_dir, jobs, run=runner or _run)
        rows.append(row)
        cells = [*row["contracts"].values(), *([row["sft"]] if row["sft"] else [])]
        bad = [c for c in cells if c["status"] in ("failed", "error")]
        log(
            f"{where}: {len(cells) - len(bad)}/{len(cells)} cells pass"
            f"{'; ' + row['error'] if row.get('error') else ''} ({row['seconds']:.0f} s)"
        )
    return rows


def run_entry(
    entry: Entry, env: EnvResult, report_dir: Path, jobs: str, run: Runner = _run
) -> dict[str, Any]:
    """Contracts and the SFT run of one entry in its env; the report row.

    The row (what ``reports/compat-matrix.json`` holds per entry):
      ``name``, ``tunix``, ``flavour``, ``convention``, ``emulated``: the entry's;
      ``env``: ``{"built": bool, "seconds": float, "error": str | None}``;
      ``versions``: distribution -> version installed in the env (``{}`` if not run);
      ``contracts``: contract -> ``{"status", "message"}``, status one of
        :data:`harness.junit.OUTCOMES` (:func:`junit_cells`);
      ``sft``: ``{"status": "passed" | "failed", "message"}`` or ``None`` (not run);
      ``seconds``: wall time of the contracts and the SFT run;
      ``error`` (only when the entry could not run): why, in one line.
    """
    row: dict[str, Any] = {
        "name": entry.name,
        "tunix": entry.tunix,
        "flavour": entry.flavour,
        "convention": entry.convention,
        "emulated": entry.emulated,
        "env": {"built": env.built, "seconds": round(env.seconds, 1), "error": env.error},
        "versions": {},
        "contracts": {},
        "sft": None,
        "seconds": 0.0,
    }
    if env.error or entry.broken:
        row["error"] = env.error or f"not run: {entry.broken}"
        return row
    start = time.monotonic()
    row["versions"] = versions(env.python, run)
    junit = report_dir / "matrix" / f"{entry.name}.xml"
    junit.parent.mkdir(parents=True, exist_ok=True)
    junit.unlink(missing_ok=True)
    environ = {
        # The compile cache in the environment's folder: a warm environment is also a warm
        # compile cache, and --rebuild (or a changed key) starts both afresh.
        **suite_env(str(env.path / "jax-compile")),
        "POSTTRAIN_DEVICES": "8",
        "JAX_PLATFORMS": "cpu",
        "POSTTRAIN_CONTRACT_CONVENTIONS": entry.convention if entry.emulated else "installed",
    }
    environ.pop("VIRTUAL_ENV", None)
    command = [
        str(env.python),
        "-m",
        "pytest",
        str(REPO / "contracts"),
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
        "--rootdir",
        str(REPO),
    ]
    if jobs not in ("0", "1"):
        command += ["-n", jobs]
    # A release row: the installed train(); an emulated row: only what drives its convention.
    command += ["--conventions", entry.convention if entry.emulated else "installed"]
    done = run(command, environ)
    if junit.is_file():
        row["contracts"] = junit_cells(junit)
    if not row["contracts"]:
        row["error"] = f"contracts did not run: {_first_error(done.stdout + done.stderr)}"
    row["sft"] = _sft(entry, env, environ, run)
    row["seconds"] = round(time.monotonic() - start, 1)
    return row


def _sft(entry: Entry, env: EnvResult, environ: dict[str, str], run: Runner) -> dict[str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        if entry.emulated:
            code = (
                f"import sys; sys.path.insert(0, {str(REPO)!r})\n"
                f"from harness.matrix import emulated_sft; "
                f"emulated_sft({entry.convention!r}, {tmp!r})"
            )
            command = [str(env.python), "-c", code]
        else:
            command = [str(env.python), "-m", "posttrain.cli", *sft_argv(tmp)]
        done = run(command, environ)
        metrics = Path(tmp) / "metrics.jsonl"
        losses = (
            [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
            if metrics.is_file()
            else []
        )
    if done.returncode == 0 and losses and all(x == x and abs(x) < 1e6 for x in losses):
        return {
            "status": "passed",
            "message": f"{len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}",
        }
    return {"status": "failed", "message": _first_error(done.stderr + done.stdout)}


def emulated_sft(convention: str, output: str) -> None:
    """The matrix's SFT run under an emulated convention (called inside the entry's env)."""
    from harness.devices import configure_devices

    configure_devices(8)
    from contracts import tunix_emulation
    from posttrain.sft.run import SFTConfig, run_sft
    from posttrain.sft.trainer import sft_trainer_class

    base = {
        "positional3": tunix_emulation.Positional3PeftTrainer,
        "bound2": tunix_emulation.Bound2PeftTrainer,
        "bound3_update": tunix_emulation.MainPeftTrainer,
    }[convention]
    run_sft(SFTConfig(**SFT_RUN, output=output), trainer_class=sft_trainer_class(base))
