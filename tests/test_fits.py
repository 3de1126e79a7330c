"""The matrix report's "fits" section (:mod:`harness.fits`): the seed configurations'
rows from real plans, their shape, and how the report shows them. No compile here: the
rows are planned by ``python -m harness.fits`` (``tests/test_plan_seeds.py`` asserts the
same configurations' verdicts in the slow tier)."""

from __future__ import annotations

import json

import pytest

from harness import entries, fits, report, report_html, report_md
from posttrain.plan import topology

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
    assert "not run: `python -m harness.fits --only 'gpt-oss-20b rollout'`" in missing


def test_the_report_carries_the_section_in_markdown_and_html():
    rows = [fits.row_of(fits.seed("gpt-oss-20b lora sft"), _record(31.56))]
    built = report.build([], "m", fits=rows)
    md = report_md.markdown(built)
    assert "### Fits on TPU slices" in md and "| gpt-oss-20b lora sft | v5p-8 | fits |" in md
    assert "Fits on TPU slices" in report_html.page(built)
    assert "Fits on TPU slices" not in report_md.markdown(report.build([], "m"))


@pytest.mark.parametrize(
    "text, message",
    [
        ("{", "is not a fits file"),
        ('{"name": "x"}', "a dict; expected a list"),
        ('[{"verdict": "fits"}]', "row 0 is .*expected an object with a name"),
        ('[{"name": "x", "verdict": "maybe"}]', "row 0 \\(x\\) has verdict 'maybe'"),
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
    assert "unknown seed 'nope'; expected one of qwen3-30b-a3b lora sft" in capsys.readouterr().err
    assert not (tmp_path / fits.FITS_NAME).exists()


def test_each_seed_is_a_valid_plan():
    from posttrain.plan import PlanOptions

    for s in fits.SEEDS:
        PlanOptions(**s.options).check()
        assert s.expected in fits.VERDICTS
    assert len({s.name for s in fits.SEEDS}) == len(fits.SEEDS)
    json.dumps([s.options for s in fits.SEEDS])  # the rows' source is plain data
