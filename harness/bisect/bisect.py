"""Name the upstream commit that broke us: a binary search over an upstream checkout.

``posttrain-harness bisect --source PATH_OR_URL --good REF --bad REF --contract ID``
walks the first-parent history ``good..bad`` of a Tunix (or Qwix, Flax) checkout. Each
step exports one commit's tree (``git archive``), builds (or reuses, keyed by that tree)
its environment exactly as the matrix's source rows do (:class:`harness.matrix.envs.EnvCache`),
runs only the chosen contract (a pytest node id, or a matrix column: the name of a
``contract(...)`` marker) or run cell (``sft``, ``rl``, ``dpo``), and classifies it:

- **good**: the target passes (``--verdict warn``: passes with no upstream deprecation);
- **bad**: it fails or errors (``--verdict warn``: it also warns);
- **skip**: the environment cannot be built, or the target did not run (n/a): an
  uninstallable commit is never called bad.

The endpoints are checked first (a ``--good`` that is bad, or a ``--bad`` that is
good, is refused in one line), then a binary search names the first bad commit in about
log2(N) + skips steps, one progress line each. Skipped commits around the boundary
leave a range, listed. The result (the commit's hash, date, subject and the files it
touched under the package, every step with its verdict and reason) is printed and
written to ``bisect.json``.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from harness.bisect.git_history import (
    Commit,
    commits_between,
    git_output,
    local_checkout,
    merged,
    touched,
)
from harness.matrix import matrix, run_cells, sources
from harness.matrix.entries import CONVENTIONS, REPO, TEST_TOOLS, Entry
from harness.matrix.envs import EnvCache, EnvResult, Runner, first_error, run_command
from harness.report.report import RUN_CELLS, STATUSES
from posttrain import atomic

Verdict = Literal["good", "bad", "skip"]
PACKAGES: dict[str, str] = {"tunix": "google-tunix", "qwix": "qwix", "flax": "flax"}
"""``--package`` -> the distribution a commit's tree installs as."""
BASE_TUNIX = "0.1.7"
"""The Tunix release installed beside a Qwix or Flax commit."""
BUILD_FILES = ("pyproject.toml", "setup.py", "setup.cfg", "MANIFEST.in")
"""Top-level files of a commit's tree that a build reads, besides the package itself."""


class TreeError(Exception):
    """A commit's tree cannot be exported (a snapshot without some of its objects)."""


@dataclasses.dataclass(frozen=True)
class Target:
    """What a step runs: ``kind`` ``node`` (a pytest node id under ``contracts/``, or a
    path anywhere), ``contract`` (a ``contract(name)`` marker: a matrix column) or
    ``cell`` (a real run: sft, rl, dpo)."""

    kind: Literal["node", "contract", "cell"]
    name: str


@dataclasses.dataclass(frozen=True)
class Step:
    commit: Commit
    verdict: Verdict
    why: str


def contract_names(root: Path = REPO) -> set[str]:
    """Every ``contract("...")`` marker name in ``root/contracts``."""
    names = set()
    for path in sorted((root / "contracts").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", getattr(node.func, "id", "")) == "contract"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                names.add(node.args[0].value)
    return names


def parse_target(text: str, root: Path = REPO) -> Target:
    """``--contract``: a run cell, a node id (``FILE::test``; FILE relative to the
    checkout or absolute) or a contract name.

    Raises:
      ValueError: the node's file or test function does not exist, or the name is no
        contract, naming what was looked for.
    """
    if text in RUN_CELLS:
        return Target("cell", text)
    if "::" in text:
        file, _, test = text.partition("::")
        path = Path(file) if Path(file).is_absolute() else root / file
        function = test.split("[")[0].split("::")[-1]
        if not path.is_file():
            raise ValueError(f"--contract {text!r}: {path} does not exist")
        tree = ast.parse(path.read_text(encoding="utf-8"))
        defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        if function not in defined:
            raise ValueError(f"--contract {text!r}: {path.name} has no test {function!r}")
        return Target("node", f"{path}::{test}")
    if text in contract_names(root):
        return Target("contract", text)
    raise ValueError(
        f"--contract {text!r}: no such contract; expected a node id (contracts/FILE::test), "
        f"a contract name (a matrix column) or one of {', '.join(RUN_CELLS)}"
    )


def search(
    commits: Sequence[Commit], classify: Callable[[Commit], tuple[Verdict, str]]
) -> tuple[list[Commit], list[Step]]:
    """Binary search for the first bad commit of ``commits`` (oldest first; the one
    before the first is good, the last is bad): the candidates left (one commit, or
    the range skips leave around the boundary) and the steps taken."""
    steps: list[Step] = []
    low, high = -1, len(commits) - 1  # commits[low] good (-1: the good ref), [high] bad
    skipped: set[int] = set()
    while high - low > 1:
        middle = (low + high) // 2
        order = sorted(range(low + 1, high), key=lambda i: (abs(i - middle), i))
        untried = [i for i in order if i not in skipped]
        if not untried:
            break
        i = untried[0]
        verdict, why = classify(commits[i])
        steps.append(Step(commits[i], verdict, why))
        if verdict == "good":
            low = i
        elif verdict == "bad":
            high = i
        else:
            skipped.add(i)
    return list(commits[low + 1 : high + 1]), steps


class Stepper:
    """Classifies commits of ``repo`` for ``target`` (builds each tree's environment).

    ``runner``: runs the commands (the matrix's). ``log``: a progress line per step.
    """

    def __init__(
        self,
        repo: Path,
        target: Target,
        *,
        package: str = "tunix",
        verdict: Literal["fail", "warn"] = "fail",
        cache: EnvCache,
        work: Path,
        runner: Runner = run_command,
        log: Callable[[str], None] = print,
    ) -> None:
        self.repo, self.target, self.package, self.verdict = repo, target, package, verdict
        self.cache, self.work, self.runner, self.log = cache, work, runner, log
        self.count = 0

    def entry(self, commit: Commit) -> Entry:
        """The environment's entry for ``commit``: its exported tree installed as the
        package (beside Tunix :data:`BASE_TUNIX` for Qwix or Flax)."""
        tree = self.work / "trees" / commit.sha
        if not (tree / ".complete").is_file():
            shutil.rmtree(tree, ignore_errors=True)
            tree.mkdir(parents=True)
            # only what a build reads: the package and the top-level build files (a
            # snapshot may lack large blobs elsewhere, docs' images)
            top = git_output(
                self.repo, "ls-tree", "--name-only", "--end-of-options", commit.sha
            ).split("\n")
            keep = [
                n
                for n in top
                if n == self.package or n in BUILD_FILES or n.startswith(("README", "LICENSE"))
            ]
            # no "--" before the paths: after --end-of-options, git 2.39's archive took it
            # for a pathspec ("pathspec '--' did not match"), and every tree was a skip
            archive = subprocess.run(
                [
                    "git",
                    "-C",
                    str(self.repo),
                    "archive",
                    "--format=tar",
                    "--end-of-options",
                    commit.sha,
                    *keep,
                ],
                capture_output=True,
            )
            if archive.returncode != 0:
                raise TreeError(archive.stderr.decode(errors="replace").strip().splitlines()[-1])
            subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
            (tree / ".complete").write_text(commit.sha)
        install = [f"{PACKAGES[self.package]} @ {tree.as_uri()}"]
        if self.package != "tunix":
            install.append(f"google-tunix=={BASE_TUNIX}")
        return Entry(
            name=f"bisect-{commit.sha[:12]}",
            tunix="source",
            flavour="source",
            convention=CONVENTIONS[-1],
            source=str(tree),
            requirements=(*install, *TEST_TOOLS),
            resolved=(commit.sha, install[0]),
        )

    def __call__(self, commit: Commit) -> tuple[Verdict, str]:
        self.count += 1
        try:
            entry = self.entry(commit)
        except TreeError as error:
            self.log(f"bisect: step {self.count}: {commit.sha[:12]}: skip (tree: {error})")
            return "skip", f"tree: {error}"
        env = self.cache.ensure(entry)
        if env.error:
            verdict, why = "skip", f"environment: {env.error}"
        else:
            verdict, why = self._run(entry, env)
        built = "built" if env.built else "cached"
        self.log(
            f"bisect: step {self.count}: {commit.sha[:12]} {commit.subject[:60]!r}: "
            f"{verdict} ({why[:160]}; env {built} in {env.seconds:.0f} s)"
        )
        return verdict, why

    def _run(self, entry: Entry, env: EnvResult) -> tuple[Verdict, str]:
        environ = matrix.entry_environ(entry, env)
        if self.target.kind == "cell":
            cell = run_cells.CELLS[self.target.name](entry, env, environ, self.runner)
            return _verdict([cell], "fail"), cell["message"]
        with tempfile.TemporaryDirectory() as tmp:
            junit_file = Path(tmp) / "bisect.xml"
            select = (
                [self.target.name]
                if self.target.kind == "node"
                else [str(REPO / "contracts"), "--contract", self.target.name]
            )
            done = self.runner(
                matrix.contracts_command(entry, env, junit_file, "1", select), environ
            )
            cells = list(matrix.junit_cells(junit_file).values()) if junit_file.is_file() else []
        if not cells:
            return "skip", f"the contract did not run: {first_error(done.stdout + done.stderr)}"
        return _verdict(cells, self.verdict), _describe(cells)


def _verdict(cells: Sequence[dict[str, Any]], verdict: str) -> Verdict:
    statuses = {c["status"] for c in cells}
    if statuses & {"failed", "error"}:
        return "bad"
    if statuses == {"skipped"}:
        return "skip"
    if verdict == "warn" and "warned" in statuses:
        return "bad"
    return "good"


def _describe(cells: Sequence[dict[str, Any]]) -> str:
    """The worst cell's status and message."""
    worst = max(cells, key=lambda c: STATUSES.index(c["status"]))
    return f"{worst['status']}: {worst['message']}" if worst["message"] else worst["status"]


def bisect(
    repo: Path,
    good: str,
    bad: str,
    target: Target,
    stepper: Callable[[Commit], tuple[Verdict, str]],
    *,
    package: str = "tunix",
    verdict: str = "fail",
) -> dict[str, Any]:
    """The whole bisection (endpoints first); the result as :func:`main` writes it.

    Raises:
      ValueError: bad refs (:func:`commits_between`), a good ref that is bad or a bad
        ref that is good (one line naming it and why).
    """
    first, last, between = commits_between(repo, good, bad)
    steps: list[Step] = []
    for commit, wanted, flag in ((first, "good", "--good"), (last, "bad", "--bad")):
        got, why = stepper(commit)
        steps.append(Step(commit, got, why))
        if got != wanted:
            what = "cannot be built or run" if got == "skip" else f"is in fact {got}"
            raise ValueError(f"{flag} {commit.sha[:12]} {what}: {why}")
    candidates, searched = search(between, stepper)
    steps += searched
    result: dict[str, Any] = {
        "source": sources.redact(str(repo)),
        "package": package,
        "target": dataclasses.asdict(target),
        "verdict": verdict,
        "good": dataclasses.asdict(first),
        "bad": dataclasses.asdict(last),
        "commits": len(between),
        "steps": [
            {**dataclasses.asdict(s.commit), "verdict": s.verdict, "why": s.why} for s in steps
        ],
        "candidates": [dataclasses.asdict(c) for c in candidates],
        "first_bad": None,
    }
    if len(candidates) == 1:
        result["first_bad"] = {
            **dataclasses.asdict(candidates[0]),
            "files": touched(repo, candidates[0], package),
            "merged": merged(repo, candidates[0]),
        }
    return result


def summary(result: dict[str, Any]) -> list[str]:
    """The lines printed at the end."""
    steps = len(result["steps"])
    found = result["first_bad"]
    if found:
        return [
            f"first {'warning' if result['verdict'] == 'warn' else 'bad'} commit: "
            f"{found['sha']} ({found['date']})",
            f"  {found['subject']}",
            f"  files: {', '.join(found['files'][:12])}"
            + (f" (+{len(found['files']) - 12})" if len(found["files"]) > 12 else ""),
            *(f"  merged: {line}" for line in found.get("merged", [])[:10]),
            f"{result['commits']} commits between good and bad; {steps} steps",
        ]
    shas = ", ".join(c["sha"][:12] for c in result["candidates"])
    return [f"skipped commits leave the first bad one among: {shas} ({steps} steps)"]


def run_suggestions(
    found: list[dict[str, str]], cache: EnvCache, log: Callable[[str], None] = print
) -> list[dict[str, Any]]:
    """``matrix --bisect``: each suggestion run (:func:`bisect`); each gets ``named``,
    the first bad commit (``{"sha", "date", "subject", "files"}``), or ``why`` it could
    not name one."""
    done = []
    for item in found:
        result: dict[str, Any] = dict(item)
        try:
            target = parse_target(item["contract"])
            repo = local_checkout(item["source"], cache.root)
            with tempfile.TemporaryDirectory(prefix="bisect-") as work:
                stepper = Stepper(
                    repo, target, verdict=item["verdict"], cache=cache, work=Path(work), log=log
                )
                outcome = bisect(
                    repo, item["good"], item["bad"], target, stepper, verdict=item["verdict"]
                )
            if outcome["first_bad"]:
                result["named"] = outcome["first_bad"]
            else:
                result["why"] = summary(outcome)[0]
        except ValueError as error:
            result["why"] = str(error)
        done.append(result)
    return done


def write(result: dict[str, Any], report_dir: Path) -> Path:
    path = report_dir / "bisect.json"
    report_dir.mkdir(parents=True, exist_ok=True)
    atomic.write_text(path, json.dumps(result, indent=2) + "\n")
    return path
