"""The harness's own verdicts in combination (harness/gate/junit.py, matrix.junit_cells,
report.py, markdown.py, html.py): every combination of test outcomes and
upstream deprecations across a cell's tests, and the report's derived facts over random
grids, against oracles written from the documented rules (docs/matrix.md), not from the
code. A FAIL shown as warn is the worst bug the harness can have; these make it a test
failure."""

from __future__ import annotations

import itertools
import json
import re
from xml.sax.saxutils import quoteattr

import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness.gate import deprecations
from harness.matrix import matrix
from harness.report import html, markdown, report

pytestmark = pytest.mark.host

OUTCOMES = ("passed", "skipped", "failed", "error")
DEPRECATIONS = (
    "DeprecationWarning: old (tunix/sft/peft_trainer.py:212)",
    "FutureWarning: soon (flax/nnx/variables.py:9)",
)
TAG = {"skipped": "skipped", "failed": "failure", "error": "error"}


def verdict(tests: list[tuple[str, tuple[str, ...]]]) -> str:
    """The documented verdict of a cell (docs/matrix.md, "Cells"), spelled as a rule
    chain: an error anywhere is ERROR, else a failure anywhere is FAIL, else a skip is
    n/a, else a deprecation anywhere is warn, else pass."""
    outcomes = {outcome for outcome, _ in tests}
    if "error" in outcomes:
        return "error"
    if "failed" in outcomes:
        return "failed"
    if "skipped" in outcomes:
        return "skipped"
    if any(seen for _, seen in tests):
        return "warned"
    return "passed"


def _testcase(name: str, outcome: str, seen: tuple[str, ...], contract: str | None) -> str:
    props = []
    if contract:
        props.append(f'<property name="contract" value={quoteattr(contract)}/>')
    if seen:
        props.append(
            f'<property name="{deprecations.PROPERTY}" value={quoteattr(json.dumps(seen))}/>'
        )
    body = f"<properties>{''.join(props)}</properties>" if props else ""
    if outcome != "passed":
        body += f"<{TAG[outcome]} message={quoteattr(f'{name} {outcome}')}>tb</{TAG[outcome]}>"
    return f'<testcase classname="contracts.test_c" name={quoteattr(name)}>{body}</testcase>'


def _junit_file(tmp_path, cells: dict[str, list[tuple[str, tuple[str, ...]]]]):
    """A JUnit file whose tests group into ``cells``: even cells by a ``contract``
    property, odd ones by test function (parametrised ids)."""
    cases = []
    for k, (name, tests) in enumerate(cells.items()):
        for i, (outcome, seen) in enumerate(tests):
            if k % 2:
                cases.append(_testcase(f"{name}[{i}]", outcome, seen, None))
            else:
                cases.append(_testcase(f"test_{name}_{i}", outcome, seen, name))
    path = tmp_path / "junit.xml"
    path.write_text(f"<testsuites><testsuite>{''.join(cases)}</testsuite></testsuites>")
    return path


def expected_cell(name: str, k: int, tests) -> dict:
    status = verdict(tests)
    seen = list(dict.fromkeys(w for _, ws in tests for w in ws))
    if status in ("passed", "warned"):
        cell = {"status": status, "message": seen[0] if status == "warned" else ""}
    else:
        i = next(i for i, (outcome, _) in enumerate(tests) if outcome == status)
        test = f"{name}[{i}]" if k % 2 else f"test_{name}_{i}"
        cell = {
            "status": status,
            "message": f"{test} {status}",
            "test": f"contracts.test_c::{test}",
        }
    if seen:
        cell["warnings"] = seen
    return cell


TEST_STATES = [(o, seen) for o in OUTCOMES for seen in ((), (DEPRECATIONS[0],))]


def test_every_combination_of_outcomes_and_deprecations_gets_the_documented_verdict(tmp_path):
    """Exhaustive over cells of one to three tests, each passed / skipped / failed / error
    with or without a deprecation (584 cells in one JUnit file): the cell's status,
    message, test and warnings are the documented ones; the worst outcome always wins
    over warn; the rendered grid shows each cell's own status."""
    cells = {
        f"test_k{n}": list(tests)
        for n, tests in enumerate(
            t for size in (1, 2, 3) for t in itertools.product(TEST_STATES, repeat=size)
        )
    }
    got = matrix.junit_cells(_junit_file(tmp_path, cells), root=tmp_path)
    assert got == {n: expected_cell(n, k, t) for k, (n, t) in enumerate(cells.items())}
    for name, tests in cells.items():
        if any(o in ("failed", "error") for o, _ in tests):
            assert got[name]["status"] in report.BAD, (name, tests)
    built = report.build([_row("e", got)], "m")
    assert {(b["column"], b["status"]) for b in built["broken"]} == {
        (n, verdict(t)) for n, t in cells.items() if verdict(t) in report.BAD
    }
    _assert_rendered(built)


def _row(name: str, contracts: dict, flavour: str = "f", error: str | None = None) -> dict:
    row = {
        "name": name,
        "tunix": "0.1.7",
        "flavour": flavour,
        "convention": "bound2",
        "emulated": False,
        "env": {"built": False, "seconds": 0.0, "error": error},
        "versions": {},
        "contracts": contracts,
        "sft": None,
        "rl": None,
        "dpo": None,
        "seconds": 0.0,
    }
    if error:
        row["error"] = error
    return row


def _assert_rendered(built: dict) -> None:
    """Every cell of the Markdown grid and of the HTML grid shows its own status."""
    md = markdown.markdown(built)
    page = html.page(built)
    cols = built["columns"]
    html_rows = re.findall(r'<tr class="[^"]*" data-entry="([^"]*)">(.*?)</tr>', page)
    assert [name for name, _ in html_rows] == [r["name"] for r in built["entries"]]
    for row, (_, cells) in zip(built["entries"], html_rows, strict=True):
        want = [(c := report.cell(row, col)) and c["status"] for col in cols]
        line = next(x for x in md.splitlines() if re.match(rf"\| {row['name']}( 💥)? \|", x))
        glyphs = [g.strip().replace(markdown.FLIP_MARK, "") for g in line.split("|")[3:-1]]
        assert glyphs == [markdown.GLYPHS[s] for s in want], row["name"]
        shown = re.findall(r'data-status="([a-z]+)"', cells)
        assert shown == [s or "none" for s in want], row["name"]


NAMES = [f"e{i}" for i in range(5)]
COLUMNS = ["c0", "c1", "c2", "sft"]
STATUS_OR_NONE = st.sampled_from([*report.STATUSES, None])


@st.composite
def grids(draw, names=NAMES):
    """Rows over a subset of ``names`` (in order), two flavours, cells of every status or
    not run (``sft`` a run cell), some rows that could not run at all."""
    rows = []
    for name in names:
        if not draw(st.booleans()) and len(names) > 1:
            continue
        if draw(st.integers(0, 9)) == 0:
            rows.append(_row(name, {}, draw(st.sampled_from("ab")), error=f"{name} broke"))
            continue
        contracts, runs = {}, {}
        for column in COLUMNS:
            status = draw(STATUS_OR_NONE)
            if status is None:
                continue
            c = {"status": status, "message": f"{name}/{column} {status}"}
            (runs if column == "sft" else contracts)[column] = c
        row = _row(name, contracts, draw(st.sampled_from("ab")))
        row.update(runs)
        rows.append(row)
    return rows


def _status(row: dict, column: str) -> str | None:
    c = report.cell(row, column)
    return c["status"] if c else None


def _first_failure(history: list[str | None]) -> tuple[int, int | None] | None:
    """Index of the first FAIL / ERROR in ``history`` and of the last pass or warn before
    it (None: none before it); None when nothing fails."""
    for i, status in enumerate(history):
        if status in ("failed", "error"):
            before = [j for j in range(i) if history[j] in ("passed", "warned")]
            return i, (before[-1] if before else None)
    return None


def test_first_failing_entry_over_every_history_of_four_entries():
    """Exhaustive over the histories of one column across four entries (every status or
    not run in each: 1296 columns of one report): the first failing entry and the last
    passing (or warned) one before it, skips and absent cells passing over neither."""
    histories = list(itertools.product([*report.STATUSES, None], repeat=4))
    columns = [f"h{k}" for k in range(len(histories))]
    rows = [
        _row(
            name,
            {
                column: {"status": h[i], "message": f"{name} {h[i]}"}
                for column, h in zip(columns, histories, strict=True)
                if h[i] is not None
            },
        )
        for i, name in enumerate(NAMES[:4])
    ]
    found = {f["contract"]: f for f in report.first_failures(rows)}
    for column, history in zip(columns, histories, strict=True):
        first = _first_failure(list(history))
        if first is None:
            assert column not in found, history
            continue
        i, j = first
        assert found[column] == {
            "flavour": "f",
            "contract": column,
            "first_failing": NAMES[i],
            "after_passing": "" if j is None else NAMES[j],
            "error": f"{NAMES[i]} {history[i]}",
        }, history


@given(rows=grids())
def test_first_failures_and_what_broke_follow_their_definitions(rows):
    """First failing entry: per flavour and column, the first entry (in order) whose cell
    is FAIL or ERROR, and the last entry before it that passed or warned; what broke:
    every FAIL / ERROR cell and every row that could not run, nothing else; the exit
    status is 1 exactly then; the grids show each cell's status."""
    built = report.build(rows, "m")
    want = {}
    for flavour in "ab":
        group = [r for r in rows if r["flavour"] == flavour]
        for column in COLUMNS:
            states = [_status(r, column) for r in group]
            bad = [i for i, s in enumerate(states) if s in ("failed", "error")]
            if not bad:
                continue
            good = [i for i, s in enumerate(states[: bad[0]]) if s in ("passed", "warned")]
            first = group[bad[0]]
            want[(flavour, column)] = {
                "flavour": flavour,
                "contract": column,
                "first_failing": first["name"],
                "after_passing": group[good[-1]]["name"] if good else "",
                "error": report.cell(first, column)["message"],
            }
    assert {(f["flavour"], f["contract"]): f for f in built["first_failures"]} == want
    broke = {(r["name"], "", "error") for r in rows if r.get("error")}
    broke |= {
        (r["name"], c, s)
        for r in rows
        for c in COLUMNS
        if (s := _status(r, c)) in ("failed", "error")
    }
    assert {(b["entry"], b["column"], b["status"]) for b in built["broken"]} == broke
    assert len(built["broken"]) == len(broke)
    counts = report.totals(built)
    assert sum(counts.values()) == len(rows) * len(built["columns"])
    assert counts["failed"] + counts["error"] == len([b for b in broke if b[1]])
    _assert_rendered(built)
    # the exit status of a report: 1 exactly when something broke
    assert (1 if built["broken"] else 0) == (1 if broke else 0)


@given(before=grids(), after=grids())
def test_flips_are_exactly_the_cells_whose_status_changed(before, after):
    """Changed since the previous report: in an entry and a column both reports have,
    every cell whose status differs (not run counts as a status), and nothing else;
    a report compared with itself changes nothing."""
    previous = report.build(before, "m")
    now = report.build(after, "m", previous=previous)
    names = {r["name"] for r in before}
    want = {
        (r["name"], c, was, is_)
        for r in after
        if r["name"] in names
        for c in set(previous["columns"]) & set(now["columns"])
        for old in [next(b for b in before if b["name"] == r["name"])]
        if (was := _status(old, c) or "not run") != (is_ := _status(r, c) or "not run")
    }
    assert {(f["entry"], f["column"], f["from"], f["to"]) for f in now["changed"]} == want
    assert len(now["changed"]) == len(want)
    assert report.build(after, "m", previous=report.build(after, "m"))["changed"] == []
    flipped = re.findall(r'class="c s-[a-z]+ flip"', html.page(now))
    assert len(flipped) == len(want)


@given(parts=st.lists(grids(), min_size=1, max_size=4), order=st.permutations(NAMES[:4]))
def test_merging_parts_keeps_the_later_row_in_entry_order(parts, order):
    """report merge / --update: one row per entry, the one from the last part holding it;
    rows in the entries file's order, names it does not know last."""
    for k, rows in enumerate(parts):
        for r in rows:
            r["part"] = k
    merged = report.combine(parts, order)
    names = {r["name"] for rows in parts for r in rows}
    assert sorted(r["name"] for r in merged) == sorted(names)
    for r in merged:
        assert r["part"] == max(
            k for k, rows in enumerate(parts) for x in rows if x["name"] == r["name"]
        )
        assert r == next(x for x in parts[r["part"]] if x["name"] == r["name"])
    known = [n for n in order if n in names]
    assert [r["name"] for r in merged][: len(known)] == known


@given(
    outcomes=st.lists(st.sampled_from(OUTCOMES), max_size=12),
    pytest_code=st.sampled_from([0, 1, 2, 3, 4, 5]),
)
def test_the_gate_summary_counts_every_outcome_and_its_verdict_needs_a_run(outcomes, pytest_code):
    """The gate's own verdict: the summary counts each outcome of the JUnit file and
    names exactly the failed and errored tests, in order, in its last line too; the
    gate passes only when pytest passed and at least one test passed, failed or
    errored (all skipped, or none collected, is "ran no tests", exit 1); any other
    pytest status is the gate's."""
    import pathlib
    import tempfile

    from harness.gate import gate

    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "junit.xml"
        cases = [_testcase(f"test_{i}", o, (), None) for i, o in enumerate(outcomes)]
        path.write_text(f"<testsuites><testsuite>{''.join(cases)}</testsuite></testsuites>")
        summary = gate.summarize_junit(path, root=pathlib.Path(tmp))
    assert summary["counts"] == {
        **{o: outcomes.count(o) for o in OUTCOMES},
        "total": len(outcomes),
    }
    bad = [(f"contracts.test_c::test_{i}", o) for i, o in enumerate(outcomes) if o in report.BAD]
    assert [(f["id"], f["outcome"]) for f in summary["failures"]] == bad
    executed = sum(o != "skipped" for o in outcomes)
    status, _ = gate.gate_exit_status(pytest_code, executed)
    if pytest_code == 0 and executed:
        assert status == 0
    elif pytest_code in (0, 5):
        assert status == 1
    else:
        assert status == pytest_code
    summary.update(message="m", wall_time_s=1.0, junit=None)
    last = gate.format_summary(summary, pathlib.Path("s.json")).splitlines()[-1]
    assert last == (
        f"gate: {outcomes.count('passed')} passed, {len(bad)} failed, "
        f"{outcomes.count('skipped')} skipped"
    )
