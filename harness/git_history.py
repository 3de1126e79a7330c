"""An upstream checkout's history for :mod:`harness.bisect`: a ``--source`` as a local
repository, the first-parent commits between two refs, and what a commit touched or
merged. Every git failure is one ``ValueError`` line."""

from __future__ import annotations

import dataclasses
import hashlib
import subprocess
from pathlib import Path

from harness import sources


@dataclasses.dataclass(frozen=True)
class Commit:
    sha: str
    date: str
    subject: str


def local_checkout(source: str, cache_root: Path) -> Path:
    """``--source`` as a local repository: a directory as it is; a URL cloned (or
    fetched again) into ``cache_root/sources/<hash of the URL>``.

    Raises:
      ValueError: the spec is empty, or the clone or fetch fails (git's last line).
    """
    parsed = sources.parse(source)
    if parsed.path is not None:
        return parsed.path
    assert parsed.url is not None
    digest = hashlib.sha256(parsed.url.encode()).hexdigest()[:16]
    target = cache_root / "sources" / digest
    if (target / ".git").is_dir():
        command = ["git", "-C", str(target), "fetch", "--quiet", "--tags", "origin"]
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        command = ["git", "clone", "--quiet", parsed.url, str(target)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["git failed"])[-1]
        raise ValueError(f"--source {source!r} cannot be had: {last}")
    return target


def git_output(repo: Path, *args: str) -> str:
    """``git -C repo ARGS``'s stdout; a failure is one ``ValueError`` line (git's last)."""
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["git failed"])[-1]
        raise ValueError(f"git {' '.join(args[:2])} in {repo}: {last}")
    return done.stdout


def commits_between(repo: Path, good: str, bad: str) -> tuple[Commit, Commit, list[Commit]]:
    """The good and bad commits and the first-parent commits after good up to bad,
    oldest first (bad last).

    Raises:
      ValueError: ``repo`` is not a git repository, a ref names nothing, or good is not
        an ancestor of bad (one line each).
    """
    if (
        not repo.is_dir()
        or subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--git-dir"], capture_output=True
        ).returncode
    ):
        raise ValueError(f"--source {repo}: not a git repository")

    def one(ref: str, flag: str) -> Commit:
        try:
            line = git_output(repo, "log", "-1", "--format=%H%x00%cI%x00%s", ref, "--")
        except ValueError:
            raise ValueError(f"{flag} {ref!r}: no such commit in {repo}") from None
        sha, date, subject = line.rstrip("\n").split("\x00", 2)
        return Commit(sha, date, subject)

    first, last = one(good, "--good"), one(bad, "--bad")
    if subprocess.run(
        ["git", "-C", str(repo), "merge-base", "--is-ancestor", first.sha, last.sha]
    ).returncode:
        raise ValueError(f"--good {good!r} is not an ancestor of --bad {bad!r}")
    log = git_output(
        repo, "log", "--reverse", "--first-parent", "--format=%H%x00%cI%x00%s",
        f"{first.sha}..{last.sha}",
    )  # fmt: skip
    between = [Commit(*line.split("\x00", 2)) for line in log.splitlines() if line]
    return first, last, between


def touched(repo: Path, commit: Commit, package: str) -> list[str]:
    """The files ``commit`` changed under the package's directory (all, if none)."""
    names = git_output(repo, "show", "--name-only", "--format=", commit.sha).split()
    inside = [n for n in names if n.startswith(f"{package}/")]
    return inside or names


def merged(repo: Path, commit: Commit) -> list[str]:
    """A merge's own commits (``sha subject``, oldest first: what its second parent
    brought in, where the change itself is); ``[]`` for a plain commit."""
    parents = git_output(repo, "log", "-1", "--format=%P", commit.sha).split()
    if len(parents) < 2:
        return []
    log = git_output(repo, "log", "--reverse", "--format=%H %s", f"{parents[0]}..{parents[1]}")
    return log.splitlines()
