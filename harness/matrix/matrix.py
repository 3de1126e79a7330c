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
4. RL: ``posttrain grpo`` (:data:`RL_RUN`: qwen3-tiny, LoRA rank 4, 2 GRPO steps
   through the release's own learner, no warm-up or evaluation, 8 fake devices); passes
   when it exits 0 and its metrics hold a finite reward and loss per step. Emulated rows
   skip it (the emulation is of SFT's train step; their RL stack is their base
   release's).
5. DPO: ``posttrain dpo`` (:data:`DPO_RUN`: qwen3-tiny, LoRA rank 4, gradient
   accumulation 2, 2 steps through the release's own ``DPOTrainer``, 8 fake devices);
   passes when it exits 0 and its metrics hold a finite loss and margin per step.
   Emulated rows skip it (their DPO contracts run under the emulated convention).

The runs (3.-5., and distill's) are :mod:`harness.matrix.run_cells`' :data:`CELLS`.

The report (``compat-matrix.{md,json,html}``): rows = entries, columns = contracts
(tests grouped by their ``contract(name)`` marker, else by test function) plus
``sft``, ``rl`` and ``dpo``; each cell pass / fail / skip / error with the first error
line; and for each contract that fails somewhere, the first failing entry after a
passing one.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from harness.devices.devices import suite_env
from harness.gate import deprecations, junit
from harness.matrix import run_cells, sources
from harness.matrix.entries import REPO, Entry
from harness.matrix.envs import (
    EnvCache,
    EnvResult,
    Runner,
    first_error,
    kill_running,
    run_command,
    versions,
)
from harness.matrix.progress import Progress


def junit_cells(path: Path, root: Path = REPO) -> dict[str, dict[str, Any]]:
    """Contract -> cell from one JUnit file.

    Tests group by their ``contract`` property (the plugin records the marker) or,
    without one, by test function. A cell is ``{"status", "message", "test"}`` and, when
    upstream deprecations were seen, ``"warnings"``: the status is the worst test's
    outcome (:data:`harness.gate.junit.OUTCOMES`), ``message`` and ``test`` (pytest node id,
    relative to ``root``) are that test's; a passing cell whose tests recorded upstream
    deprecations (:mod:`harness.gate.deprecations`) is ``warned``, its message the first one.
    """
    groups: dict[str, list[junit.Case]] = {}
    for case in junit.read(path, width=300).cases:
        name = case.properties.get("contract") or case.name.split("[")[0]
        groups.setdefault(name, []).append(case)
    cells: dict[str, dict[str, Any]] = {}
    for name, cases in groups.items():
        status = junit.worst(c.outcome for c in cases)
        first = next(c for c in cases if c.outcome == status)
        seen: list[str] = []
        for case in cases:
            seen += [w for w in deprecations.from_properties(case.properties) if w not in seen]
        cell: dict[str, Any] = {"status": status, "message": first.message}
        if status != "passed":
            cell["test"] = first.node_id(root)
        elif seen:
            cell = {"status": "warned", "message": seen[0]}
        if seen:
            cell["warnings"] = seen
        cells[name] = cell
    return cells


def run(
    chosen: Sequence[Entry],
    entries: Sequence[Entry],
    cache: EnvCache,
    report_dir: Path,
    jobs: str,
    *,
    rebuild: bool = False,
    progress: Progress | None = None,
    log: Callable[[str], None] | None = None,
    runner: Runner | None = None,
) -> list[dict[str, Any]]:
    """Builds (or reuses) each chosen entry's environment and runs it; its report rows,
    one per entry in order (:func:`run_entry`). ``entries``: all of them, where an
    emulated entry finds the release whose environment it borrows. ``progress`` shows
    the row and phase (default: log lines on stderr only); its lines, one per stage,
    go to ``log`` when given; ``runner`` runs the commands (tests: a fake)."""
    progress = progress or Progress(len(chosen), live=False)
    log = log or progress.log
    by_name = {e.name: e for e in entries}
    rows = []
    for i, entry in enumerate(chosen, 1):
        where = f"[{i}/{len(chosen)}] {entry.name}"
        progress.row(i, entry.name)
        if entry.source is not None:
            try:
                entry = resolve(entry)
            except sources.SourceError as error:
                log(f"{where}: {error}")
                rows.append(
                    run_entry(entry, EnvResult(None, False, 0.0, str(error)), report_dir, jobs)
                )
                continue
            log(f"{where}: source {entry.source} resolved to {entry.resolved[0]}")
        env_entry = by_name[entry.base] if entry.emulated else entry
        log(f"{where}: environment {cache.path(env_entry).name}")
        progress.phase("environment")
        env = (
            EnvResult(None, False, 0.0)
            if entry.broken
            else cache.ensure(env_entry, rebuild=rebuild)
        )
        cells = ", ".join(run_cells.CELLS)
        log(
            f"{where}: "
            f"{'env error: ' + env.error if env.error else 'running contracts and ' + cells}"
            f" ({'built' if env.built else 'cached'} in {env.seconds:.0f} s)"
        )
        row = run_entry(
            entry, env, report_dir, jobs, run=runner or run_command, phase=progress.phase
        )
        rows.append(row)
        cells = [*row["contracts"].values(), *(row[c] for c in run_cells.CELLS if row.get(c))]
        bad = [c for c in cells if c["status"] in ("failed", "error")]
        log(
            f"{where}: {len(cells) - len(bad)}/{len(cells)} cells pass"
            f"{'; ' + row['error'] if row.get('error') else ''} ({row['seconds']:.0f} s)"
        )
    return rows


def resolve(entry: Entry) -> Entry:
    """A source entry with its source resolved (:func:`harness.matrix.sources.resolve`).

    Raises:
      harness.matrix.sources.SourceError: the source cannot be reached or is not a package.
    """
    assert entry.source is not None
    pinned = sources.resolve(sources.parse(entry.source))
    return dataclasses.replace(entry, resolved=(pinned.id, pinned.requirement))


def run_entry(
    entry: Entry,
    env: EnvResult,
    report_dir: Path,
    jobs: str,
    run: Runner = run_command,
    phase: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Contracts and the SFT run of one entry in its env; the report row. ``phase`` hears
    the name of each phase as it starts (the live progress line).

    The row (what ``reports/compat-matrix.json`` holds per entry):
      ``name``, ``tunix``, ``flavour``, ``convention``, ``emulated``: the entry's;
      ``source`` (source entries only): ``{"spec", "resolved"}``, the spec and the
        commit or tree it resolved to (None when it could not be reached);
      ``env``: ``{"built": bool, "seconds": float, "error": str | None}``;
      ``versions``: distribution -> version installed in the env (``{}`` if not run);
      ``contracts``: contract -> ``{"status", "message", ["test"], ["warnings"]}``,
        status ``warned`` or one of :data:`harness.gate.junit.OUTCOMES` (:func:`junit_cells`);
      ``sft``, ``rl``, ``dpo``: ``{"status": "passed" | "failed" | "skipped", "message"}`` or
        ``None`` (not run); ``skipped``: n/a there, the message says why;
      ``seconds``: wall time of the contracts and the runs;
      ``phase_seconds``: phase -> its wall time (versions, contracts, then each run
        cell's, ``sft run`` ... ``vision run``; the runs go side by side, ``jobs`` at a
        time (:func:`run_side_by_side`), so their times overlap);
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
        "rl": None,
        "dpo": None,
        "distill": None,
        "vision": None,
        "seconds": 0.0,
    }
    if entry.source is not None:
        row["source"] = {
            "spec": sources.redact(entry.source),
            "resolved": entry.resolved[0] if entry.resolved else None,
        }
    if env.error or entry.broken:
        row["error"] = env.error or f"not run: {entry.broken}"
        return row
    start = time.monotonic()
    row["phase_seconds"] = timings = {}

    def timed(name: str, work: Callable[[], Any]) -> Any:
        phase(name)
        begun = time.monotonic()
        try:
            return work()
        finally:
            timings[name] = round(time.monotonic() - begun, 1)

    row["versions"] = timed("versions", lambda: versions(env.python, run))
    junit = report_dir / "matrix" / f"{entry.name}.xml"
    junit.parent.mkdir(parents=True, exist_ok=True)
    junit.unlink(missing_ok=True)
    environ = entry_environ(entry, env)
    command = contracts_command(entry, env, junit, jobs)
    done = timed("contracts", lambda: run(command, environ))
    if junit.is_file():
        row["contracts"] = junit_cells(junit)
    if not row["contracts"]:
        row["error"] = f"contracts did not run: {first_error(done.stdout + done.stderr)}"
    row.update(run_side_by_side(entry, env, environ, run, run_cells.workers(jobs), timed))
    for cell in run_cells.CELLS:  # the report's column order, not the order they ended in
        timings[f"{cell} run"] = timings.pop(f"{cell} run")
    row["seconds"] = round(time.monotonic() - start, 1)
    return row


def run_side_by_side(
    entry: Entry,
    env: EnvResult,
    environ: dict[str, str],
    run: Runner,
    workers: int,
    timed: Callable[[str, Callable[[], Any]], Any],
) -> dict[str, Any]:
    """Every run cell of ``entry`` (:data:`run_cells.CELLS`), ``workers`` at a time in the
    order of :data:`run_cells.START_ORDER`; cell -> its result. Each goes through
    ``timed`` (its phase and wall time; side by side, those overlap)."""
    order = sorted(run_cells.CELLS, key=run_cells.START_ORDER.index)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {
            cell: pool.submit(
                timed,
                f"{cell} run",
                functools.partial(run_cells.CELLS[cell], entry, env, environ, run),
            )
            for cell in order
        }
        try:
            return {cell: futures[cell].result() for cell in run_cells.CELLS}
        except BaseException:  # Ctrl-C here: the pool's threads wait on their commands
            kill_running()
            raise


def entry_environ(entry: Entry, env: EnvResult) -> dict[str, str]:
    """The environment of an entry's commands: 8 fake CPU devices, the shared compile
    cache (:func:`compile_cache`), the conventions its contracts drive."""
    environ = {
        # One compile cache beside the environments, shared by every row: rows on the same
        # jax/jaxlib (most of them) compile the same model programs, and JAX keys each entry
        # by program, compile options, backend and version, so other versions only miss.
        **suite_env(str(compile_cache(env))),
        "POSTTRAIN_DEVICES": "8",
        "JAX_PLATFORMS": "cpu",
        "POSTTRAIN_CONTRACT_CONVENTIONS": entry.convention if entry.emulated else "installed",
    }
    environ.pop("VIRTUAL_ENV", None)
    return environ


def contracts_command(
    entry: Entry, env: EnvResult, junit: Path, jobs: str, select: Sequence[str] = ()
) -> list[str]:
    """The pytest command of an entry's contracts (``select``: other pytest arguments,
    e.g. one node id or ``--contract NAME``, in place of the whole ``contracts/``)."""
    command = [
        str(env.python),
        "-m",
        "pytest",
        *(select or [str(REPO / "contracts")]),
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
    # Upstream deprecations: warn cells, not failures (harness/gate/deprecations.py).
    command += ["--upstream-deprecations", "record"]
    return command


def compile_cache(env: EnvResult) -> Path:
    """The JAX compilation cache of the matrix's runs: ``jax-compile`` beside the
    environments (in the environment cache's root), shared by every row."""
    assert env.path is not None
    return env.path.parent / "jax-compile"
