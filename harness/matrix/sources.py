"""Tunix from source: a git URL with a ref, or a local directory, resolved to the
exact tree a matrix row installs.

A source spec (``compat/entries.toml``'s ``source``, ``--tunix-source``) is either

- a git URL, ``git+`` prefix optional, with an optional ``@ref`` after the path
  (``https://github.com/google/tunix@main``, ``git+ssh://git@host/t.git@v0.1.8``,
  ``git@github.com:google/tunix.git@main``); without one, the remote's ``HEAD``. It
  resolves through ``git ls-remote`` to a commit (a 40-hex ref is taken as the commit;
  an annotated tag as the commit it tags), installed as
  ``google-tunix @ git+URL@<commit>``;
- a local directory holding ``pyproject.toml`` or ``setup.py`` (a checkout, or a tree
  extracted with ``git archive``). It resolves to its git ``HEAD`` commit when the
  directory is the top of a git work tree (``+tree.<hash>`` added when it has
  uncommitted changes), else to ``tree.<hash>`` (:func:`tree_hash`).

The resolved id goes into the environment's key (``harness.matrix.envs.env_key``), so the
environment is rebuilt when the checkout moves or its files change. A source that
cannot be reached or is not a package is a :class:`SourceError`: the matrix turns it
into an error row naming the reason.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

DISTRIBUTION = "google-tunix"
ANY_DEPTH = frozenset({".git", "__pycache__"})
SKIPPED_DIRS = frozenset({"build", "dist", ".venv", ".tox"})
"""Build outputs left out of :func:`tree_hash` at the top of the tree only."""
LS_REMOTE_TIMEOUT_S = 60
_COMMIT = re.compile(r"[0-9a-fA-F]{40}")
_SCP = re.compile(r"^[\w.-]+@[\w.-]+:(?!//)")  # git's scp-like syntax, user@host:path


class SourceError(ValueError):
    """A source spec that is malformed, unreachable or not a package; one line."""


# a URL in free text: a scheme, "://", then everything up to white space or the next
# URL; the URL parser takes the authority from that (up to the first /, ? or #)
_SCHEME = r"[A-Za-z][A-Za-z0-9+.-]*://"
_URL = re.compile(rf"{_SCHEME}(?:(?!{_SCHEME})\S)+")
REDACTED = "***"


def _userinfo(url: str) -> str:
    """The user-info of ``url`` (``scheme://USERINFO@host...``): the authority up to its
    last ``@`` (a password may hold ``@``, ``:`` and escapes); ``""`` when it has none."""
    rest = url.split("://", 1)[1]
    try:
        authority = urlsplit("//" + rest).netloc
    except ValueError:  # a malformed [IPv6] host: the authority as the parser would cut it
        authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    return authority.rpartition("@")[0]


def strip_userinfo(url: str) -> str:
    """``url`` without its user-info (``https://user:token@host/x`` -> ``https://host/x``):
    what may be written to disk. A URL without one, or scp-like ``git@host:path``, is
    returned as it is."""
    if "://" not in url or not (info := _userinfo(url)):
        return url
    scheme, rest = url.split("://", 1)
    return f"{scheme}://{rest[len(info) + 1 :]}"


def git_environ(url: str) -> tuple[str, dict[str, str]]:
    """``(url without its user-info, the environment for git)``: git is given the
    stripped URL (what a clone writes to its config, reflogs and ``FETCH_HEAD``) and,
    through its environment only, the rule that turns it back into ``url``
    (``url.<url>.insteadOf <stripped>``; ``GIT_CONFIG_COUNT``, git >= 2.31), so the
    credentials reach the transport (as before: git's remote helper is handed the full
    URL while it runs) and nothing written. Prompts are off either way
    (``GIT_TERMINAL_PROMPT=0``)."""
    environ = {**os.environ, "GIT_TERMINAL_PROMPT": "0"}
    stripped = strip_userinfo(url)
    if stripped != url:
        n = int(environ.get("GIT_CONFIG_COUNT", "0") or 0)  # after any the user set
        environ.update(
            {
                f"GIT_CONFIG_KEY_{n}": f"url.{url}.insteadOf",
                f"GIT_CONFIG_VALUE_{n}": stripped,
                "GIT_CONFIG_COUNT": str(n + 1),
            }
        )
    return stripped, environ


def redact(text: str) -> str:
    """``text`` with the user-info of every URL in it (``https://user:token@host``)
    replaced by :data:`REDACTED`: what is shown or stored of a source spec, never what
    is installed from it. An scp-like ``git@host:path`` has no secret and stays."""

    def hide(match: re.Match) -> str:
        url = match.group(0)
        info = _userinfo(url)
        if not info:
            return url
        scheme, rest = url.split("://", 1)
        return f"{scheme}://{REDACTED}@{rest[len(info) + 1 :]}"

    return _URL.sub(hide, text)


def check_directory(path: Path, spec: str) -> None:
    """A local source must be a directory holding a Python package.

    Raises:
      SourceError: ``path`` is not a directory, or holds no ``pyproject.toml`` or
        ``setup.py``.
    """
    if not path.is_dir():
        raise SourceError(f"source {spec!r}: {path} is not a directory")
    if not any((path / name).is_file() for name in ("pyproject.toml", "setup.py")):
        raise SourceError(
            f"source {spec!r}: {path} has no pyproject.toml or setup.py; expected a Tunix checkout"
        )


@dataclasses.dataclass(frozen=True)
class Source:
    """A parsed source spec.

    Attributes:
      spec: as given.
      url: the git URL without ``git+`` and ``@ref`` (None for a directory).
      ref: the ref asked for (``HEAD`` when none was given; None for a directory).
      path: the absolute directory (None for a URL).
    """

    spec: str
    url: str | None = None
    ref: str | None = None
    path: Path | None = None


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A source pinned to one tree.

    Attributes:
      source: what was asked for.
      id: the commit (40 hex), ``<commit>+tree.<hash>`` or ``tree.<hash>`` (16 hex).
      requirement: what ``pip install`` gets for Tunix.
    """

    source: Source
    id: str
    requirement: str

    def describe(self) -> str:
        """One line for the report: where the tree came from and what it is."""
        where = self.source.path or f"{self.source.url}@{self.source.ref}"
        return f"{where} ({self.id[:12] if _COMMIT.fullmatch(self.id) else self.id})"


def parse(spec: str) -> Source:
    """A source spec as a :class:`Source` (no I/O besides making a path absolute).

    Raises:
      SourceError: an empty spec, or a URL with an empty ref.
    """
    text = spec.strip()
    if not text:
        raise SourceError("source '' is empty; expected a git URL (with @ref) or a directory")
    scp = _SCP.match(text)
    if "://" not in text and not scp:
        return Source(spec, path=Path(text).expanduser().resolve())
    url = text.removeprefix("git+")
    if scp:  # git@host:owner/repo.git[@ref]: the path starts after the colon
        path_start = scp.end() - 1
    elif "/" in url[url.index("://") + 3 :]:
        path_start = url.index("/", url.index("://") + 3)
    else:
        path_start = -1
    at = url.rfind("@")
    ref = "HEAD"
    if path_start != -1 and at > path_start:
        url, ref = url[:at], url[at + 1 :]
        if not ref:
            raise SourceError(
                f"source {spec!r}: empty ref after '@'; expected a branch, tag or commit"
            )
    return Source(spec, url=url, ref=ref)


def tree_hash(root: Path) -> str:
    """SHA-256 (16 hex) over the relative path and bytes of every regular file under
    ``root``, in sorted order, following directory links (each real directory once);
    ``.git``, ``__pycache__`` and ``*.egg-info`` are left out at any depth,
    :data:`SKIPPED_DIRS`' build outputs only at the top.

    Raises:
      OSError: a file cannot be read.
    """
    digest = hashlib.sha256()
    seen: set[str] = set()
    for folder, dirs, files in os.walk(root, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen:  # a link loop, or a directory reached twice
            dirs[:] = []
            continue
        seen.add(real)
        top = Path(folder) == root
        dirs[:] = sorted(
            d
            for d in dirs
            if d not in ANY_DEPTH
            and not d.endswith(".egg-info")
            and not (top and d in SKIPPED_DIRS)
        )
        for name in sorted(files):
            path = Path(folder) / name
            if not path.is_file():  # sockets, FIFOs, dangling links
                continue
            digest.update(path.relative_to(root).as_posix().encode() + b"\0")
            digest.update(path.read_bytes())
            digest.update(b"\0")
    return digest.hexdigest()[:16]


def _git(
    args: list[str],
    cwd: Path | None = None,
    timeout: float = 30,
    environ: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["git", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=environ if environ is not None else {**os.environ, "GIT_TERMINAL_PROMPT": "0"},
    )


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def resolve(source: Source) -> Resolved:
    """Pins ``source`` to one tree (see the module docstring).

    Raises:
      SourceError: the directory does not exist, holds no ``pyproject.toml`` /
        ``setup.py`` or cannot be read; ``git ls-remote`` fails or times out (the URL
        cannot be reached: its last line is the reason); the ref names nothing there.
    """
    if source.path is not None:
        return _resolve_directory(source)
    assert source.url is not None and source.ref is not None
    if _COMMIT.fullmatch(source.ref):
        commit = source.ref.lower()
    else:
        try:
            # ref^{}: an annotated tag's commit (ls-remote lists it only when asked)
            url, environ = git_environ(source.url)
            command = ["ls-remote", "--end-of-options", url, source.ref, f"{source.ref}^{{}}"]
            done = _git(command, timeout=LS_REMOTE_TIMEOUT_S, environ=environ)
        except (OSError, subprocess.TimeoutExpired) as error:
            raise SourceError(f"source {source.spec!r} cannot be reached: {error}") from None
        if done.returncode != 0:
            raise SourceError(
                f"source {source.spec!r} cannot be reached: {_last_line(done.stderr)}"
            )
        refs = dict(
            reversed(line.split("\t", 1)) for line in done.stdout.splitlines() if "\t" in line
        )
        wanted = [
            source.ref,
            f"refs/heads/{source.ref}",
            f"refs/tags/{source.ref}^{{}}",
            f"refs/tags/{source.ref}",
        ]
        commit = next((refs[name] for name in wanted if name in refs), None)
        if commit is None:
            raise SourceError(
                f"source {source.spec!r}: ref {source.ref!r} not found on the remote; "
                "expected a branch, tag or full commit"
            )
    # pip has no scp-like form: git@host:path is ssh://git@host/path; credentials stay
    # out of the requirement (uv and pip keep it in caches): install_environ hands them
    url = strip_userinfo(source.url) if "://" in source.url else _ssh(source.url)
    return Resolved(source, commit, f"{DISTRIBUTION} @ git+{url}@{commit}")


def _ssh(scp: str) -> str:
    return "ssh://" + scp.replace(":", "/", 1)


def install_environ(spec: str | None) -> dict[str, str] | None:
    """The environment for installing a resolved ``spec``: :func:`git_environ`'s when
    its URL carries credentials (the requirement holds the URL without them), else
    None (the inherited one)."""
    if spec is None:
        return None
    try:
        url = parse(spec).url
    except SourceError:
        return None
    if url is None or strip_userinfo(url) == url:
        return None
    return git_environ(url)[1]


def _resolve_directory(source: Source) -> Resolved:
    try:
        return _pin_directory(source)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise SourceError(f"source {source.spec!r} cannot be read: {error}") from None


def _pin_directory(source: Source) -> Resolved:
    path = source.path
    assert path is not None
    check_directory(path, source.spec)
    requirement = f"{DISTRIBUTION} @ {path.as_uri()}"
    try:
        top = _git(["rev-parse", "--show-toplevel"], cwd=path)
    except OSError:  # no git on the machine: the tree's own hash
        top = None
    if top is not None and top.returncode == 0 and Path(top.stdout.strip()).resolve() == path:
        head = _git(["rev-parse", "HEAD"], cwd=path).stdout.strip()
        dirty = _git(["status", "--porcelain"], cwd=path).stdout.strip()
        if _COMMIT.fullmatch(head):
            ident = f"{head}+tree.{tree_hash(path)}" if dirty else head
            return Resolved(source, ident, requirement)
    return Resolved(source, f"tree.{tree_hash(path)}", requirement)
