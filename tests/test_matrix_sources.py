"""The matrix from a Tunix source (harness/matrix/sources.py), the warn verdict for upstream
deprecations (harness/gate/deprecations.py) and n/a for emulations over a base of another era."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harness import cli
from harness.matrix import entries, envs, matrix, run_cells, sources
from posttrain.training import tunix_compat

pytestmark = pytest.mark.host

FAKE_PYPROJECT = """\
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"
[project]
name = "google-tunix"
version = "0.1.99"
"""


def fake_tunix(root, marker="first"):
    """A minimal package that installs as google-tunix (a stand-in for a checkout)."""
    (root / "tunix").mkdir(parents=True, exist_ok=True)
    (root / "pyproject.toml").write_text(FAKE_PYPROJECT)
    (root / "tunix" / "__init__.py").write_text(f"MARKER = {marker!r}\n")
    return root


def git(*args, cwd):
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=cwd,
        check=True,
        capture_output=True,
    )


@pytest.mark.parametrize(
    ("spec", "url", "ref"),
    [
        ("https://github.com/google/tunix@main", "https://github.com/google/tunix", "main"),
        (
            "git+https://github.com/google/tunix.git@v0.1.8",
            "https://github.com/google/tunix.git",
            "v0.1.8",
        ),
        ("https://github.com/google/tunix", "https://github.com/google/tunix", "HEAD"),
        # the user part of ssh://git@host is not a ref; a ref with a slash is kept whole
        ("ssh://git@github.com/google/tunix", "ssh://git@github.com/google/tunix", "HEAD"),
        ("https://h/x@feature/a", "https://h/x", "feature/a"),
        ("https://h:8443/x@v1", "https://h:8443/x", "v1"),
        ("git@github.com:google/tunix.git@main", "git@github.com:google/tunix.git", "main"),
        ("git@github.com:google/tunix.git", "git@github.com:google/tunix.git", "HEAD"),
    ],
)
def test_a_url_spec_splits_into_url_and_ref(spec, url, ref):
    parsed = sources.parse(spec)
    assert (parsed.url, parsed.ref, parsed.path) == (url, ref, None)


def test_a_directory_resolves_to_its_tree_and_moves_with_its_files(tmp_path):
    """Not a git checkout: the id is a hash of the files; editing one changes it, and a
    byte-identical copy elsewhere has the same id."""
    root = fake_tunix(tmp_path / "t")
    first = sources.resolve(sources.parse(str(root)))
    assert first.id.startswith("tree.") and first.requirement == f"google-tunix @ {root.as_uri()}"
    (root / "tunix" / "__pycache__").mkdir()
    (root / "tunix" / "__pycache__" / "x.pyc").write_bytes(b"\0")  # build output: ignored
    assert sources.resolve(sources.parse(str(root))).id == first.id
    fake_tunix(root, marker="second")
    assert sources.resolve(sources.parse(str(root))).id != first.id
    copy = fake_tunix(tmp_path / "copy", marker="second")
    assert sources.tree_hash(copy) == sources.tree_hash(root)
    # a nested "dist" package is code, not a build output; a linked directory is followed
    (root / "tunix" / "dist").mkdir()
    (root / "tunix" / "dist" / "a.py").write_text("x = 1\n")
    before = sources.tree_hash(root)
    (root / "tunix" / "dist" / "a.py").write_text("x = 2\n")
    assert sources.tree_hash(root) != before
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "b.py").write_text("y = 1\n")
    (root / "tunix" / "ext").symlink_to(outside, target_is_directory=True)
    (root / "tunix" / "loop").symlink_to(root, target_is_directory=True)  # no endless walk
    before = sources.tree_hash(root)
    (outside / "b.py").write_text("y = 2\n")
    assert sources.tree_hash(root) != before


def test_a_git_checkout_resolves_to_its_commit_and_a_dirty_one_says_so(tmp_path):
    root = fake_tunix(tmp_path / "t")
    git("init", "-q", "-b", "main", cwd=root)
    git("add", ".", cwd=root)
    git("commit", "-q", "-m", "one", cwd=root)
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True
    ).stdout.strip()
    assert sources.resolve(sources.parse(str(root))).id == head
    fake_tunix(root, marker="edited")
    dirty = sources.resolve(sources.parse(str(root))).id
    assert dirty.startswith(f"{head}+tree.")
    # the same repository as a git URL: ls-remote resolves the branch to the commit
    url = sources.resolve(sources.parse(f"file://{root}@main"))
    assert url.id == head
    assert url.requirement == f"google-tunix @ git+file://{root}@{head}"
    with pytest.raises(sources.SourceError, match="ref 'nope' not found on the remote"):
        sources.resolve(sources.parse(f"file://{root}@nope"))
    # an annotated tag resolves to its commit, not to the tag object
    git("tag", "-a", "v1", "-m", "release", cwd=root)
    assert sources.resolve(sources.parse(f"file://{root}@v1")).id == head
    assert sources.resolve(sources.parse(f"file://{root}@{head.upper()}")).id == head


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("https://127.0.0.1:9/google/tunix@main", "cannot be reached"),
        ("file:///nonexistent/tunix@main", "cannot be reached"),
        ("/nonexistent/tunix", "is not a directory"),
        ("", "is empty"),
    ],
)
def test_a_source_that_cannot_be_had_is_a_one_line_error(spec, message):
    with pytest.raises(sources.SourceError, match=message) as caught:
        sources.resolve(sources.parse(spec))
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("where", ["resolve", "clone"])
def test_a_source_url_that_looks_like_an_option_never_reaches_git_as_one(tmp_path, where):
    """A spec such as ``--upload-pack=CMD;://x`` is a URL to git (after
    ``--end-of-options``), never an option: git runs nothing and the spec is one line."""
    from harness.bisect import git_history

    marker = tmp_path / "ran"
    spec = f"--upload-pack=touch {marker};echo ://x@main"
    with pytest.raises(ValueError, match="cannot be") as caught:
        if where == "resolve":
            sources.resolve(sources.parse(spec))
        else:
            git_history.local_checkout(spec, tmp_path / "cache")
    assert "\n" not in str(caught.value)
    assert not marker.exists()


def test_a_directory_without_a_package_is_named(tmp_path):
    with pytest.raises(sources.SourceError, match="has no pyproject.toml or setup.py"):
        sources.resolve(sources.parse(str(tmp_path)))


def test_an_unreachable_source_is_an_error_row_and_the_command_exits_1(tmp_path, capsys):
    """--tunix-source overrides the file's source entry; unreachable, its row is an error
    naming the reason, the others still run, and the report says it."""
    path = tmp_path / "entries.toml"
    path.write_text(
        '[[entry]]\nname="gone"\ntunix="0.0.1"\nflavour="current"\nconvention="bound2"\n'
        'default=true\nbroken="yanked"\n'
        '[[entry]]\nname="tunix-main"\ntunix="main"\nflavour="source"\n'
        'convention="bound3_update"\nsource="https://github.com/google/tunix@main"\n'
    )
    status = cli.main(
        [
            "matrix",
            "--entries",
            str(path),
            "--report-dir",
            str(tmp_path / "r"),
            "--cache",
            str(tmp_path / "envs"),
            "--index-url",
            "off",
            "--tunix-source",
            "https://127.0.0.1:9/google/tunix@main",
        ]
    )
    out, err = capsys.readouterr()
    assert status == 1
    assert "[2/2] tunix-main: source 'https://127.0.0.1:9/google/tunix@main' cannot be" in err
    assert (
        "| tunix-main 💥 |" in out
        and "Tunix from the git URL https://127.0.0.1:9/google/tunix@main: not run (source" in out
    )
    # a malformed spec is bad input: exit 2 before anything runs
    status = cli.main(["matrix", "--entries", str(path), "--tunix-source", "https://h/x@"])
    assert status == 2 and "empty ref after '@'" in capsys.readouterr().err


def test_source_entries_are_checked_and_relative_paths_are_the_files(tmp_path):
    path = tmp_path / "entries.toml"
    path.write_text(
        '[[entry]]\nname="m"\ntunix="main"\nflavour="source"\nconvention="bound3_update"\n'
        'source="checkouts/tunix"\n'
    )
    (loaded,) = entries.load_entries(path)
    assert loaded.source == str(tmp_path / "checkouts" / "tunix")
    with pytest.raises(ValueError, match="is not resolved"):
        loaded.install_spec()
    for bad, message in (
        (
            'flavour="current"\nsource="https://h/t"',
            "flavour 'current' with source = 'https://h/t'",
        ),
        ('flavour="source"', "flavour 'source' with source = None"),
        ('flavour="source"\nsource=3', "source = 3; expected a git URL or a directory"),
        ('flavour="source"\nsource="https://h/t"\nresolved=["a"]', "unknown field(s) ['resolved']"),
        ('flavour="source"\nsource=""', "source = ''; expected a git URL or a directory"),
    ):
        path.write_text(f'[[entry]]\nname="m"\ntunix="main"\nconvention="bound2"\n{bad}\n')
        with pytest.raises(ValueError, match=re.escape(message)):
            entries.load_entries(path)


def test_tunix_source_adds_a_row_when_the_file_has_none():
    loaded = [entries.Entry(name="r", tunix="0.1.7", flavour="current", convention="bound2")]
    every, row = entries.with_source(loaded, "/x/tunix")
    assert [e.name for e in every] == ["r", "tunix-source"]
    assert row.source == "/x/tunix" and row.convention == entries.CONVENTIONS[-1]


@pytest.mark.slow  # two environment builds: seconds with a warm uv cache, minutes without
@pytest.mark.skipif(shutil.which("uv") is None, reason="the environment build uses uv here")
def test_a_source_entry_builds_its_environment_from_the_tree_and_rebuilds_when_it_moves(
    tmp_path,
):
    """A real environment from a local directory: it imports the tree's code; an edit
    makes a new key, and the new environment has the edit (no stale cached build)."""
    root = fake_tunix(tmp_path / "t")
    entry = entries.Entry(
        name="src",
        tunix="main",
        flavour="source",
        convention="bound3_update",
        source=str(root),
        # only Tunix: the checkout's [train] extra would install the whole stack
        requirements=None,
    )
    cache = envs.EnvCache(tmp_path / "envs")

    def build(e):
        resolved = matrix.resolve(e)
        # Tunix alone (no editable checkout): what is under test is the source install.
        lean = dataclasses.replace(resolved, requirements=(resolved.resolved[1],))
        env = cache.ensure(lean)
        assert env.error is None, env.error
        marker = subprocess.run(
            [
                str(env.python),
                "-c",
                "import tunix, importlib.metadata as m; "
                "print(tunix.MARKER, m.version('google-tunix'))",
            ],
            capture_output=True,
            text=True,
        )
        return env, marker.stdout.split()

    first, seen = build(entry)
    assert seen == ["first", "0.1.99"]
    fake_tunix(root, marker="second")
    second, seen = build(entry)
    assert second.path != first.path and seen == ["second", "0.1.99"]


DEPRECATING_TESTS = textwrap.dedent(
    """
    import warnings

    import pytest

    import fakeupstream

    @pytest.mark.contract("fakeupstream.old_api")
    def test_upstream():
        assert fakeupstream.old_api() == 1

    @pytest.mark.contract("fakeupstream.old_api")
    def test_upstream_again():
        assert fakeupstream.old_api() == 1

    @pytest.mark.contract("ours")
    def test_ours():
        code = "import warnings\\nwarnings.warn('our own deprecated call', DeprecationWarning)"
        exec(compile(code, "/src/posttrain/mod.py", "exec"), {"__name__": "posttrain.mod"})

    @pytest.mark.contract("clean")
    def test_clean():
        pass
    """
)


def _deprecating_project(root):
    (root / "fakeupstream").mkdir()
    (root / "fakeupstream" / "__init__.py").write_text(
        "import warnings\n"
        "def old_api():\n"
        "    warnings.warn('old_api is deprecated; use new_api', DeprecationWarning)\n"
        "    return 1\n"
    )
    (root / "test_dep.py").write_text(DEPRECATING_TESTS)
    (root / "pyproject.toml").write_text(
        "[tool.pytest.ini_options]\nfilterwarnings = [\n  'error',\n"
        # a named ignore of the upstream one, as the project has: the matrix still sees it
        "  'ignore:old_api is deprecated:DeprecationWarning:fakeupstream',\n]\n"
    )


def _check_deprecation_cells(run, root):
    """The upstream-attributed DeprecationWarning makes a warn cell with its text and
    origin, the posttrain-attributed one fails; without the option (the gate's mode)
    the named ignore hides the upstream one and ours still fails."""
    cells = run("--upstream-deprecations", "record")
    warned = cells["fakeupstream.old_api"]
    assert warned["status"] == "warned", cells
    where = root / "fakeupstream" / "__init__.py"
    assert warned["warnings"] == [
        f"DeprecationWarning: old_api is deprecated; use new_api ({where}:3)"
    ]
    assert warned["message"] == warned["warnings"][0]
    assert cells["ours"]["status"] == "failed"
    assert "our own deprecated call" in cells["ours"]["message"]
    assert cells["ours"]["test"] == "test_dep.py::test_ours"
    assert cells["clean"] == {"status": "passed", "message": ""}
    plain = run()  # the gate's mode: filterwarnings decides (here: the named ignore)
    assert plain["fakeupstream.old_api"] == {"status": "passed", "message": ""}
    assert plain["ours"]["status"] == "failed"


def test_an_upstream_deprecation_is_a_warn_cell_and_our_own_a_failure(
    jax_started, pytester: pytest.Pytester
):
    """Through a real pytest session (in this process): see _check_deprecation_cells."""
    _deprecating_project(pytester.path)
    pytester.syspathinsert()

    def run(*extra):
        junit = pytester.path / f"j{len(extra)}.xml"
        pytester.runpytest("-p", "no:cacheprovider", f"--junitxml={junit}", *extra)
        return matrix.junit_cells(junit, pytester.path)

    _check_deprecation_cells(run, pytester.path)


@pytest.mark.slow  # two interpreters importing JAX: 4 s of the gate's time
def test_deprecation_properties_travel_with_xdist_workers(tmp_path):
    """As the matrix runs pytest (a subprocess, 2 xdist workers): the properties travel
    with the workers' reports."""
    _deprecating_project(tmp_path)

    def run(*extra):
        junit = tmp_path / f"j{len(extra)}.xml"
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2"]
        command += [f"--junitxml={junit}", "--rootdir", str(tmp_path), *extra]
        subprocess.run(command, cwd=tmp_path, capture_output=True, env=_env(tmp_path))
        return matrix.junit_cells(junit, tmp_path)

    _check_deprecation_cells(run, tmp_path)


def _env(root):
    import os

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), *sys.path])}
    env.pop("PYTEST_XDIST_WORKER", None)
    return env


def test_an_emulation_over_a_base_of_another_era_is_n_a(monkeypatch, tmp_path):
    """Over a base whose PeftTrainer already has main's accumulator path, the older
    conventions' emulations are skipped with the reason (the report's n/a), and the
    emulated row's SFT run exits NOT_APPLICABLE before training anything."""
    pytest.importorskip("tunix.sft.peft_trainer")
    from contracts import tunix_emulation as te

    main_like = tunix_compat.Convention(
        "bound3_update", ("model", "optimizer", "grad_accumulator"), ("x",), ("is_update_step",), 3
    )
    monkeypatch.setattr(tunix_compat, "detect", lambda trainer_cls=None: main_like)
    params = te.by_convention({"installed": None, **te.EMULATED})
    skips = {p.values[0]: [m for m in p.marks if m.name == "skip"] for p in params}
    assert skips["installed"] == []
    for name in ("positional3", "bound2", "bound3_update"):
        (mark,) = skips[name]
        assert mark.kwargs["reason"].startswith(f"n/a: the {name} emulation subclasses")
        assert "bound3_update" in mark.kwargs["reason"]
    with pytest.raises(SystemExit) as stopped:
        run_cells.emulated_sft("bound2", str(tmp_path / "out"))
    assert stopped.value.code == run_cells.NOT_APPLICABLE
    assert not (tmp_path / "out").exists()
    # over its own era (the installed 0.1.7 here): applicable
    monkeypatch.undo()
    assert te.not_applicable("bound2") is None


def test_the_emulated_sft_cell_is_n_a_with_the_reason():
    """run_cells.sft_cell maps NOT_APPLICABLE to a skipped (n/a) cell carrying the reason."""
    entry = entries.Entry(
        name="m", tunix="main", flavour="emulated", convention="bound2", emulated=True, base="r"
    )
    why = "n/a: the bound2 emulation subclasses the installed PeftTrainer"

    def fake(command, env=None):
        return subprocess.CompletedProcess(command, 3, f"posttrain: error: {why}\n", "")

    env = envs.EnvResult(Path("/nonexistent"), False, 0.0)
    assert run_cells.sft_cell(entry, env, {}, fake) == {"status": "skipped", "message": why}


def test_an_emulation_cannot_stand_on_a_source_entry(tmp_path):
    path = tmp_path / "entries.toml"
    path.write_text(
        '[[entry]]\nname="s"\ntunix="main"\nflavour="source"\nconvention="bound3_update"\n'
        'source="https://h/t"\n'
        '[[entry]]\nname="e"\ntunix="main"\nflavour="emulated"\nconvention="bound2"\n'
        'emulated=true\nbase="s"\n'
    )
    with pytest.raises(ValueError, match="base 's' is a source entry; expected a release"):
        entries.load_entries(path)


def test_only_files_of_this_checkout_outside_environments_count_as_ours():
    """The second line of defence in deprecations: a path naming a package of ours
    inside an environment (a checkout called posttrain, its env cache inside it) is
    upstream."""
    import warnings

    from harness.gate import deprecations

    def message(path):
        return warnings.WarningMessage("m", DeprecationWarning, str(path), 1)

    repo = deprecations.REPO
    assert deprecations._ours(message(repo / "src" / "posttrain" / "sharding.py"))
    env = repo / ".cache" / "envs" / "e" / "lib" / "python3.11" / "site-packages"
    assert not deprecations._ours(message(env / "jax" / "_src" / "x.py"))
    assert not deprecations._ours(message("/home/runner/work/posttrain/tests/x.py"))
    assert not deprecations._ours(message("<string>"))
