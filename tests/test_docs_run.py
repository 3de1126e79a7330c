"""The fenced commands of README.md and docs/*.md, run as written, in order, in a fresh
copy of the checkout (:mod:`harness.tools.docs_run`), their quoted figures checked against what
they print (:mod:`harness.tools.docs_figures`), and the copy's ``git status`` clean afterwards.
The gate runs the quick pages (:data:`QUICK`); the slow tier runs every page."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import types

import pytest

from harness.tools import docs_run
from harness.tools.docs_figures import FIGURES, RUN
from harness.tools.docs_run import NO_RUN, ROOT, SET_UP, Command, Result
from harness.tools.figure_checks import Figure, agrees, check_figure, check_figures
from tests.cli_help import help_text

pytestmark = pytest.mark.host

QUICK = ("docs/sharding.md",)  # pages whose commands take seconds and read nothing earlier


def _run_pages(tmp_path, chosen):
    copy = docs_run.copy_checkout(ROOT, tmp_path)
    texts = {p: (copy / p).read_text(encoding="utf-8") for p in docs_run.pages(copy)}
    cmds = [c for p in chosen for c in docs_run.commands(p, texts[p], (NO_RUN, SET_UP))]
    results = docs_run.run(copy, cmds, timeout=3600)
    return results, check_figures(texts, results, FIGURES), docs_run.dirty(copy)


def _assert_ran(results, checks, left):
    failed = [
        f"{r.command.where()}: exit {r.status}\n{r.output[-2000:]}" for r in results if r.failed()
    ]
    assert not failed, "\n".join(failed)
    assert all(c.ok for c in checks), "\n".join(c.line() for c in checks if not c.ok)
    assert not left, f"the commands left in the checkout: {left}"


# slow tier: the gate runs the quick page through the command line below
# (test_the_command_line_runs_a_page_logs_it_and_rechecks_the_log: its exits, figures and
# paths left, in a fresh copy), one subprocess less
@pytest.mark.slow
def test_the_quick_pages_run_as_written_in_a_fresh_copy(tmp_path):
    """The quick pages' commands exit as their pages say, print the figures they quote,
    and leave the copy's git status clean."""
    results, checks, left = _run_pages(tmp_path, QUICK)
    assert results and checks
    _assert_ran(results, checks, left)


@pytest.mark.slow
def test_every_docs_command_runs_as_written_in_order_from_a_fresh_copy(tmp_path):
    """Every page's commands (the README first) run in one fresh copy: each exits as its
    page says, every quoted figure is within its tolerance of the fresh output, and the
    copy's git status is clean afterwards (examples write under runs/ and scratch/)."""
    results, checks, left = _run_pages(tmp_path, docs_run.pages(ROOT))
    _assert_ran(results, checks, left)


PAGE = f"""intro
{SET_UP}
```bash
bash .ci/run
```
```bash
mkdir -p runs && echo made > runs/a   # a comment
uv run posttrain-harness devices \\
    --json
```
{NO_RUN}
```bash
posttrain sft --nonsense
```
<!-- exits 2 -->
```console
$ false || exit 2
an output line
```
  - a list item:
    ```sh
    echo indented
    ```
"""


def test_commands_are_read_in_order_honouring_the_markers():
    """Set-up and no-run blocks are left out when asked, continuations joined, console
    output lines dropped, an exits marker read, a list item's block unindented."""
    found = docs_run.commands("x.md", PAGE, (NO_RUN, SET_UP))
    assert [(c.text, c.exits) for c in found] == [
        ("mkdir -p runs && echo made > runs/a   # a comment", 0),
        ("uv run posttrain-harness devices --json", 0),
        ("false || exit 2", 2),
        ("echo indented", 0),
    ]
    assert found[0].bare() == "mkdir -p runs && echo made > runs/a"
    quoted = Command("x.md", 1, "python -c \"print('#1 it's')\"  # Tunix's")
    assert quoted.bare() == "python -c \"print('#1 it's')\""
    assert Command("x.md", 1, "echo a#b  # c").bare() == "echo a#b"
    assert Command("x.md", 1, 'echo "a #b"  # c').bare() == 'echo "a #b"'
    assert Command("x.md", 1, "echo X  # c").bare() == "echo X"
    assert Command("x.md", 1, "echo a# b").bare() == "echo a# b"
    assert Command("x.md", 1, "# only a comment").bare() == ""
    assert found[1].line == 8
    assert docs_run.commands("x.md", PAGE)[0].text == "bash .ci/run"


def _block(marker: str, between: str = "") -> str:
    return f"intro\n{marker}\n{between}```bash\nposttrain sft --nonsense\n```\n"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (_block(NO_RUN, "\n"), f"x.md:2: {NO_RUN} is not on the line directly before"),
        (_block("<!-- exits 2 -->", "Its output:\n"), "x.md:2: <!-- exits 2 --> is not on"),
        (f"intro\n```bash\necho a\n```\n{SET_UP}\n", f"x.md:5: {SET_UP} is not on"),
        ("- item\n  <!-- no-run -->\n\n  ```sh\n  x\n  ```\n", "x.md:2: <!-- no-run --> is"),
        (_block("<!-- no run -->"), "x.md:2: <!-- no run --> before a fenced block is no marker"),
        (_block("<!--no-run-->"), "x.md:2: <!--no-run--> before a fenced block is no marker"),
    ],
    ids=["blank-line", "text-between", "last-line", "list-item", "misspelt", "unspaced"],
)
def test_a_marker_not_directly_before_a_block_is_refused_naming_its_page_and_line(text, says):
    """A marker applies only to the block opening on the next line: one a blank line or
    text away, or at the end of the page, is an error naming the page and line (it would
    otherwise leave the block it meant to run, or another one); a comment right before a
    block that is no marker (misspelt) is one too."""
    with pytest.raises(ValueError, match="^" + re.escape(says)):
        docs_run.commands("x.md", text)


def test_a_marker_out_of_place_is_one_line_saying_where_markers_apply():
    """The whole line, and a page left unnamed called "the page"."""
    with pytest.raises(ValueError) as caught:
        docs_run.blocks(_block(NO_RUN, "\n"))
    assert str(caught.value) == (
        f"the page:2: {NO_RUN} is not on the line directly before a fenced block (a marker "
        "applies to the block that opens on the next line)"
    )


def test_marker_lines_inside_blocks_or_inline_and_other_comments_are_no_markers():
    """A marker written inside a fenced block (an example of a page) or inline in prose is
    no marker, and an HTML comment away from any block is no error."""
    text = (
        f"A block after `{NO_RUN}` is not run.\n<!-- a note to editors -->\n\n"
        f"```text\n{NO_RUN}\n\n<!-- exits 3 -->\n```\n{NO_RUN}\n```bash\necho skipped\n```\n"
        "```bash\necho run\n```\n"
    )
    assert [c.text for c in docs_run.commands("x.md", text)] == ["echo run"]
    assert [b[3] for b in docs_run.blocks(text)] == ["", NO_RUN, "```"]


def test_every_page_s_markers_sit_directly_before_their_blocks():
    for page in docs_run.pages(ROOT):
        docs_run.commands(page, (ROOT / page).read_text(encoding="utf-8"))  # raises if not


CONSOLE = """<!-- exits 1 -->
```console
a line printed before
$ echo a\\
b
$ false || exit 1
an output line
$ echo two \\
c
```

```bash
# a comment line

echo three
```
  - an item:
    ```console
    $ echo indented
    ```
"""


def test_a_console_block_gives_its_prompted_commands_and_a_bash_block_drops_comments():
    """Output lines before, between and after a console block's commands are dropped, its
    continuations joined (with or without a space before the backslash, the next line
    unprompted); a bash block's comment and blank lines are no commands; an indented
    console block is read unindented."""
    found = docs_run.commands("x.md", CONSOLE)
    assert [(c.line, c.text, c.exits) for c in found] == [
        (4, "echo a b", 1),
        (6, "false || exit 1", 1),
        (8, "echo two c", 1),
        (15, "echo three", 0),
        (19, "echo indented", 0),
    ]


@pytest.mark.parametrize(
    ("quoted", "fresh", "tolerance", "ok"),
    [
        ("2.983", "2.9834", 0.0, True),  # rounds to the quoted precision
        ("2.983", "2.9846", 0.0, False),
        ("2.983", "3.01", 0.01, True),  # within 1%
        ("2.983", "3.02", 0.01, False),
        ("91,984", "91984", 0.0, True),
        ("77", "78.6", 0.0, False),
        ("77", "77.4", 0.0, True),
        ("6.7e-07", "6.7e-07", 0.0, True),
        ("91984", "91,984", 0.0, True),  # the fresh value's separators too
        ("1.0e2", "100.0004", 0.0, False),  # scientific: no rounding to "0e2"'s digits
        ("2.5", "n/a", 0.0, False),  # a number against text: text, unequal
        ("n te te", "n te te", 0.0, True),
        ("A red circle.", "A red square.", 0.5, False),
    ],
)
def test_a_figure_agrees_when_rounded_or_within_its_tolerance(quoted, fresh, tolerance, ok):
    assert agrees(quoted, fresh, tolerance) is ok


@pytest.mark.parametrize(
    ("quoted", "fresh", "ok"),
    [
        ("1e-8", "8.85e-09", True),  # below the bound, however far
        ("1e-8", "1e-08", True),  # at it
        ("1e-8", "1.01e-08", False),  # above it, within any tolerance's reach
        ("1e-7", "n/a", False),
    ],
)
def test_a_bound_figure_agrees_at_or_below_its_bound_only(quoted, fresh, ok):
    assert agrees(quoted, fresh, 0.5, bound=True) is ok


def _result(text: str, output: str, page: str = "p.md", status: int = 0) -> Result:
    return Result(Command(page, 1, text), status, 1.0, output)


def test_a_bound_figure_is_checked_as_a_bound_against_its_command():
    """``Figure.bound`` reaches the check: 8.85e-9 printed under a quoted bound of 1e-8
    agrees; the same figure read as a value (0.2% tolerance) is off."""
    page = "the largest difference is at most 1e-8 here"
    ran = [_result("python benchmarks/model_ab.py --form tokens", "max |grad diff| 8.85e-09")]
    fields = ("p.md", r"--form tokens", r"at most ([\d.]+e-\d+)", r"diff\| ([\d.]+e-\d+)")
    assert check_figure(Figure(*fields, tolerance=0.002, bound=True), page, ran).ok
    assert not check_figure(Figure(*fields, tolerance=0.002), page, ran).ok


def test_each_figure_is_checked_against_its_own_commands_output():
    figure = Figure("p.md", r"posttrain sft$", r"loss ([\d.]+) -> ([\d.]+)", tolerance=0.01)
    page = "text: loss 5.559 -> 2.983 here"
    other = _result("uv run posttrain sft --steps 4", "loss 9.0 -> 9.0")
    same = _result("uv run posttrain sft  # comment", "step 1\nloss 5.5594 -> 2.99\n")
    check = check_figure(figure, page, [other, same])
    assert check.ok and check.fresh == ("5.5594", "2.99")
    assert check.line() == (
        r"ok  p.md: loss ([\d.]+) -> ([\d.]+): quoted 5.559 / 2.983, now 5.5594 / 2.99"
    )
    assert Figure("p.md", "x", "q" * 70).label() == "p.md: " + "q" * 60  # 60 characters
    off = check_figure(figure, page, [_result("posttrain sft", "loss 5.559 -> 3.1")])
    assert not off.ok and "OFF" in off.line() and "3.1" in off.line()
    missing = check_figure(figure, page, [_result("posttrain sft", "nothing")])
    assert missing.ok is False and missing.line() == (
        r"OFF p.md: loss ([\d.]+) -> ([\d.]+): quoted 5.559 / 2.983, now not printed"
    )
    gone = check_figure(figure, "no figure here", [same])
    assert gone.ok is False and gone.line() == (
        r"OFF p.md: loss ([\d.]+) -> ([\d.]+): quoted , now the page no longer quotes it"
    )
    line = Figure("p.md", r"posttrain sft$", r"^loss ([\d.]+)$")  # a line of its own, each
    lines = check_figure(line, "intro\nloss 2.5\nend", [_result("posttrain sft", "a\nloss 2.5\nb")])
    assert lines.ok and lines.fresh == ("2.5",)
    assert check_figure(figure, page, [other]) is None  # its command did not run
    assert check_figure(figure, page, [_result("posttrain sft", "x", page="q.md")]) is None


def test_a_figure_may_come_from_a_command_of_another_page_the_first_to_run():
    """A figure whose command is also run on another page (the README's run a page
    repeats) is checked against the first of them to run; a page not named is not
    read."""
    figure = Figure("p.md", r"posttrain sft$", r"loss ([\d.]+)", also=("README.md",))
    readme = _result("posttrain sft", "loss 2.5", page="README.md")
    page = _result("posttrain sft", "loss 9.9", page="p.md")
    assert check_figure(figure, "loss 2.5", [readme, page]).fresh == ("2.5",)
    assert check_figure(figure, "loss 2.5", [page, readme]).fresh == ("9.9",)
    assert check_figure(figure, "loss 2.5", [_result("posttrain sft", "loss 2.5", "q.md")]) is None
    own = Figure("p.md", r"posttrain sft$", r"loss ([\d.]+)")
    assert check_figure(own, "loss 2.5", [readme]) is None


def test_a_table_row_s_figures_read_the_cells_of_their_columns():
    """A row's cells are counted from its first column: each figure reads its own cell."""
    from harness.tools.docs_figures import _row

    third, fifth = _row("p.md", "cmd", "a", ((3, r"(\w+)", "x"), (5, r"(\w+) GiB", "y")))
    row = "| a, the row | b | c | d | 7 GiB |\n| ab | x | y | z | 8 GiB |"
    assert re.search(third.quoted, row, re.M)[1] == "c"
    assert re.search(fifth.quoted, row, re.M)[1] == "7"
    assert (third.page, third.command, third.printed, third.tolerance) == ("p.md", "cmd", "x", RUN)


def test_every_figure_names_a_command_of_its_page_and_is_quoted_there():
    texts = {p: (ROOT / p).read_text(encoding="utf-8") for p in docs_run.pages(ROOT)}
    for figure in FIGURES:
        pages = (figure.page, *figure.also)
        cmds = [c for p in pages for c in docs_run.commands(p, texts[p], (NO_RUN, SET_UP))]
        assert any(re.search(figure.command, c.bare()) for c in cmds), figure
        assert re.search(figure.quoted, texts[figure.page], re.M), figure


def _repository(path):
    (path / "docs").mkdir(parents=True)
    (path / ".gitignore").write_text("runs/\n")
    (path / "README.md").write_text("x\n")
    (path / "docs/a.md").write_text("y\n")
    (path / "deleted.md").write_text("z\n")
    for argv in (["init", "-q"], ["add", "-A"]):
        subprocess.run(["git", *argv], cwd=path, check=True)
    (path / "README.md").write_text("changed\n")  # the working tree's, not the index's
    (path / "deleted.md").unlink()
    return path


def test_a_copy_that_cannot_be_made_names_the_command_that_failed(tmp_path):
    """A ref the repository lacks fails in ``git archive``; a destination that is not
    there fails in ``tar``."""
    repo = _repository(tmp_path / "src")
    with pytest.raises(subprocess.CalledProcessError) as failed:
        docs_run.copy_checkout(repo, tmp_path / "copy", ref="no-such-ref")
    assert failed.value.cmd[:2] == ["git", "archive"]
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@localhost"]
    subprocess.run([*git, "commit", "-q", "-m", "x"], cwd=repo, check=True)
    with pytest.raises(subprocess.CalledProcessError) as failed:
        docs_run.copy_checkout(repo, tmp_path / "missing", ref="HEAD")
    assert failed.value.cmd[0] == "tar"


def test_a_copy_is_one_commit_by_docs_run_of_the_tracked_files_at_any_depth(tmp_path, monkeypatch):
    """A tracked file three directories down is copied; the copy's one commit is
    docs-run's, "copy"; a directory that is no repository fails in ``git ls-files``, and a
    repository tracking nothing at the copy's commit (there is nothing to run)."""
    repo = _repository(tmp_path / "src")
    (repo / "docs/deep/er").mkdir(parents=True)
    (repo / "docs/deep/er/c.md").write_text("w\n")
    subprocess.run(["git", "add", "docs/deep/er/c.md"], cwd=repo, check=True)
    copy = docs_run.copy_checkout(repo, tmp_path / "copy")
    assert (copy / "docs/deep/er/c.md").read_text() == "w\n"
    log = ["git", "log", "--format=%an <%ae>|%s"]
    out = subprocess.run(log, cwd=copy, capture_output=True, text=True, check=True).stdout
    assert out == "docs-run <docs-run@localhost>|copy\n"
    (tmp_path / "plain").mkdir()
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # no repository above it
    with pytest.raises(subprocess.CalledProcessError) as failed:
        docs_run.copy_checkout(tmp_path / "plain", tmp_path / "plain-copy")
    assert failed.value.cmd == ["git", "ls-files", "-z"]
    subprocess.run(["git", "init", "-q", str(tmp_path / "empty")], check=True)
    (tmp_path / "empty-copy").mkdir()
    with pytest.raises(subprocess.CalledProcessError) as failed:
        docs_run.copy_checkout(tmp_path / "empty", tmp_path / "empty-copy")
    assert failed.value.cmd[-4:] == ["commit", "-q", "-m", "copy"]


def test_a_command_that_writes_outside_the_ignored_paths_leaves_the_copy_dirty(tmp_path):
    """The copy holds the working tree's tracked files; what a command writes under an
    ignored path is fine, anything else is reported; an exit status other than the
    page's is a failure."""
    copy = docs_run.copy_checkout(_repository(tmp_path / "src"), tmp_path / "copy")
    assert (copy / "README.md").read_text() == "changed\n"
    assert not (copy / "deleted.md").exists() and docs_run.dirty(copy) == []
    cmds = [
        Command("README.md", 1, "mkdir -p runs && touch runs/a"),
        Command("README.md", 2, "exit 2", exits=2),
        Command("README.md", 3, "touch red-circle.png && echo $UV_NO_SYNC"),
    ]
    results = docs_run.run(copy, cmds)
    assert [r.failed() for r in results] == [False, False, False]
    assert results[2].output == "1\n"
    assert docs_run.dirty(copy) == ["?? red-circle.png"]
    assert docs_run.run(copy, [Command("README.md", 4, "exit 3")])[0].failed()


def test_the_command_line_runs_a_page_logs_it_and_rechecks_the_log(tmp_path, capsys):
    """``python -m harness.tools.docs_run --page P --log F`` runs the page and writes each
    command's output; ``--from-log F`` checks the figures again without running; a page
    that is not one is a usage error."""
    log = tmp_path / "log.json"
    assert docs_run.main(["--page", "docs/sharding.md", "--log", str(log)]) == 0
    out = capsys.readouterr().out
    assert "exit 2, " in out and "ok  docs/sharding.md" in out
    assert "1 commands (0 failed" in out and "0 paths left in the checkout" in out
    (row,) = json.loads(log.read_text())
    assert row["command"]["exits"] == 2 and "num_kv_heads" in row["output"]
    row["output"] = "posttrain: error: something else"
    log.write_text(json.dumps([row]))
    assert docs_run.main(["--from-log", str(log)]) == 1
    assert "OFF docs/sharding.md" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        docs_run.main(["--page", "docs/nowhere.md"])
    assert exit_.value.code == 2 and "docs/nowhere.md" in capsys.readouterr().err


PRINTF = "printf 'first\\n%s\\n' " + "y" * 130  # a long command, two lines out, a long one last
README = f"""The run prints loss 2.50 (figure).
{SET_UP}
```bash
exit 9
```
```bash
echo loss 2.5   # prints the figure
{PRINTF}
```
<!-- exits 3 -->
```bash
exit 3
```
"""


def _own_checkout(path, monkeypatch):
    """A committed repository of two pages, made the checkout ``main`` runs, with one
    figure of its own (the README's loss)."""
    from harness.tools import docs_figures

    (path / "docs").mkdir(parents=True)
    (path / "README.md").write_text(README)
    (path / "docs/a.md").write_text("```bash\ntouch left.txt\n```\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@localhost"]
    for argv in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "pages"]):
        subprocess.run([*git, *argv], cwd=path, check=True)
    monkeypatch.setattr(docs_run, "ROOT", path)
    figure = Figure("README.md", r"^echo loss", r"loss ([\d.]+) \(figure\)", r"loss ([\d.]+)")
    monkeypatch.setattr(docs_figures, "FIGURES", (figure,))
    return path


def _lines(capsys) -> list[str]:
    """stdout's lines, each time (a command's, the total) written ``T``."""
    out = capsys.readouterr().out
    out = re.sub(r"failed, \d+ s\)", "failed, T s)", re.sub(r"\d+\.\d s:", "T s:", out))
    return out.splitlines()


def test_the_command_line_refuses_a_page_whose_marker_is_out_of_place(
    tmp_path, capsys, monkeypatch
):
    """A marker a blank line from its block is a usage error naming the page and line,
    before any command runs (the kept copy has nothing the page's commands write)."""
    repo = _own_checkout(tmp_path / "repo", monkeypatch)
    (repo / "docs/a.md").write_text(f"{NO_RUN}\n\n```bash\ntouch left.txt\n```\n")
    with pytest.raises(SystemExit) as exit_:
        docs_run.main(["--page", "docs/a.md", "--keep", str(tmp_path / "kept")])
    assert exit_.value.code == 2
    assert f"docs/a.md:1: {NO_RUN} is not on the line directly before" in capsys.readouterr().err
    assert (tmp_path / "kept/docs/a.md").exists() and not (tmp_path / "kept/left.txt").exists()


def test_the_command_line_prints_each_command_each_figure_and_a_summary(
    tmp_path, capsys, monkeypatch
):
    """On a checkout of its own: a page's commands in order (the set-up left out), each
    status and its last output line, each figure beside its fresh value, one summary
    line; exit 0, the ``--keep`` copy kept and ``--log`` written; a page leaving a file
    behind exits 1 and names it (its temporary copy removed); ``--ref`` runs a commit's
    tree; ``--from-log`` rechecks the figures of a log whose output changed."""
    _own_checkout(tmp_path / "repo", monkeypatch)
    keep, log = tmp_path / "kept" / "copy", tmp_path / "log.json"
    assert docs_run.main(["--page", "README.md", "--keep", str(keep), "--log", str(log)]) == 0
    assert _lines(capsys) == [
        f"docs_run: 3 commands in {keep}",
        "exit 0, T s: README.md:7: echo loss 2.5   # prints the figure  -> loss 2.5",
        f"exit 0, T s: README.md:8: {PRINTF[:90]}  -> {'y' * 120}",
        "exit 3, T s: README.md:12: exit 3  -> ",
        r"ok  README.md: loss ([\d.]+) \(figure\): quoted 2.50, now 2.5",
        "docs_run: 3 commands (0 failed, T s), 1 figures (0 off), 0 paths left in the checkout",
    ]
    assert (keep / "README.md").read_text() == README
    rows = json.loads(log.read_text())
    assert [(r["command"]["line"], r["status"], r["output"]) for r in rows] == [
        (7, 0, "loss 2.5\n"),
        (8, 0, "first\n" + "y" * 130 + "\n"),
        (12, 3, ""),
    ]
    assert docs_run.main([]) == 1  # every page: docs/a.md leaves a file
    out = _lines(capsys)
    assert out[0].startswith("docs_run: 4 commands in ") and out[-2:] == [
        "left in the checkout: ?? left.txt",
        "docs_run: 4 commands (0 failed, T s), 1 figures (0 off), 1 paths left in the checkout",
    ]
    assert not pathlib.Path(out[0].removeprefix("docs_run: 4 commands in ")).exists()
    (tmp_path / "repo/README.md").write_text(README.replace("exit 3\n```", "exit 4\n```"))
    assert docs_run.main(["--page", "README.md", "--ref", "HEAD"]) == 0  # the committed tree
    capsys.readouterr()
    assert docs_run.main(["--page", "README.md"]) == 1  # the working tree's
    assert "FAILED exit 4, T s: README.md:12: exit 4  -> " in _lines(capsys)
    rows[0]["output"] = "loss 2.6\n"
    log.write_text(json.dumps(rows))
    assert docs_run.main(["--from-log", str(log)]) == 1
    assert _lines(capsys) == [
        r"OFF README.md: loss ([\d.]+) \(figure\): quoted 2.50, now 2.6",
        "docs_run: 3 commands (0 failed, T s), 1 figures (1 off), 0 paths left in the checkout",
    ]


def test_a_timed_out_command_keeps_what_it_printed_even_undecodable_or_nothing(tmp_path):
    """Its bytes decoded with replacement (0xff is U+FFFD), or nothing before the note."""
    garbled, silent = docs_run.run(
        tmp_path,
        [Command("p.md", 1, r"printf 'a\377b'; sleep 20"), Command("p.md", 2, "sleep 20")],
        timeout=1,
    )
    assert (garbled.status, garbled.output) == (124, "a\ufffdb\n(timed out)")
    assert (silent.status, silent.output) == (124, "\n(timed out)")


def test_a_command_s_seconds_are_its_clock_s_to_a_tenth(tmp_path, monkeypatch):
    """Started at 10.0 s and done at 10.26 s on docs_run's clock: 0.3 s."""
    clock = iter([10.0, 10.26])
    monkeypatch.setattr(docs_run, "time", types.SimpleNamespace(monotonic=lambda: next(clock)))
    (result,) = docs_run.run(tmp_path, [Command("p.md", 1, "true")])
    assert result.seconds == 0.3


def test_a_copy_is_made_without_a_word_from_git(tmp_path, monkeypatch, capfd):
    """git's own output (here its trace) stays out of docs_run's, which is its lines."""
    repo = _repository(tmp_path / "src")
    monkeypatch.setenv("GIT_TRACE", "1")
    docs_run.copy_checkout(repo, tmp_path / "copy")
    assert capfd.readouterr() == ("", "")


def test_a_command_runs_with_the_set_ups_environment_and_its_output_interleaved(
    tmp_path, monkeypatch
):
    """The pytest and XLA variables and the harness's device count are left out (the
    commands get the devices a new user's shell gets: `pytest --devices 1` once ran
    docs/sharding.md's 8-device mesh on 1), ``uv run`` is told to use this
    environment without syncing and the copy's code comes first; stderr joins stdout; a
    command past its timeout is status 124 with what it printed; ``git status`` outside a
    repository fails."""
    import os
    import sys

    monkeypatch.setenv("PYTEST_SOMETHING", "1")
    monkeypatch.setenv("XLA_FLAGS", "--x")
    monkeypatch.setenv("POSTTRAIN_DEVICES", "1")
    monkeypatch.setenv("KEPT_VARIABLE", "1")
    env = docs_run.environment(tmp_path)
    assert "PYTEST_SOMETHING" not in env and "XLA_FLAGS" not in env
    assert "POSTTRAIN_DEVICES" not in env
    assert env["KEPT_VARIABLE"] == env["UV_NO_SYNC"] == "1"
    assert env["UV_PROJECT_ENVIRONMENT"] == sys.prefix
    assert env["PYTHONPATH"] == f"{tmp_path / 'src'}{os.pathsep}{tmp_path}"
    both, slow = docs_run.run(
        tmp_path,
        [
            Command("p.md", 1, "echo out; echo err >&2"),
            Command("p.md", 2, "echo partial; sleep 20"),
        ],
        timeout=2,
    )
    assert (both.status, both.output) == (0, "out\nerr\n")
    assert 0 <= both.seconds < 2 and both.seconds == round(both.seconds, 1)
    assert (slow.status, slow.output) == (124, "partial\n\n(timed out)")
    with pytest.raises(subprocess.CalledProcessError):
        docs_run.dirty(tmp_path)


# the command line's options as `--help` lists them: each as invoked, then its help
HELP = (
    ("--page PAGE", "run only these pages (README.md first)"),
    ("--ref REF", "run a commit's tree (default: the working tree's files)"),
    ("--keep KEEP", "run in this new directory and keep it"),
    ("--log LOG", "write every command's output here (JSON)"),
    ("--from-log FROM_LOG", "check the figures of an earlier --log"),
)


def test_the_command_line_s_help_and_its_refusal_of_a_page_that_is_none(
    tmp_path, capsys, monkeypatch
):
    """``--help`` shows the usage as ``python -m harness.tools.docs_run``, the module's
    docstring and each option's help; ``--page`` of no page is a usage error listing the
    pages (this checkout's own, in the order they run), before anything runs."""
    _own_checkout(tmp_path / "repo", monkeypatch)
    monkeypatch.setenv("COLUMNS", "1000")
    text = " ".join(help_text(docs_run.main, capsys).split())
    assert text.startswith("usage: python -m harness.tools.docs_run [-h] [--page PAGE] ")
    assert " ".join(docs_run.__doc__.split()) in text
    assert text.endswith(" ".join(f"{invocation} {words}" for invocation, words in HELP))
    with pytest.raises(SystemExit) as exit_:
        docs_run.main(["--page", "README.md", "--page", "docs/nowhere.md"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "python -m harness.tools.docs_run: error: --page 'docs/nowhere.md': not one of "
        "README.md, docs/a.md"
    )
