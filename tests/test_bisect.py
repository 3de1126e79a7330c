"""``posttrain-harness bisect`` over a fake upstream repository built here (no network).

The fake ``google-tunix`` has seven commits: c1 the good base, c2 and c4 harmless, c3
does not install, c5 renames a keyword a contract pins (the break), c6 harmless, c7
deprecates a function the second contract calls (the early signal)."""

from __future__ import annotations

import json
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

from harness import cli
from harness.bisect import bisect, git_history, suggestions
from harness.matrix import envs, sources
from tests.test_matrix_sources import FAKE_PYPROJECT

pytestmark = pytest.mark.host


def git(*args: str, cwd: Path) -> str:
    done = subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


CONTRACTS = """\
import tunix


def test_train_step_takes_is_update_step():
    assert tunix.train_step(1, is_update_step=True) == 2


def test_helper_is_quiet():
    assert tunix.helper() == 1
"""

SIGNATURE = "def train_step(x, is_update_step):\n    return x + 1\n"
RENAMED = "def train_step(x, update):\n    return x + 1\n"
STEPS = {
    "c1 base": SIGNATURE,
    "c2 docs": '"""Fake tunix."""\n' + SIGNATURE,
    "c3 broken build": None,  # a pyproject.toml no installer accepts
    "c4 more docs": '"""Fake tunix, documented."""\n' + SIGNATURE,
    "c5 rename is_update_step": '"""Fake tunix, documented."""\n' + RENAMED,
    "c6 tidy": '"""Fake tunix, tidied."""\n' + RENAMED,
}
HELPER = "def helper():\n    return 1\n"
DEPRECATED = (
    "import warnings\n\n\ndef helper():\n"
    "    warnings.warn('helper is deprecated', DeprecationWarning, stacklevel=2)\n"
    "    return 1\n"
)


@pytest.fixture(scope="module")
def upstream(tmp_path_factory) -> tuple[Path, dict[str, str], Path]:
    """The fake repository, its commits by subject, and the contracts file."""
    root = tmp_path_factory.mktemp("upstream")
    git("init", "-q", "-b", "main", cwd=root)
    (root / "tunix").mkdir()
    shas = {}
    body = ""
    for subject, code in STEPS.items():
        (root / "pyproject.toml").write_text(FAKE_PYPROJECT if code else "[project\n")
        body = code or body
        (root / "tunix" / "__init__.py").write_text(body + HELPER)
        git("add", "-A", cwd=root)
        git("commit", "-q", "-m", subject, cwd=root)
        shas[subject] = git("rev-parse", "HEAD", cwd=root)
        if subject == "c2 docs":
            git("tag", "v0.1.7", cwd=root)  # the newest release, as the matrix names it
    (root / "tunix" / "__init__.py").write_text(body + DEPRECATED)
    git("commit", "-qam", "c7 deprecate helper", cwd=root)
    shas["c7 deprecate helper"] = git("rev-parse", "HEAD", cwd=root)
    contracts = tmp_path_factory.mktemp("contracts") / "test_fake_contracts.py"
    contracts.write_text(textwrap.dedent(CONTRACTS))
    return root, shas, contracts


def _run(upstream, tmp_path, contract: str, good: str, bad: str, verdict: str = "fail"):
    root, shas, contracts = upstream
    cache = tmp_path.parent / "bisect-envs"  # shared by this module's tests: one build a tree
    lines: list[str] = []
    stepper = bisect.Stepper(
        root,
        bisect.Target("node", f"{contracts}::{contract}"),
        verdict=verdict,
        cache=envs.EnvCache(cache),
        work=tmp_path,
        log=lines.append,
    )
    target = bisect.Target("node", str(contracts))
    return bisect.bisect(root, shas[good], shas[bad], target, stepper, verdict=verdict), lines


@pytest.mark.slow  # 18 s (4 environments); the gate runs the search on given verdicts
@pytest.mark.skipif(shutil.which("uv") is None, reason="the environment build uses uv here")
def test_a_real_bisection_skips_the_uninstallable_commit_and_names_the_break(upstream, tmp_path):
    """The short run (4 environments): c2 good, c5 bad; c3 cannot be built, so it is a
    skip, never bad; c4 passes; c5 is named."""
    root, shas, _ = upstream
    result, lines = _run(
        upstream,
        tmp_path,
        "test_train_step_takes_is_update_step",
        "c2 docs",
        "c5 rename is_update_step",
    )
    assert [(s["subject"], s["verdict"]) for s in result["steps"]] == [
        ("c2 docs", "good"),
        ("c5 rename is_update_step", "bad"),
        ("c3 broken build", "skip"),
        ("c4 more docs", "good"),
    ], lines
    assert result["first_bad"]["sha"] == shas["c5 rename is_update_step"]
    assert "environment build failed" in result["steps"][2]["why"]


@pytest.mark.slow  # 9 environments
@pytest.mark.skipif(shutil.which("uv") is None, reason="the environment build uses uv here")
def test_bisect_names_the_breaking_commit_and_skips_the_uninstallable_one(upstream, tmp_path):
    """c1 good, c6 bad: c3 cannot be built (skip, never bad), c5 is named with its
    subject and the file it touched; the steps stay within the endpoints + log2(N) +
    skips; the warn verdict names c7, the commit that added the deprecation."""
    root, shas, _ = upstream
    result, lines = _run(
        upstream, tmp_path, "test_train_step_takes_is_update_step", "c1 base", "c6 tidy"
    )
    assert result["first_bad"]["sha"] == shas["c5 rename is_update_step"], lines
    assert result["first_bad"]["subject"] == "c5 rename is_update_step"
    assert result["first_bad"]["files"] == ["tunix/__init__.py"]
    verdicts = {s["subject"]: s["verdict"] for s in result["steps"]}
    assert verdicts == {
        "c1 base": "good",
        "c6 tidy": "bad",
        "c3 broken build": "skip",
        "c2 docs": "good",
        "c4 more docs": "good",
        "c5 rename is_update_step": "bad",
    }, lines
    assert len(result["steps"]) <= 2 + 3 + 1  # endpoints, log2(5) rounded up, one skip
    assert len(lines) == len(result["steps"])
    assert all(line.startswith("bisect: step ") for line in lines), lines
    warned, lines = _run(
        upstream,
        tmp_path,
        "test_helper_is_quiet",
        "c5 rename is_update_step",
        "c7 deprecate helper",
        verdict="warn",
    )
    assert warned["first_bad"]["sha"] == shas["c7 deprecate helper"], lines
    # the same range with the fail verdict: the deprecation alone is no failure
    with pytest.raises(ValueError, match="--bad .* is in fact good"):
        _run(
            upstream,
            tmp_path,
            "test_helper_is_quiet",
            "c5 rename is_update_step",
            "c7 deprecate helper",
        )


class FakeStepper:
    """Verdicts by subject, no environments: the search and the refusals alone."""

    def __init__(self, verdicts: dict[str, str]) -> None:
        self.verdicts = verdicts

    def __call__(self, commit):
        return self.verdicts[commit.subject], "fake"


@pytest.mark.parametrize(
    ("verdicts", "found"),
    [
        (
            {
                "c2 docs": "good",
                "c3 broken build": "skip",
                "c4 more docs": "good",
                "c5 rename is_update_step": "bad",
            },
            ["c5 rename is_update_step"],
        ),
        (
            {
                "c2 docs": "bad",
                "c3 broken build": "bad",
                "c4 more docs": "bad",
                "c5 rename is_update_step": "bad",
            },
            ["c2 docs"],
        ),
        (
            {
                "c2 docs": "good",
                "c3 broken build": "good",
                "c4 more docs": "good",
                "c5 rename is_update_step": "good",
            },
            ["c6 tidy"],
        ),
        # a skip right before the first bad commit: the range is named, not a guess
        (
            {
                "c2 docs": "good",
                "c3 broken build": "good",
                "c4 more docs": "skip",
                "c5 rename is_update_step": "bad",
            },
            ["c4 more docs", "c5 rename is_update_step"],
        ),
        (
            {
                "c2 docs": "skip",
                "c3 broken build": "skip",
                "c4 more docs": "skip",
                "c5 rename is_update_step": "skip",
            },
            ["c2 docs", "c3 broken build", "c4 more docs", "c5 rename is_update_step", "c6 tidy"],
        ),
    ],
)
def test_the_search_names_the_first_bad_commit_or_the_range_skips_leave(upstream, verdicts, found):
    root, shas, contracts = upstream
    fake = FakeStepper({"c1 base": "good", "c6 tidy": "bad", **verdicts})
    result = bisect.bisect(
        root, shas["c1 base"], shas["c6 tidy"], bisect.Target("node", str(contracts)), fake
    )
    assert [c["subject"] for c in result["candidates"]] == found
    assert (result["first_bad"] is not None) == (len(found) == 1)


def test_a_good_ref_that_is_bad_and_a_bad_ref_that_is_good_are_refused(upstream):
    root, shas, contracts = upstream
    target = bisect.Target("node", str(contracts))
    with pytest.raises(ValueError, match=r"^--good [0-9a-f]{12} is in fact bad: fake$"):
        bisect.bisect(
            root,
            shas["c1 base"],
            shas["c6 tidy"],
            target,
            FakeStepper({"c1 base": "bad", "c6 tidy": "bad"}),
        )
    with pytest.raises(ValueError, match=r"^--bad [0-9a-f]{12} is in fact good: fake$"):
        bisect.bisect(
            root,
            shas["c1 base"],
            shas["c6 tidy"],
            target,
            FakeStepper({"c1 base": "good", "c6 tidy": "good"}),
        )


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--contract", "contracts/test_nope.py::test_x"], "test_nope.py does not exist"),
        (["--contract", "contracts/test_tunix_rl.py::test_nope"], "has no test 'test_nope'"),
        (["--contract", "tunix.no.such.symbol"], "no such contract"),
        (["--contract", "sft", "--verdict", "warn"], "--verdict warn needs a contract"),
        (["--source", "NOTGIT"], "not a git repository"),
        (["--good", "nope"], "--good 'nope': no such commit"),
        (["--bad", "HEAD~9"], "--bad 'HEAD~9': no such commit"),
        (["--good", "HEAD", "--bad", "HEAD~1"], "is not an ancestor of --bad"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(upstream, tmp_path, capsys, argv, words):
    root, shas, _ = upstream
    defaults = {
        "--contract": "tunix.sft.peft_trainer.PeftTrainer._train_step",
        "--source": str(root),
        "--good": "HEAD~2",
        "--bad": "HEAD",
    }
    given = dict(zip(argv[::2], argv[1::2], strict=True))
    if given.get("--source") == "NOTGIT":
        given["--source"] = str(tmp_path)
    merged = [x for k, v in {**defaults, **given}.items() for x in (k, v)]
    out = tmp_path / "reports"
    assert (
        cli.main(["bisect", *merged, "--report-dir", str(out), "--cache", str(tmp_path / "envs")])
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert not out.exists() and not (tmp_path / "envs").exists()


@pytest.mark.parametrize(
    ("good", "bad"), [("HEAD", "HEAD"), ("HEAD~0", "main")], ids=["same-ref", "same-commit"]
)
def test_good_and_bad_naming_one_commit_are_refused_before_any_build(
    upstream, tmp_path, capsys, monkeypatch, good, bad
):
    """``--good`` and ``--bad`` resolved to one commit: one line naming both, exit 2,
    before an environment is built (it built one for 12 s first; #56 9)."""
    root, _, _ = upstream

    def ensure(self, entry, rebuild=False):
        raise AssertionError("an environment was built before the refusal")

    monkeypatch.setattr(envs.EnvCache, "ensure", ensure)
    argv = [
        "bisect",
        "--contract",
        "sft",
        "--source",
        str(root),
        "--good",
        good,
        "--bad",
        bad,
        "--report-dir",
        str(tmp_path / "r"),
        "--cache",
        str(tmp_path / "envs"),
    ]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--good {good!r} and --bad {bad!r} are the same commit" in err[0]
    assert not (tmp_path / "r").exists() and not (tmp_path / "envs").exists()


SIGTERM_DURING_BUILD = """
import subprocess, sys
from pathlib import Path
from harness import cli
from harness.matrix import envs

def build(self, entry, path):  # a build that is half done when the signal comes
    (path / "bin").mkdir(parents=True)
    subprocess.run(["sh", "-c", "echo building; exec sleep 60"])  # as EnvCache runs a step
    return None

envs.EnvCache._build = build
sys.exit(cli.main(sys.argv[1:]))
"""


def test_sigterm_during_an_environment_build_is_one_line_143_and_leaves_nothing(upstream, tmp_path):
    """SIGTERM while bisect builds an environment: one line, exit 143, and neither the
    ``bisect-*`` export nor the half-built environment is left (it exited 143 without a
    word and left both; #56 11)."""
    import os
    import signal
    import sys
    import time

    root, _, _ = upstream
    temp, cache = tmp_path / "tmp", tmp_path / "envs"
    temp.mkdir()
    process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            SIGTERM_DURING_BUILD,
            "bisect",
            "--contract",
            "sft",
            "--source",
            str(root),
            "--good",
            "HEAD~2",
            "--bad",
            "HEAD",
            "--report-dir",
            str(tmp_path / "r"),
            "--cache",
            str(cache),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(temp)},
        cwd=Path(cli.__file__).parent.parent,
    )
    assert process.stdout.readline() == "building\n"
    time.sleep(0.5)  # the build's process started: the signal comes while it runs
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=30)
    assert process.returncode == 143, err
    assert err.strip().splitlines() == ["posttrain-harness: interrupted (SIGTERM)"], err
    assert list(temp.iterdir()) == [], list(temp.iterdir())
    assert not cache.exists() or [p.name for p in cache.iterdir()] == [], list(cache.iterdir())
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("flag", ["--good", "--bad"])
@pytest.mark.parametrize(
    "value",
    ["--output={out}", "-o{out}", "--end-of-options", "HEAD --output={out}", "HEAD^{{tree}}"],
    ids=["long-option", "short-option", "end-of-options", "spaced", "not-a-commit"],
)
def test_a_ref_that_looks_like_an_option_is_refused_and_never_reaches_git(
    upstream, tmp_path, capsys, flag, value
):
    """Every ref is verified as a commit (``rev-parse --verify --end-of-options``) before
    git sees it: an option (``git log --output=FILE`` writes FILE) or a non-commit is one
    line naming the value, exit 2, and nothing is written."""
    root, _, _ = upstream
    out = tmp_path / "written"
    value = value.format(out=out)
    refs = {"--good": "HEAD~2", "--bad": "HEAD", flag: value}
    argv = [
        "bisect",
        "--contract",
        "sft",
        "--source",
        str(root),
        f"--good={refs['--good']}",
        f"--bad={refs['--bad']}",
        "--report-dir",
        str(tmp_path / "r"),
        "--cache",
        str(tmp_path / "envs"),
    ]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{flag} {value!r}: no such commit" in err[0], err
    assert not out.exists() and not (tmp_path / "r").exists()


def test_git_calls_put_end_of_options_before_user_values(upstream, monkeypatch):
    """The refs reach git only after ``--end-of-options`` (and as verified commits)."""
    root, shas, _ = upstream
    seen: list[list[str]] = []
    real = subprocess.run

    def record(command, *args, **kwargs):
        seen.append(list(command))
        return real(command, *args, **kwargs)

    monkeypatch.setattr(git_history.subprocess, "run", record)
    git_history.commits_between(root, "HEAD~2", "HEAD")
    for ref in ("HEAD~2", "HEAD"):  # each once, verified; git sees hashes after that
        (call,) = [c for c in seen if f"{ref}^{{commit}}" in c]
        assert call.index("--end-of-options") < call.index(f"{ref}^{{commit}}"), call


def test_the_result_is_written_and_summarised(tmp_path):
    commit = {"sha": "a" * 40, "date": "2026-11-30T10:00:00+00:00", "subject": "rename it"}
    result = {
        "verdict": "fail",
        "commits": 9,
        "steps": [{}] * 5,
        "candidates": [commit],
        "first_bad": {**commit, "files": ["tunix/sft/peft_trainer.py"]},
    }
    path = bisect.write(result, tmp_path)
    assert json.loads(path.read_text()) == result
    assert bisect.summary(result) == [
        f"first bad commit: {'a' * 40} (2026-11-30T10:00:00+00:00)",
        "  rename it",
        "  files: tunix/sft/peft_trainer.py",
        "9 commits between good and bad; 5 steps",
    ]


def _cell(status: str, **more) -> dict:
    return {"status": status, "message": "m", **more}


def test_the_report_suggests_bisecting_a_source_rows_break_that_the_newest_release_passes():
    """A FAIL or warn cell of a source row gets the exact command, where the newest
    current release passes that column cleanly; a column the release also warns or
    fails in is no upstream regression between them, and gets none."""
    from harness.report import markdown, report

    def row(name, tunix, contracts, sft, **more):
        return {
            "name": name,
            "tunix": tunix,
            "flavour": more.pop("flavour", "current"),
            "convention": "bound2",
            "contracts": contracts,
            "sft": sft,
            **more,
        }

    rows = [
        row("tunix-0.1.5", "0.1.5", {"c": _cell("failed"), "d": _cell("passed")}, _cell("passed")),
        row(
            "tunix-0.1.7",
            "0.1.7",
            {"c": _cell("passed"), "d": _cell("passed", warnings=["w"]), "e": _cell("passed")},
            _cell("passed"),
        ),
        row(
            "tunix-main",
            "main",
            {
                "c": _cell("failed", test="contracts/test_x.py::test_c"),
                "d": _cell("failed"),
                "e": _cell("warned"),
            },
            _cell("failed"),
            flavour="source",
            source={"spec": "/src/tunix", "resolved": "f" * 40},
        ),
    ]
    found = suggestions.suggestions(rows)
    base = f"posttrain-harness bisect --source /src/tunix --good v0.1.7 --bad {'f' * 40}"
    assert found[0]["verdict"] == "fail" and found[1]["verdict"] == "warn"
    assert (found[0]["good"], found[0]["bad"], found[0]["source"]) == (
        "v0.1.7",
        "f" * 40,
        "/src/tunix",
    )
    assert [(f["column"], f["command"]) for f in found] == [
        ("c", f"{base} --contract contracts/test_x.py::test_c"),
        ("e", f"{base} --contract e --verdict warn"),
        ("sft", f"{base} --contract sft"),
    ]
    built = report.build(rows, "m", bisect=found)
    assert f"`{base} --contract sft`" in markdown.markdown(built)
    assert suggestions.suggestions(rows[:2]) == []  # no source row


@pytest.mark.slow  # 4 environments
@pytest.mark.skipif(shutil.which("uv") is None, reason="the environment build uses uv here")
def test_matrix_bisect_runs_each_suggestion_and_names_the_commit(upstream, tmp_path):
    """matrix --bisect: the suggestion for a source row's failing cell, run, names c5 in
    the report's summary."""
    from harness.report import markdown, report

    root, shas, contracts = upstream
    node = f"{contracts}::test_train_step_takes_is_update_step"
    rows = [
        {
            "name": "tunix-0.1.7",
            "tunix": "0.1.7",
            "flavour": "current",
            "convention": "bound2",
            "contracts": {"t": _cell("passed")},
        },
        {
            "name": "tunix-main",
            "tunix": "main",
            "flavour": "source",
            "convention": "bound2",
            "contracts": {"t": _cell("failed", test=node)},
            "source": {"spec": str(root), "resolved": shas["c5 rename is_update_step"]},
        },
    ]
    found = suggestions.suggestions(rows)
    named = bisect.run_suggestions(found, envs.EnvCache(tmp_path / "envs"), log=lambda _: None)
    assert named[0]["named"]["sha"] == shas["c5 rename is_update_step"], named
    text = markdown.markdown(report.build(rows, "m", bisect=named))
    assert f"first bad: `{shas['c5 rename is_update_step'][:12]}` c5 rename" in text


def test_a_merge_named_as_first_bad_lists_the_commits_it_brought_in(tmp_path):
    """First-parent bisection names a merge (a pull request); its own commits, where the
    change is, come with it. A plain commit has none."""
    root = tmp_path / "r"
    root.mkdir()
    git("init", "-q", "-b", "main", cwd=root)
    git("commit", "-q", "--allow-empty", "-m", "base", cwd=root)
    git("checkout", "-q", "-b", "pr", cwd=root)
    git("commit", "-q", "--allow-empty", "-m", "stop decode one step earlier", cwd=root)
    git("checkout", "-q", "main", cwd=root)
    git("commit", "-q", "--allow-empty", "-m", "unrelated", cwd=root)
    git("merge", "-q", "--no-ff", "-m", "Merge pull request #1", "pr", cwd=root)
    merge = git_history.Commit(git("rev-parse", "HEAD", cwd=root), "", "")
    pr = git("rev-parse", "pr", cwd=root)
    assert git_history.merged(root, merge) == [f"{pr} stop decode one step earlier"]
    assert git_history.merged(root, git_history.Commit(pr, "", "")) == []


SOURCE_SECRET = "t0ken@with:odd%40chars"


@pytest.fixture
def served(upstream, tmp_path):
    """The fake upstream as a bare repository over git's dumb HTTP on loopback, behind
    Basic authentication with :data:`SOURCE_SECRET`; yields the URL with credentials."""
    import base64
    import functools
    import http.server
    import threading
    from urllib.parse import quote

    root, _, _ = upstream
    bare = tmp_path / "served" / "tunix.git"
    git("clone", "-q", "--bare", str(root), str(bare), cwd=tmp_path)
    git("update-server-info", cwd=bare)
    wanted = "Basic " + base64.b64encode(f"user:{SOURCE_SECRET}".encode()).decode()

    class Handler(http.server.SimpleHTTPRequestHandler):
        def do_GET(self):
            if self.headers.get("Authorization") != wanted:
                self.send_response(401)
                self.send_header("WWW-Authenticate", 'Basic realm="t"')
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            super().do_GET()

        def log_message(self, *args):
            pass

    handler = functools.partial(Handler, directory=str(bare.parent))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        host, port = server.server_address[:2]
        yield f"http://user:{quote(SOURCE_SECRET, safe='')}@{host}:{port}/tunix.git"
    finally:
        server.shutdown()
        server.server_close()


def test_a_cloned_source_keeps_no_credentials_and_lives_under_the_cache(served, tmp_path):
    """A ``--source`` URL with a token is cloned (and fetched again) with the token given
    to git through its environment only: no file of the clone (config, logs, FETCH_HEAD,
    packed-refs) holds it. The clone lives under ``--cache`` itself, not beside it."""
    from urllib.parse import quote

    cache = tmp_path / "cache"
    repo = git_history.local_checkout(served, cache)
    assert repo.parent == cache / "sources", repo
    assert git_history.local_checkout(served, cache) == repo  # the fetch works too
    assert git("rev-parse", "HEAD", cwd=repo)
    secrets = (SOURCE_SECRET, quote(SOURCE_SECRET, safe=""), "user:")
    for path in repo.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert not any(s.encode() in data for s in secrets), path
    assert git("remote", "get-url", "origin", cwd=repo) == sources.strip_userinfo(served)


def test_bisect_and_matrix_bisect_clone_under_the_cache_they_are_given(tmp_path, monkeypatch):
    """``bisect --cache DIR`` and ``matrix --bisect`` hand DIR itself as the clones'
    root (``DIR/sources/...``), never its parent."""
    seen = []

    def checkout(source, root):
        seen.append(root)
        raise ValueError("stop")

    monkeypatch.setattr(bisect, "local_checkout", checkout)
    monkeypatch.setattr(git_history, "local_checkout", checkout)
    item = {"contract": "sft", "source": "https://h/x", "good": "a", "bad": "b", "verdict": "fail"}
    (done,) = bisect.run_suggestions([item], envs.EnvCache(tmp_path / "cache"))
    assert done["why"] == "stop"
    argv = [
        "bisect",
        "--contract",
        "sft",
        "--source",
        "https://h/x",
        "--good",
        "a",
        "--bad",
        "b",
        "--cache",
        str(tmp_path / "cache"),
        "--report-dir",
        str(tmp_path / "r"),
    ]
    assert cli.main(argv) == 2
    assert seen == [tmp_path / "cache", tmp_path / "cache"]


# --- odd histories: a merged pull request and a commit whose target errors ------------

RAISING = "def helper():\n    raise RuntimeError('helper broke')\n"
TWO = "def helper():\n    return 2\n"
README = "Fake tunix.\n"

#: (subject, branch, tunix/__init__.py or None for a README-only change), in commit
#: order, one minute apart. ``pr`` branches from c2 and is merged into main after c3:
#: first-parent history is c1 c2 c3 merge c4 c5; dated order puts p1 between c3 and
#: the merge, where a walk over every commit would step on it.
ODD = [
    ("c1 base", "main", SIGNATURE + HELPER),
    ("c2 docs", "main", '"""Fake tunix."""\n' + SIGNATURE + HELPER),
    ("c3 readme", "main", None),
    ("p1 rename is_update_step", "pr", '"""Fake tunix."""\n' + RENAMED + HELPER),
    ("Merge pull request #1", "main", None),
    ("c4 helper raises", "main", '"""Fake tunix."""\n' + RENAMED + RAISING),
    ("c5 helper returns 2", "main", '"""Fake tunix."""\n' + RENAMED + TWO),
]

#: fake contracts (node name -> (fixture, check)) on the namespace of a tree's
#: tunix/__init__.py: an exception in the fixture is a JUnit ``error`` (as pytest's setup
#: errors are), a false or raising check a ``failure``
FAKE_CONTRACTS = {
    "test_train_step_takes_is_update_step": (
        lambda tunix: None,
        lambda tunix, _: tunix["train_step"](1, is_update_step=True) == 2,
    ),
    "test_helper_is_one": (lambda tunix: tunix["helper"](), lambda tunix, value: value == 1),
}


@pytest.fixture(scope="module")
def odd_upstream(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """:data:`ODD` as a repository; its commits by subject."""
    import os

    root = tmp_path_factory.mktemp("odd-upstream")
    (root / "tunix").mkdir()
    shas: dict[str, str] = {}
    for minute, (subject, branch, code) in enumerate(ODD):
        when = f"2026-01-01T10:{minute:02d}:00+00:00"
        dated = {**os.environ, "GIT_AUTHOR_DATE": when, "GIT_COMMITTER_DATE": when}

        def at(*args, env=dated):
            return subprocess.run(
                ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                cwd=root,
                capture_output=True,
                text=True,
                check=True,
                env=env,
            ).stdout.strip()

        if not shas:
            at("init", "-q", "-b", "main")
        elif subject.startswith("p1"):
            at("checkout", "-q", "-b", "pr", shas["c2 docs"])
        elif branch == "main" and at("branch", "--show-current") != "main":
            at("checkout", "-q", "main")
        if subject.startswith("Merge"):
            at("merge", "-q", "--no-ff", "-m", subject, "pr")
        else:
            if code is None:
                (root / "README.md").write_text(README + subject + "\n")
            else:
                (root / "tunix" / "__init__.py").write_text(code)
            at("add", "-A")
            at("commit", "-q", "-m", subject)
        shas[subject] = at("rev-parse", "HEAD")
    return root, shas


class TreeCache:
    """An environment cache that builds nothing: each tree's "environment" is a path
    inside the exported tree, so the runner finds the tree from the command's python."""

    def ensure(self, entry):
        return envs.EnvResult(Path(entry.source) / "env", built=False, seconds=0.0)


def tree_runner(command, environ):
    """Runs the node's :data:`FAKE_CONTRACTS` entry on the tree the command's python lies
    in and writes the JUnit file the command names, as pytest would."""
    import runpy
    from xml.sax.saxutils import quoteattr

    tree = Path(command[0]).parents[2]
    junit_file = next(a.split("=", 1)[1] for a in command if a.startswith("--junitxml="))
    name = command[3].split("::")[-1]
    tunix = runpy.run_path(str(tree / "tunix" / "__init__.py"))
    fixture, check = FAKE_CONTRACTS[name]
    try:
        value = fixture(tunix)
    except Exception as error:
        outcome = f"<error message={quoteattr(repr(error))}/>"
    else:
        try:
            outcome = "" if check(tunix, value) else "<failure message='assert False'/>"
        except Exception as error:
            outcome = f"<failure message={quoteattr(repr(error))}/>"
    Path(junit_file).write_text(
        f"<testsuites><testsuite><testcase classname='test_fake' name='{name}'>"
        f"{outcome}</testcase></testsuite></testsuites>"
    )
    return subprocess.CompletedProcess(command, 0, "", "")


def odd_bisect(odd_upstream, tmp_path, contract: str, good: str, bad: str):
    root, shas = odd_upstream
    target = bisect.Target("node", f"/fake/test_fake.py::{contract}")
    stepper = bisect.Stepper(
        root, target, cache=TreeCache(), work=tmp_path, runner=tree_runner, log=lambda _: None
    )
    return bisect.bisect(root, shas[good], shas[bad], target, stepper)


def test_the_walk_is_first_parent_history(odd_upstream):
    """Between c1 and c5 lie c2, c3, the merge, c4 and c5: the pull request's own commit
    (p1, dated between c3 and the merge) is not among them."""
    root, shas = odd_upstream
    _, _, between = git_history.commits_between(root, shas["c1 base"], shas["c5 helper returns 2"])
    assert [c.subject for c in between] == [
        "c2 docs",
        "c3 readme",
        "Merge pull request #1",
        "c4 helper raises",
        "c5 helper returns 2",
    ]


def test_a_break_brought_in_by_a_merge_names_the_merge(odd_upstream, tmp_path):
    """The rename lands on main with the merge: bisect names the merge (with p1 as what
    it brought in), and no step classifies a commit off the first-parent line."""
    root, shas = odd_upstream
    result = odd_bisect(
        odd_upstream,
        tmp_path,
        "test_train_step_takes_is_update_step",
        "c1 base",
        "c5 helper returns 2",
    )
    assert result["first_bad"]["subject"] == "Merge pull request #1", result["steps"]
    assert result["first_bad"]["merged"] == [
        f"{shas['p1 rename is_update_step']} p1 rename is_update_step"
    ]
    assert result["commits"] == 5
    assert all(not s["subject"].startswith("p1") for s in result["steps"]), result["steps"]


def test_a_target_that_errors_is_bad_not_good_nor_skipped(odd_upstream, tmp_path):
    """c4 makes the contract's fixture raise (a JUnit error), c5 makes its assertion fail:
    the first bad commit is c4, classified bad with the error's message; from c4 on as
    ``--bad``, the erroring endpoint is accepted as bad."""
    root, shas = odd_upstream
    result = odd_bisect(
        odd_upstream, tmp_path, "test_helper_is_one", "c1 base", "c5 helper returns 2"
    )
    assert result["first_bad"] is not None, result["candidates"]
    assert result["first_bad"]["subject"] == "c4 helper raises", result["steps"]
    (step,) = [s for s in result["steps"] if s["subject"] == "c4 helper raises"]
    assert step["verdict"] == "bad" and step["why"].startswith("error: "), step
    assert "helper broke" in step["why"]
    ends = odd_bisect(odd_upstream, tmp_path, "test_helper_is_one", "c2 docs", "c4 helper raises")
    assert ends["first_bad"]["subject"] == "c4 helper raises"
