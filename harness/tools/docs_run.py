"""Run the fenced commands of README.md and docs/*.md as written, in the order written,
in a fresh copy of the checkout, and check the figures the pages quote against what
those commands print now.

``uv run --extra train python -m harness.tools.docs_run [--page PAGE ...] [--keep DIR]
[--log FILE]`` prints each command's exit status and seconds, then each quoted figure
beside its fresh value, and exits 1 when a command failed, a figure is off by more than
its tolerance or the copy's ``git status`` is not clean afterwards
(``tests/test_docs_run.py`` runs it: a quick page in the gate, every page in the slow
tier). ``--from-log FILE`` checks the figures against an earlier run's log.

The copy holds the working tree's tracked files, committed into a new repository so that
``git status`` shows what the commands left. The README's set-up block (after
:data:`SET_UP`) is not rerun: the commands run in the environment it made, the one this
Python runs in (``uv run`` without syncing, the copy's ``src/`` and root first on the
path). A block after :data:`NO_RUN` is not run; after ``<!-- exits N -->`` its commands
must exit N (an error shown on purpose). A marker sits on the line directly before its
block's opening fence; one elsewhere is refused (exit 2, naming the page and line) before
anything runs. Pages run in :data:`PAGES` order (the README
first) in one copy, so a page may read what the README made.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness.tools import docs_figures, figure_checks

ROOT = Path(__file__).resolve().parents[2]
NO_RUN = "<!-- no-run -->"
SET_UP = "<!-- set-up -->"
_EXITS = re.compile(r"<!-- exits (\d+) -->")
_MARKER = re.compile("|".join((re.escape(NO_RUN), re.escape(SET_UP), _EXITS.pattern)))
_COMMENT = re.compile(r"<!--.*-->")  # an HTML comment on a line of its own
_FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```", re.M | re.S)  # in a list item too
_LABELS = ("bash", "sh", "shell", "console")


def pages(root: Path = ROOT) -> list[str]:
    """The pages in the order their commands run: the README, then docs/ by name."""
    return ["README.md", *(f"docs/{p.name}" for p in sorted((root / "docs").glob("*.md")))]


@dataclasses.dataclass(frozen=True)
class Command:
    page: str
    line: int
    text: str
    exits: int = 0  # the status the page says it exits with

    def where(self) -> str:
        return f"{self.page}:{self.line}: {self.text[:90]}"

    def bare(self) -> str:
        """The command without its trailing comment (a ``#`` after a space, unquoted)."""
        quote = ""
        for i, char in enumerate(self.text):
            if quote:
                quote = "" if char == quote else quote
            elif char in "'\"":
                quote = char
            elif char == "#" and (i == 0 or self.text[i - 1].isspace()):
                return self.text[:i].rstrip()
        return self.text


def blocks(text: str, page: str = "the page") -> list[tuple[int, str, str, str]]:
    """(line, label, body, marker) of each fenced block of a page; ``marker``: the line
    directly before the fence, stripped (a marker such as :data:`NO_RUN`, or anything).

    A marker applies to the block whose opening fence is on the very next line, so that it
    never silently applies to another block or to none.

    Raises:
      ValueError: ``page:line: ...`` for a marker line (:data:`NO_RUN`, :data:`SET_UP`,
        ``<!-- exits N -->``) that is not directly before a fenced block (a blank line or
        text between), or an HTML comment directly before one that is no marker (a
        misspelt marker). Lines inside a fenced block are never markers.
    """
    found, spans = [], []
    for match in _FENCE.finditer(text):
        before = text[: match.start()].removesuffix("\n").rsplit("\n", 1)[-1]
        line = text[: match.start()].count("\n") + 2  # the block's first line
        spans.append((line - 1, line + match.group(0).count("\n") - 1))  # its fences' lines
        indent = len(match.group(1))
        body = "".join(row[indent:] for row in match.group(3).splitlines(keepends=True))
        found.append((line, match.group(2), body, before.strip()))
    _check_markers(page, text, spans)
    return found


def _check_markers(page: str, text: str, spans: list[tuple[int, int]]) -> None:
    """Refuses a marker line outside the line before an opening fence, and a comment
    there that is no marker (``spans``: each block's first and last line, its fences)."""
    opening = {first for first, _ in spans}
    fenced = {n for first, last in spans for n in range(first, last + 1)}
    for number, row in enumerate(text.splitlines(), 1):
        stripped = row.strip()
        if number in fenced or not _COMMENT.fullmatch(stripped):
            continue
        marker = _MARKER.fullmatch(stripped) is not None
        if marker and number + 1 not in opening:
            raise ValueError(
                f"{page}:{number}: {stripped} is not on the line directly before a fenced "
                "block (a marker applies to the block that opens on the next line)"
            )
        if not marker and number + 1 in opening:
            raise ValueError(
                f"{page}:{number}: {stripped} before a fenced block is no marker; expected "
                f"{NO_RUN}, {SET_UP} or <!-- exits N -->"
            )


def commands(page: str, text: str, skip: tuple[str, ...] = (NO_RUN,)) -> list[Command]:
    """The commands of a page's command blocks (``bash``, or a ``console`` block's ``$``
    lines), in order, leaving out the blocks after a marker in ``skip``.

    Raises:
      ValueError: a marker out of place (:func:`blocks`), naming the page and line.
    """
    found: list[Command] = []
    for line, label, body, marker in blocks(text, page):
        if label in _LABELS and marker not in skip:
            exits = _EXITS.fullmatch(marker)
            prompt = "$ " if label == "console" else ""
            for cmd in joined(page, line, body.splitlines(), prompt):
                if cmd.text and not cmd.text.startswith("#"):
                    found.append(dataclasses.replace(cmd, exits=int(exits[1]) if exits else 0))
    return found


def joined(page: str, line: int, rows: list[str], prompt: str) -> list[Command]:
    """A block's commands: lines after ``prompt`` (console: ``$``), ``\\`` continued."""
    found: list[Command] = []
    carry: tuple[int, str] | None = None
    for i, row in enumerate(rows):
        if carry is None and not row.startswith(prompt):
            continue  # a console block's output
        start, text = carry or (line + i, "")
        text += " " + (row if carry else row[len(prompt) :]).strip()
        carry = (start, text[:-1].rstrip()) if text.endswith("\\") else None
        if carry is None:
            found.append(Command(page, start, text.strip()))
    return found


@dataclasses.dataclass(frozen=True)
class Result:
    command: Command
    status: int
    seconds: float
    output: str  # stdout and stderr, interleaved

    def failed(self) -> bool:
        return self.status != self.command.exits


def copy_checkout(root: Path, dest: Path, ref: str | None = None) -> Path:
    """The working tree's tracked files (or commit ``ref``'s tree) under ``dest``,
    committed in a new repository."""
    if ref is not None:
        archive = subprocess.run(
            ["git", "archive", "--format=tar", ref], cwd=root, capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    else:
        listed = subprocess.run(
            ["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True
        ).stdout.decode()
        for name in filter(None, listed.split("\0")):
            source = root / name
            if source.is_file():  # a tracked file deleted in the working tree is left out
                (dest / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, dest / name)
    git = ["git", "-c", "user.name=docs-run", "-c", "user.email=docs-run@localhost"]
    for argv in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "copy"]):
        subprocess.run([*git, *argv], cwd=dest, check=True, capture_output=True)
    return dest


def environment(copy: Path) -> dict[str, str]:
    """The set-up's environment for a command in ``copy``: ``uv run`` uses this Python's
    environment without syncing it; the copy's own code comes first on the path. The
    pytest and XLA variables and the harness's device count (``POSTTRAIN_DEVICES``) are
    left out: a command gets the devices a new user's shell gets."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTEST_", "XLA_")) and k != "POSTTRAIN_DEVICES"
    }
    env.update(
        UV_NO_SYNC="1",
        UV_PROJECT_ENVIRONMENT=sys.prefix,
        PYTHONPATH=os.pathsep.join([str(copy / "src"), str(copy)]),
    )
    return env


def run(copy: Path, cmds: list[Command], timeout: float = 3600, echo=None) -> list[Result]:
    """Each command through bash in ``copy``, in order; ``echo`` is called with each
    result as it comes."""
    results = []
    env = environment(copy)
    for cmd in cmds:
        start = time.monotonic()
        try:
            done = subprocess.run(
                ["bash", "-c", cmd.text],
                cwd=copy,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=timeout,
            )
            status, output = done.returncode, done.stdout
        except subprocess.TimeoutExpired as e:
            status, output = 124, (e.stdout or b"").decode(errors="replace") + "\n(timed out)"
        results.append(Result(cmd, status, round(time.monotonic() - start, 1), output))
        if echo:
            echo(results[-1])
    return results


def dirty(copy: Path) -> list[str]:
    """What the commands left in the copy outside the ignored paths (``git status``)."""
    status = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"],
        cwd=copy,
        capture_output=True,
        text=True,
        check=True,
    )
    return status.stdout.splitlines()


def _line(result: Result) -> str:
    tail = result.output.strip().splitlines()[-1:] or [""]
    mark = "FAILED " if result.failed() else ""
    where = result.command.where()
    return f"{mark}exit {result.status}, {result.seconds:.1f} s: {where}  -> {tail[0][:120]}"


def _run_copy(args: argparse.Namespace) -> tuple[dict[str, str], list[Result], list[str]]:
    """The pages' texts, the results of their commands (``args.page``'s, or every page's)
    run in a new copy, and what they left in it; the copy is removed unless ``--keep``.

    Raises:
      ValueError: a page's marker out of place (:func:`blocks`), before anything runs.
    """
    if args.keep:
        args.keep.mkdir(parents=True)
    dest = args.keep or Path(tempfile.mkdtemp(prefix="docs-run-"))
    try:
        copy = copy_checkout(ROOT, dest, args.ref)
        texts = {p: (copy / p).read_text(encoding="utf-8") for p in pages(copy)}
        cmds = [c for p in args.page or texts for c in commands(p, texts[p], (NO_RUN, SET_UP))]
        print(f"docs_run: {len(cmds)} commands in {copy}", flush=True)
        done: list[Result] = []

        def echo(result: Result) -> None:  # the log so far, rewritten after each command
            print(_line(result), flush=True)
            done.append(result)
            if args.log:
                rows = [dataclasses.asdict(r) for r in done]
                args.log.write_text(json.dumps(rows, indent=1), encoding="utf-8")

        results = run(copy, cmds, echo=echo)
        return texts, results, dirty(copy)
    finally:
        if not args.keep:
            shutil.rmtree(dest, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.tools.docs_run", description=__doc__)
    parser.add_argument("--page", action="append", help="run only these pages (README.md first)")
    parser.add_argument("--ref", help="run a commit's tree (default: the working tree's files)")
    parser.add_argument("--keep", type=Path, help="run in this new directory and keep it")
    parser.add_argument("--log", type=Path, help="write every command's output here (JSON)")
    parser.add_argument("--from-log", type=Path, help="check the figures of an earlier --log")
    args = parser.parse_args(argv)
    for page in args.page or []:
        if page not in pages(ROOT):
            parser.error(f"--page {page!r}: not one of {', '.join(pages(ROOT))}")
    if args.from_log:
        texts = {p: (ROOT / p).read_text(encoding="utf-8") for p in pages(ROOT)}
        results = [
            Result(Command(**r["command"]), r["status"], r["seconds"], r["output"])
            for r in json.loads(args.from_log.read_text(encoding="utf-8"))
        ]
        left = []
    else:
        try:
            texts, results, left = _run_copy(args)
        except ValueError as e:  # a marker out of place: nothing was run
            parser.error(str(e))
    checks = figure_checks.check_figures(texts, results, docs_figures.FIGURES)
    for check in checks:
        print(check.line())
    failed = [r for r in results if r.failed()]
    for path in left:
        print(f"left in the checkout: {path}")
    print(
        f"docs_run: {len(results)} commands ({len(failed)} failed, "
        f"{sum(r.seconds for r in results):.0f} s), {len(checks)} figures "
        f"({sum(not c.ok for c in checks)} off), {len(left)} paths left in the checkout"
    )
    return 1 if failed or left or any(not c.ok for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
