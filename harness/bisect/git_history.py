"""An upstream checkout's history for :mod:`harness.bisect.bisect`: a ``--source`` as a local
repository, the first-parent commits between two refs, and what a commit touched or
merged. Every git failure is one ``ValueError`` line."""

from __future__ import annotations

import dataclasses
import hashlib
import re
import shutil
import subprocess
from pathlib import Path

from harness.matrix import sources

_SHA = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")  # SHA-1 or SHA-256 repositories


@dataclasses.dataclass(frozen=True)
class Commit:
    sha: str
    date: str
    subject: str


def local_checkout(source: str, cache_root: Path) -> Path:
    """``--source`` as a local repository: a directory as it is; a URL cloned (or
    fetched again) into ``cache_root/sources/<hash of the URL without credentials>``.
    Credentials in the URL reach git through its environment only
    (:func:`harness.matrix.sources.git_environ`): the clone's files never hold them.

    Raises:
      ValueError: the spec is empty, or the clone or fetch fails (git's last line).
    """
    parsed = sources.parse(source)
    if parsed.path is not None:
        return parsed.path
    assert parsed.url is not None
    url, environ = sources.git_environ(parsed.url)
    digest = hashlib.sha256(url.encode()).hexdigest()[:16]
    target = cache_root / "sources" / digest
    if (target / ".git").is_dir():
        command = ["git", "-C", str(target), "fetch", "--quiet", "--tags", "origin"]
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        command = ["git", "clone", "--quiet", "--end-of-options", url, str(target)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=environ)
    except BaseException:  # a signal: no half-made clone for the next run to fetch into
        if command[1] == "clone":
            shutil.rmtree(target, ignore_errors=True)
        raise
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


def verify_commit(repo: Path, ref: str, flag: str) -> str:
    """The full hash of the commit ``ref`` names in ``repo``, checked before any other
    git call sees it: ``git rev-parse --verify --end-of-options REF^{commit}`` (an
    option-like ``--output=FILE`` is then a name, never an option).

    Raises:
      ValueError: ``<flag> '<ref>': no such commit in <repo>`` (also for a ref that
        names a tree or blob, and for an empty one).
    """
    done = subprocess.run(
        [
            "git",
            "-C",
            str(repo),
            "rev-parse",
            "--verify",
            "--quiet",
            "--end-of-options",
            f"{ref}^{{commit}}",
        ],
        capture_output=True,
        text=True,
    )
    sha = done.stdout.strip()
    if done.returncode != 0 or not ref.strip() or not _SHA.fullmatch(sha):
        raise ValueError(f"{flag} {ref!r}: no such commit in {repo}")
    return sha


def commits_between(repo: Path, good: str, bad: str) -> tuple[Commit, Commit, list[Commit]]:
    """The good and bad commits and the first-parent commits after good up to bad,
    oldest first (bad last). Both refs are verified as commits first
    (:func:`verify_commit`); git sees only their hashes after that.

    Raises:
      ValueError: ``repo`` is not a git repository, a ref names no commit, or good is
        not an ancestor of bad (one line each).
    """
    if (
        not repo.is_dir()
        or subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--git-dir"], capture_output=True
        ).returncode
    ):
        raise ValueError(f"--source {repo}: not a git repository")

    def one(ref: str, flag: str) -> Commit:
        sha = verify_commit(repo, ref, flag)
        line = git_output(repo, "log", "-1", "--format=%H%x00%cI%x00%s", "--end-of-options", sha)
        _, date, subject = line.rstrip("\n").split("\x00", 2)
        return Commit(sha, date, subject)

    first, last = one(good, "--good"), one(bad, "--bad")
    if first.sha == last.sha:  # before any environment is built for them
        raise ValueError(
            f"--good {good!r} and --bad {bad!r} are the same commit {first.sha[:12]}; "
            "expected --good an ancestor of --bad"
        )
    if subprocess.run(
        [
            "git",
            "-C",
            str(repo),
            "merge-base",
            "--is-ancestor",
            "--end-of-options",
            first.sha,
            last.sha,
        ]
    ).returncode:
        raise ValueError(f"--good {good!r} is not an ancestor of --bad {bad!r}")
    log = git_output(
        repo,
        "log",
        "--reverse",
        "--first-parent",
        "--format=%H%x00%cI%x00%s",
        "--end-of-options",
        f"{first.sha}..{last.sha}",
    )
    between = [Commit(*line.split("\x00", 2)) for line in log.splitlines() if line]
    return first, last, between


def touched(repo: Path, commit: Commit, package: str) -> list[str]:
    """The files ``commit`` changed under the package's directory (all, if none)."""
    names = git_output(
        repo, "show", "--name-only", "--format=", "--end-of-options", commit.sha
    ).split()
    inside = [n for n in names if n.startswith(f"{package}/")]
    return inside or names


def merged(repo: Path, commit: Commit) -> list[str]:
    """A merge's own commits (``sha subject``, oldest first: what its second parent
    brought in, where the change itself is); ``[]`` for a plain commit."""
    parents = git_output(repo, "log", "-1", "--format=%P", "--end-of-options", commit.sha).split()
    if len(parents) < 2:
        return []
    between = f"{parents[0]}..{parents[1]}"
    log = git_output(repo, "log", "--reverse", "--format=%H %s", "--end-of-options", between)
    return log.splitlines()
