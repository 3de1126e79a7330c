"""The matrix report's "fits" section (:mod:`harness.report.fits`): the seed configurations'
rows from real plans, their shape, and how the report shows them. No compile here: the
rows are planned by ``python -m harness.report.fits`` (``tests/test_plan_seeds.py`` asserts the
same configurations' verdicts in the slow tier)."""

from __future__ import annotations

import json
import platform
import time

import pytest

from harness.matrix import entries
from harness.report import fits, html, markdown, report
from posttrain.plan import topology
from tests.cli_help import help_text

pytestmark = pytest.mark.host

GIB = 1 << 30


def _record(peak_gib: float, fits_: bool = True, stages=None) -> dict:
    """A ``Plan.record()`` of the fields a row reads."""
    hbm = 95 * GIB
    peak = int(peak_gib * GIB)
    return {
        "what": "x sft",
        "fits": fits_,
        "headroom": hbm - peak,
        "stage": "",
        "floor_seconds": 0.5,
        "estimate_seconds": 0.7,
        "mfu": 0.4,
        "peak_bytes": peak,
        "compile_seconds": 100.0,
        "stages": stages or {"train step": {"peak_bytes": peak, "compile_seconds": 100.0}},
    }


def test_a_rows_peak_is_its_tightest_programs_and_its_compile_the_sum():
    grpo = fits.seed("qwen3-30b-a3b lora grpo")
    stages = {
        "rollout": {"peak_bytes": 30 * GIB, "compile_seconds": 10.0},
        "train step": {"peak_bytes": 20 * GIB, "compile_seconds": 5.0},
    }
    row = fits.row_of(grpo, _record(30, stages=stages) | {"stage": "rollout"})
    assert row["peak_bytes"] == 30 * GIB and row["compile_seconds"] == 15.0
    assert row["verdict"] == "fits" and row["stage"] == "rollout"
    assert row["hbm_bytes"] == topology.get("v5p-32").hbm_bytes
    refused = fits.row_of(fits.seed("llama3.1-70b sft remat none"), refused="llama ... (OOM)")
    assert refused["verdict"] == "refused" and refused["headroom"] is None


def test_the_section_shows_each_seed_once_marks_surprises_and_names_the_missing():
    rows = [
        fits.row_of(fits.seed("qwen3-30b-a3b lora sft"), _record(13.07)),
        # a seed history says is refused, but planned to fit: marked
        fits.row_of(fits.seed("llama3.1-70b sft remat none"), _record(90.0)),
        fits.row_of(
            fits.seed("llama3.1-70b unsharded on one v5e"),
            refused="llama3-70b ... does not fit v5e-1: the compiler refused it (RESOURCE_"
            "EXHAUSTED: 570.96G of HBM); try --remat full",
        ),
    ]
    lines = fits.markdown_lines(rows)
    body = lines[2:]
    assert len(body) == len(fits.SEEDS)
    sft = next(line for line in body if line.startswith("| qwen3-30b-a3b lora sft |"))
    assert "| fits |" in sft and "13.07 GiB" in sft and "81.93 GiB" in sft
    none = next(line for line in body if line.startswith("| llama3.1-70b sft remat none |"))
    assert "fits ⚠ expected refused" in none
    v5e = next(line for line in body if "one v5e" in line)
    assert "refused (RESOURCE_EXHAUSTED: 570.96G of HBM); try --remat full)" in v5e
    missing = next(line for line in body if line.startswith("| gpt-oss-20b rollout |"))
    assert "not run: `python -m harness.report.fits --only 'gpt-oss-20b rollout'`" in missing


def test_the_report_carries_the_section_in_markdown_and_html():
    rows = [fits.row_of(fits.seed("gpt-oss-20b lora sft"), _record(31.56))]
    built = report.build([], "m", fits=rows)
    md = markdown.markdown(built)
    assert "### Fits on TPU slices" in md and "| gpt-oss-20b lora sft | v5p-8 | fits |" in md
    assert "Fits on TPU slices" in html.page(built)
    assert "Fits on TPU slices" not in markdown.markdown(report.build([], "m"))


@pytest.mark.parametrize(
    "text, message",
    [
        ("{", "is not a fits file"),
        ('{"name": "x"}', "a dict; expected a list"),
        ('[{"verdict": "fits"}]', "row 0 is .*expected an object with a name"),
        (
            '[{"name": "x", "verdict": "maybe"}]',
            "row 0 \\(x\\) has verdict 'maybe'; expected one of fits, does not fit, refused",
        ),
    ],
    ids=["json", "not-a-list", "no-name", "verdict"],
)
def test_a_malformed_fits_file_is_refused_in_one_line(tmp_path, text, message):
    (tmp_path / fits.FITS_NAME).write_text(text)
    with pytest.raises(ValueError, match=message):
        fits.load(tmp_path)
    assert fits.load(tmp_path / "absent") is None


def test_the_committed_rows_are_seeds_with_consistent_figures():
    """reports/plan-fits.json: every row a seed's, planned; headroom = HBM - peak, and the
    verdict agrees with its sign."""
    rows = fits.load(entries.REPO / "reports")
    assert rows, "reports/plan-fits.json has no rows"
    names = {s.name for s in fits.SEEDS}
    for r in rows:
        assert r["name"] in names
        assert r["hbm_bytes"] == topology.get(r["topology"]).hbm_bytes
        if r["verdict"] == "refused":
            assert "RESOURCE_EXHAUSTED" in r["line"]
            continue
        assert r["headroom"] == r["hbm_bytes"] - r["peak_bytes"]
        assert (r["verdict"] == "fits") == (r["headroom"] >= 0)
        assert 0 < r["mfu"] <= 1 and r["compile_seconds"] > 0


def test_unknown_seed_names_the_known_ones(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        fits.main(["--only", "nope", "--report-dir", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert (
        "unknown seed 'nope'; expected one of qwen3-30b-a3b lora sft, qwen3-30b-a3b lora grpo"
        in err
    )
    assert not (tmp_path / fits.FITS_NAME).exists()


def test_each_seed_is_a_valid_plan():
    from posttrain.plan import PlanOptions

    for s in fits.SEEDS:
        PlanOptions(**s.options).check()
        assert s.expected in fits.VERDICTS
    assert len({s.name for s in fits.SEEDS}) == len(fits.SEEDS)
    json.dumps([s.options for s in fits.SEEDS])  # the rows' source is plain data


# the row's fields, as the module docstring lists them
ROW_FIELDS = {
    "name",
    "what",
    "topology",
    "verdict",
    "expected",
    "peak_bytes",
    "hbm_bytes",
    "headroom",
    "stage",
    "compile_seconds",
    "floor_seconds",
    "estimate_seconds",
    "mfu",
    "line",
    "measured",
    "machine",
}
# a refusal as the plan words it (the compiler's line has parentheses of its own)
REFUSAL = (
    "llama3-70b sft full, 80 layers, mesh fsdp=64, batch 64 x 2048, remat none, bfloat16 "
    "params does not fit v5p-128: the compiler refused it (RESOURCE_EXHAUSTED: Ran out of "
    "memory on HBM, the total memory required for HLO temporaries (215.39G) exceeds "
    "available HBM (95.74G).); try --remat full"
)


def test_rows_carry_the_documented_fields_and_round_trip_through_load(tmp_path):
    """Every row (fits, does not fit, refused) has the fields the module documents, a
    verdict ``load`` accepts, and the UTC date; a file of them loads back unchanged."""
    sft = fits.seed("qwen3-30b-a3b lora sft")
    over = fits.row_of(sft, _record(120.0, fits_=False) | {"stage": "train step"})
    assert over["verdict"] == "does not fit" and over["headroom"] < 0
    fitted = fits.row_of(sft, _record(13.0))
    refused = fits.row_of(fits.seed("llama3.1-70b sft remat none"), refused=REFUSAL)
    for row in (over, fitted, refused):
        figures = {"peak_bytes", "stage", "compile_seconds", "floor_seconds", "estimate_seconds"}
        figures.add("mfu")
        assert ROW_FIELDS - figures <= set(row)  # a refusal has no figures
        assert set(row) <= ROW_FIELDS and row["verdict"] in fits.VERDICTS
        assert row["expected"] == fits.seed(row["name"]).expected
        assert row["measured"] == time.strftime("%Y-%m-%d", time.gmtime())
        assert row["machine"].startswith(platform.machine() + ", 3.")
    assert set(fitted) == ROW_FIELDS and fitted["line"] is None
    assert fitted["floor_seconds"] == 0.5 and fitted["mfu"] == 0.4 and fitted["what"] == "x sft"
    assert fitted["estimate_seconds"] == 0.7
    assert refused["line"] == REFUSAL and refused["what"] == ""
    rows = [fitted, over, refused]
    (tmp_path / fits.FITS_NAME).write_text(json.dumps(rows))
    assert fits.load(tmp_path) == rows


def test_a_refused_or_tight_row_shows_its_reason_and_figures():
    """The refusal shows the compiler's words (from its first parenthesis, 90 characters),
    a workflow its tightest program, and the figures in GiB and seconds ("-" for none)."""
    grpo = fits.seed("qwen3-30b-a3b lora grpo")
    stages = {"rollout": {"peak_bytes": 8 * GIB, "compile_seconds": 600.4}}
    stages["train step"] = {"peak_bytes": 16 * GIB, "compile_seconds": 1466.6}
    rows = [
        fits.row_of(grpo, _record(16, stages=stages) | {"stage": "train step"}),
        fits.row_of(fits.seed("llama3.1-70b sft remat none"), refused=REFUSAL),
    ]
    header, rule, *body = fits.markdown_lines(rows)
    assert header == (
        "| configuration | slice | verdict | peak per device | HBM | headroom | compile | "
        "measured |"
    )
    assert rule == "|---|---|---|---|---|---|---|---|"
    line = next(x for x in body if x.startswith("| qwen3-30b-a3b lora grpo |"))
    hbm = topology.get("v5p-32").hbm_bytes / GIB
    assert f"| fits (tightest: train step) | 16.00 GiB | {hbm:.2f} GiB |" in line
    assert "| 2067 s |" in line
    none = next(x for x in body if x.startswith("| llama3.1-70b sft remat none |"))
    words = "RESOURCE_EXHAUSTED: 215.39G of temporaries > 95.74G of HBM"
    date = time.strftime("%Y-%m-%d", time.gmtime())
    assert none.endswith(f"| refused ({words}) | - | {hbm:.2f} GiB | - | - | {date} |")


def _fake_run(verdicts: dict):
    """``fits.run`` without its compile: the row of a plan whose verdict is
    ``verdicts[name]`` (default: the seed's expected one)."""
    calls = []

    def run(s):
        calls.append(s.name)
        verdict = verdicts.get(s.name, s.expected)
        if verdict == "refused":
            return fits.row_of(s, refused=REFUSAL)
        return fits.row_of(
            s, _record(99.0 if verdict == "does not fit" else 10.0, verdict == "fits")
        )

    return run, calls


def test_main_plans_the_chosen_seeds_and_keeps_the_other_rows_in_seed_order(
    tmp_path, monkeypatch, capsys
):
    """``--only`` plans those seeds and keeps every other row of the file, written back
    in :data:`SEEDS` order (a row of no seed last); exit 0 when each verdict is the
    expected one, 1 when one is not."""
    kept = fits.row_of(fits.seed("gpt-oss-20b rollout"), _record(24.0))
    stale = {**kept, "name": "a renamed seed"}
    (tmp_path / fits.FITS_NAME).write_text(json.dumps([stale, kept]))
    run, calls = _fake_run({})
    monkeypatch.setattr(fits, "run", run)
    only = ["llama3.1-70b unsharded on one v5e", "qwen3-30b-a3b lora sft"]
    argv = [a for name in only for a in ("--only", name)] + ["--report-dir", str(tmp_path)]
    assert fits.main(argv) == 0
    assert calls == only
    assert capsys.readouterr().out.splitlines() == [
        "llama3.1-70b unsharded on one v5e: refused",
        "qwen3-30b-a3b lora sft: fits",
    ]
    text = (tmp_path / fits.FITS_NAME).read_text()
    assert text.endswith("]\n") and text.startswith('[\n  {\n    "name": ')
    rows = fits.load(tmp_path)
    assert [r["name"] for r in rows] == [only[1], "gpt-oss-20b rollout", only[0], stale["name"]]
    assert rows[1] == kept
    run, _ = _fake_run({"qwen3-30b-a3b lora sft": "does not fit"})
    monkeypatch.setattr(fits, "run", run)
    assert fits.main(argv) == 1
    assert fits.load(tmp_path)[0]["verdict"] == "does not fit"


def test_main_without_only_plans_every_seed_into_reports(tmp_path, monkeypatch, capsys):
    """No ``--only``: every seed, into ``reports/`` under the working directory (made); a
    ``--report-dir`` is made with its parents."""
    run, calls = _fake_run({})
    monkeypatch.setattr(fits, "run", run)
    monkeypatch.chdir(tmp_path)
    assert fits.main([]) == 0
    assert calls == [s.name for s in fits.SEEDS]
    assert [r["name"] for r in fits.load(tmp_path / "reports")] == calls
    assert fits.main(["--only", calls[0], "--report-dir", "weekly/fits"]) == 0
    assert [r["name"] for r in fits.load(tmp_path / "weekly" / "fits")] == calls[:1]
    out = help_text(fits.main, capsys)
    assert "usage: python -m harness.report.fits" in out and "a seed name (repeatable)" in out
    # the docstring's first line only
    assert 'The matrix report\'s "fits" section' in out and "Row (JSON object)" not in out
