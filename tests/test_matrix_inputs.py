"""Bad input to the matrix and its report merge: one line, exit 2, nothing written; and
the credentials of a source URL never shown or stored."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness import cli
from harness.matrix import matrix, sources
from harness.report import files, report

pytestmark = pytest.mark.host

SECRET = "s3cr3t-t0ken"
URL = f"https://user:{SECRET}@git.example.com/google/tunix@main"


def _row(name: str = "e1") -> dict:
    return {
        "name": name,
        "tunix": "0.1.7",
        "flavour": "current",
        "convention": "bound2",
        "emulated": False,
        "contracts": {"c": {"status": "passed", "message": ""}},
        "sft": {"status": "passed", "message": "4 steps"},
    }


def _report(**change) -> dict:
    built = {"generated": "g", "machine": "m", "columns": ["c", "sft"], "entries": [_row()]}
    return {**built, **change}


BAD_PARTS = [
    ([1, 2], "list; expected a JSON object"),
    (_report(entries={"e1": {}}), "entries = {'e1': {}}; expected a list"),
    (_report(entries=["e1"]), "entry 0 is 'e1'; expected an object"),
    (_report(entries=[{**_row(), "contracts": []}]), "entry 0 (e1): contracts = []"),
    (
        _report(entries=[{**_row(), "contracts": {"c": {"status": 3}}}]),
        "entry 0 (e1): contracts['c'] status 3; expected one of passed, warned",
    ),
    (_report(entries=[{**_row(), "contracts": {"c": "passed"}}]), "contracts['c'] 'passed'"),
    (_report(entries=[{**_row(), "sft": "passed"}]), "entry 0 (e1): sft 'passed'"),
    (_report(entries=[{**_row(), "name": 5}]), "entry 0: name = 5; expected a string"),
    (_report(machine=3), "machine = 3; expected a string"),
    (_report(columns="c"), "columns = 'c'; expected a list of strings"),
    (
        _report(entries=[{**_row(), "contracts": {"c": {"status": "passed", "message": 1}}}]),
        "message 1; expected a string",
    ),
    # what the renderers read besides the cells (#56: an internal error each before)
    (_report(entries=[{**_row(), "versions": [1]}]), "entry 0 (e1): versions = [1]; expected"),
    (_report(entries=[{**_row(), "source": URL}]), "entry 0 (e1): source = 'https://***@"),
    (
        _report(entries=[{**_row(), "source": {"spec": 1, "resolved": None}}]),
        "entry 0 (e1): source = {'spec': 1, 'resolved': None}; expected",
    ),
    (_report(entries=[{**_row(), "error": ["x"]}]), "entry 0 (e1): error = ['x']; expected"),
    ('{"entries": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
]


@pytest.mark.parametrize(("part", "words"), BAD_PARTS, ids=[w[:30] for _, w in BAD_PARTS])
def test_a_malformed_part_is_refused_in_one_line_and_nothing_is_written(
    tmp_path, capsys, part, words
):
    """Each wrong type a merge or renderer would trip on is named, with the file."""
    where = tmp_path / "part"
    where.mkdir()
    text = part if isinstance(part, str) else json.dumps(part)  # a str: the file's text
    (where / "compat-matrix.json").write_text(text)
    out = tmp_path / "merged"
    assert cli.main(["report", "merge", str(where), "--report-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a matrix report" in err[0] and words in err[0], err
    assert SECRET not in err[0]
    assert str(where / "compat-matrix.json") in err[0]
    assert not out.exists()


def test_a_well_formed_report_passes_the_shape_check():
    assert report.check_shape(_report()) is None
    assert report.check_shape(report.build([_row()], "m")) is None


@pytest.mark.parametrize(
    ("part", "problem"),
    [
        ({"entries": [], "columns": []}, "'generated', 'machine'"),
        (_report(entries=[{"name": "e1"}]), "entry 0 has no flavour, convention, contracts"),
        (
            _report(entries=[{**_row(), "versions": {"tunix": 7}}]),
            "entry 0 (e1): versions = {'tunix': 7}; expected an object of name: version strings",
        ),
        (
            _report(entries=[{**_row(), "versions": {7: "0.1"}}]),
            "entry 0 (e1): versions = {7: '0.1'}; expected an object of name: version strings",
        ),
    ],
)
def test_the_shape_check_names_what_is_missing_or_mistyped_in_full(part, problem):
    """The missing keys of the report and of an entry, and a version that is not a
    string on either side, each named in full."""
    assert report.check_shape(part) == problem


def test_a_part_without_entries_is_refused(tmp_path, capsys):
    where = tmp_path / "part"
    files.write(report.build([], "m"), where)
    out = tmp_path / "merged"
    assert cli.main(["report", "merge", str(where), "--report-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"posttrain-harness report merge: {where}: its report holds no entries; nothing to merge"
    ]
    assert not out.exists()


@pytest.mark.parametrize("kind", ["missing", "file", "no-package"])
def test_a_local_tunix_source_that_is_not_a_package_is_refused_before_anything_runs(
    tmp_path, capsys, kind
):
    """--tunix-source DIR is checked before any row runs: one line, exit 2, and no
    report (it once replaced the committed one after an error row)."""
    source = tmp_path / "tunix"
    if kind == "file":
        source.write_text("")
    elif kind == "no-package":
        source.mkdir()
    out = tmp_path / "reports"
    argv = [
        "matrix",
        "--tunix-source",
        str(source),
        "--report-dir",
        str(out),
        "--only",
        "tunix-main",
    ]
    assert cli.main([*argv, "--index-url", "off"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"source {str(source)!r}" in err[0], err
    assert ("has no pyproject.toml" if kind == "no-package" else "is not a directory") in err[0]
    assert not out.exists()


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        (URL, "https://***@git.example.com/google/tunix@main"),
        ("git+https://ghp_abc@github.com/x/y@v1", "git+https://***@github.com/x/y@v1"),
        ("git@github.com:google/tunix@main", "git@github.com:google/tunix@main"),
        (f"source '{URL}' cannot be reached", "source 'https://***@git.example.com/google/"),
        ("https://github.com/google/tunix@main", "https://github.com/google/tunix@main"),
    ],
)
def test_redact_hides_the_user_info_of_urls_only(text, shown):
    assert shown in sources.redact(text) and SECRET not in sources.redact(text)


@pytest.mark.parametrize(
    "password",
    ["p@ss@" + SECRET, "a:b:" + SECRET, "p%40ss%3A" + SECRET, SECRET + "@x:y%25z"],
    ids=["at-signs", "colons", "percent-escapes", "all-three"],
)
def test_redact_hides_a_password_holding_at_signs_colons_and_escapes(password):
    """The whole user-info goes (up to the last ``@`` of the authority, as the URL parser
    reads it), in a URL alone, quoted in a message, and before a ``@ref``."""
    url = f"https://user:{password}@git.example.com/google/tunix"
    texts = (url, f"{url}@main", f"source '{url}@v1' cannot be reached", f"{url},{url}@v2")
    for text in texts:
        shown = sources.redact(text)
        assert SECRET not in shown and "user" not in shown, shown
        assert "https://***@git.example.com/google/tunix" in shown, shown


def test_a_source_url_with_credentials_is_never_shown_or_stored(tmp_path, capsys, monkeypatch):
    """--list (plain and JSON), the progress lines, the Markdown on stdout and all three
    report files name the source with its user-info redacted."""
    assert cli.main(["matrix", "--list", "--tunix-source", URL]) == 0
    assert cli.main(["matrix", "--list", "--json", "--tunix-source", URL]) == 0
    listed = capsys.readouterr().out
    assert "***@git.example.com" in listed and SECRET not in listed

    def unreachable(entry):
        raise sources.SourceError(f"source {entry.source!r} cannot be reached: no route")

    monkeypatch.setattr(matrix, "resolve", unreachable)
    out = tmp_path / "reports"
    argv = ["matrix", "--tunix-source", URL, "--only", "tunix-main", "--report-dir", str(out)]
    assert cli.main([*argv, "--index-url", "off"]) == 1  # the row could not run
    printed = capsys.readouterr()
    assert "cannot be reached" in printed.err and "***@git.example.com" in printed.err
    assert SECRET not in printed.out + printed.err
    files = sorted(Path(out).glob("compat-matrix.*"))
    assert [f.suffix for f in files] == [".html", ".json", ".md"]
    for path in files:
        text = path.read_text()
        assert "***@git.example.com" in text and SECRET not in text, path
