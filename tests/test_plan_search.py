"""``posttrain plan --search`` (:mod:`posttrain.plan.search`): the candidates in order, a
policy's search stopped at its first batch that does not fit, the fastest by rows per
second, one real search compiled for a v5e, and its refusals."""

from __future__ import annotations

import dataclasses
import types

import pytest

from posttrain.plan import search
from posttrain.plan.compile import DoesNotFit
from posttrain.plan.options import PlanOptions

BASE = PlanOptions(model="qwen3-tiny", topology="v5e-1", seq=16)


def _fake_plan(
    fits_up_to: dict[str, int], seconds, refuse: set = frozenset(), seen=None, moved=None
):
    """A planner whose policy ``remat`` fits up to ``fits_up_to[remat]`` rows a device,
    with the step taking ``seconds(remat, batch)`` and accessing ``moved(remat, batch)``
    bytes (default none); (remat, batch) in ``refuse``: the compiler refuses it."""

    def plan_fn(options):
        key = (options.remat, options.per_device_batch_size)
        if seen is not None:
            seen.append(key)
        if key in refuse:
            raise DoesNotFit(f"compiler: {key} out of memory")
        fits = options.per_device_batch_size <= fits_up_to[options.remat]
        verdict = types.SimpleNamespace(
            fits=fits, estimate_seconds=seconds(*key), mfu=0.1 * options.per_device_batch_size
        )
        accessed = moved(*key) if moved is not None else 0.0
        figures = types.SimpleNamespace(
            peak=options.per_device_batch_size * 2**30, bytes_accessed=accessed
        )
        return types.SimpleNamespace(verdict=verdict, figures=figures)

    return plan_fn


@pytest.mark.host
def test_each_policy_doubles_its_batch_to_the_limit_in_order():
    options = dataclasses.replace(BASE, search=True, search_max_batch=5, remat="full", run_steps=3)
    got = [(c.remat, c.per_device_batch_size) for c in search.candidates(options)]
    assert got == [(r, b) for r in ("none", "save_dots", "full") for b in (1, 2, 4)]
    # each candidate is one plain plan: it does not search again, and runs steps (on the
    # chips, where it also compiles) only when the search does
    assert all(c.search is False and c.run_steps == 3 for c in search.candidates(options))
    plain = dataclasses.replace(options, run_steps=0)
    assert all(c.run_steps == 0 for c in search.candidates(plain))
    # and keeps what the search does not vary (#55: --attention-kernel splash)
    splash = dataclasses.replace(options, attention_kernel="splash")
    assert {c.attention_kernel for c in search.candidates(splash)} == {"splash"}


@pytest.mark.host
def test_a_policy_stops_at_its_first_batch_that_does_not_fit():
    seen = []
    plan_fn = _fake_plan(
        {"none": 2, "save_dots": 8, "full": 64},
        lambda remat, batch: batch * 0.01,
        refuse={("save_dots", 4)},
        seen=seen,
    )
    found = search.search(dataclasses.replace(BASE, search_max_batch=8), plan_fn)
    assert seen == [
        ("none", 1),
        ("none", 2),
        ("none", 4),
        ("save_dots", 1),
        ("save_dots", 2),
        ("save_dots", 4),
        ("full", 1),
        ("full", 2),
        ("full", 4),
        ("full", 8),
    ]
    refused = [c for c in found if not c.fits]
    assert [(c.remat, c.per_device_batch_size) for c in refused] == [("none", 4), ("save_dots", 4)]
    assert "out of memory" in refused[1].refusal and refused[1].peak_bytes == 0
    assert refused[0].refusal == "peak 4.00 GiB" and refused[0].rows_per_second == 0.0


@pytest.mark.host
def test_the_fastest_has_the_most_rows_a_second_and_a_tie_the_smaller_peak():
    # none: 200 rows/s at any batch; full: 222/s; save_dots: 250/s at every batch 1-8,
    # a tie that the smallest peak (batch 1) wins
    times = {"none": 0.005, "save_dots": 0.004, "full": 0.0045}
    plan_fn = _fake_plan({"none": 2, "save_dots": 8, "full": 4}, lambda r, b: times[r] * b)
    found = search.search(dataclasses.replace(BASE, search_max_batch=8), plan_fn)
    best = search.fastest(found)
    assert (best.remat, best.per_device_batch_size) == ("save_dots", 1)  # 250/s, 1 GiB
    assert best.rows_per_second == pytest.approx(250.0)
    assert "--remat save_dots --per-device-batch-size 1" in search.advice(found)
    assert sum(line.startswith("*") for line in search.table(found, 16).splitlines()) == 1


@pytest.mark.host
def test_rows_count_every_data_parallel_device_and_tokens_the_workflows_row():
    plan_fn = _fake_plan({"none": 1, "save_dots": 1, "full": 1}, lambda r, b: 0.5)
    options = dataclasses.replace(
        BASE, topology="v5e-8", mesh={"data": 2, "fsdp": 2, "tensor": 2}, search_max_batch=1
    )
    assert search.search(options, plan_fn)[0].rows_per_second == pytest.approx(4 / 0.5)
    assert search.data_parallel(dataclasses.replace(options, mesh=None)) == 8
    assert search.tokens_per_row(dataclasses.replace(BASE, workflow="dpo", new_tokens=4)) == 40
    assert search.tokens_per_row(dataclasses.replace(BASE, workflow="grpo", new_tokens=4)) == 20
    assert search.tokens_per_row(dataclasses.replace(BASE, workflow="generate", new_tokens=4)) == 4
    assert search.tokens_per_row(BASE) == 16


@pytest.mark.host
def test_nothing_fitting_has_no_fastest_and_says_what_to_try():
    plan_fn = _fake_plan({"none": 0, "save_dots": 0, "full": 0}, lambda r, b: 1.0)
    found = search.search(dataclasses.replace(BASE, search_max_batch=4), plan_fn)
    assert len(found) == 3 and search.fastest(found) is None and search.close_calls(found) == []
    assert search.advice(found).startswith("no searched setting fits")


@pytest.mark.host
@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"search": True, "batch": 8}, "search varies the per-device batch; batch=8"),
        ({"search": True, "search_max_batch": 0}, "search_max_batch=0 must be >= 1"),
    ],
)
def test_a_search_that_cannot_vary_the_batch_is_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(BASE, **changes).check()


# slow tier: three libtpu compiles (not in JAX's persistent cache: 11 s of CPU warm or
# cold); the gate holds the search to hand-made figures (the host tests above) and keeps
# one real plan compile (tests/test_plan.py's small LoRA SFT step)
@pytest.mark.slow
def test_a_real_search_compiles_each_policy_for_a_v5e_and_names_the_fastest(capsys):
    """One real search: qwen3-tiny, unscanned, 16 tokens, batch 1 under each policy, each
    compiled by libtpu for one v5e chip (the tpu extra)."""
    pytest.importorskip("libtpu", reason="the tpu extra (libtpu) compiles for a TPU")
    from posttrain.plan import cli

    options = dataclasses.replace(BASE, search=True, search_max_batch=1, scan_layers=False)
    assert cli.run(options) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line for line in out if line[2:].split()[:1] in (["none"], ["save_dots"], ["full"])]
    assert [r[2:].split()[0] for r in rows] == ["none", "save_dots", "full"]
    assert all(r.endswith("fits") for r in rows) and sum(r.startswith("*") for r in rows) == 1
    assert out[-1].startswith("fastest that fits: --remat ")


def _one_of_each(options):
    """none fits one row (0.5 s a row), its two rows do not (2 GiB); save_dots the compiler
    refuses with a 130-character line; full fits both (1 s a row)."""
    batch = options.per_device_batch_size
    if options.remat == "save_dots":
        raise DoesNotFit("x" * 120 + "0123456789")
    seconds = {"none": 0.5, "full": 1.0}[options.remat] * batch
    fits = options.remat == "full" or batch == 1
    verdict = types.SimpleNamespace(fits=fits, estimate_seconds=seconds, mfu=0.1 * batch)
    figures = types.SimpleNamespace(peak=batch * 2**30, bytes_accessed=1e9 * batch)
    return types.SimpleNamespace(verdict=verdict, figures=figures)


@pytest.mark.host
def test_each_candidate_holds_its_plans_figures_and_a_refusal_holds_none():
    found = search.search(dataclasses.replace(BASE, search_max_batch=2), _one_of_each)
    C = search.Candidate
    assert found == [
        C("none", 1, True, 2**30, 0.5, 2.0, 0.1, bytes_per_row=1e9),
        C("none", 2, False, 2 * 2**30, 0.0, 0.0, 0.2, "peak 2.00 GiB"),
        C("save_dots", 1, False, 0, 0.0, 0.0, 0.0, "x" * 120 + "0123456789"),
        C("full", 1, True, 2**30, 1.0, 1.0, 0.1, bytes_per_row=1e9),
        C("full", 2, True, 2 * 2**30, 2.0, 1.0, 0.2, bytes_per_row=1e9),
    ]


@pytest.mark.host
def test_the_table_gives_each_fitting_row_in_gib_ms_tokens_and_percent():
    """Row by row, in hand-computed units: 1 GiB, 500 ms, 2 rows/s x 16 tokens = 32 tokens
    a second, MFU 10%; a refusal's line its first 120 characters."""
    found = search.search(dataclasses.replace(BASE, search_max_batch=2), _one_of_each)
    header, *rows = search.table(found, 16).splitlines()
    assert header.split() == [
        *("remat", "batch/dev", "peak", "GiB", "step", "ms", "tokens/s", "MFU", "verdict")
    ]
    assert header.startswith("  remat ")  # the mark's column is blank
    at = header.index("verdict")  # the verdicts line up under the header's
    assert all(r.find("fits") == at or r.find("does not fit") == at for r in rows), rows
    assert rows[0].split() == ["*", "none", "1", "1.00", "500.0", "32", "10.0%", "fits"]
    assert rows[1].split() == ["none", "2", "does", "not", "fit", "(peak", "2.00", "GiB)"]
    assert rows[2].split() == ["save_dots", "1", "does", "not", "fit", f"({'x' * 120})"]
    assert rows[3].split() == ["full", "1", "1.00", "1000.0", "16", "10.0%", "fits"]
    assert rows[4].split() == ["full", "2", "2.00", "2000.0", "16", "20.0%", "fits"]
    many = [dataclasses.replace(found[0], rows_per_second=1000.0)]
    assert search.table(many, 16).splitlines()[1].split()[5] == "16,000"
    assert search.advice(found) == (
        "fastest that fits: --remat none --per-device-batch-size 1 "
        "(500.0 ms a step, MFU 10.0% estimated)"
    )


@pytest.mark.host
def test_a_fitting_plan_without_an_estimate_has_no_rate():
    """A verdict whose compiled costs were all zero (estimate 0 s) fits but has no rows a
    second (no division by zero); the fastest is one that has a rate."""
    times = {"none": 0.0, "save_dots": 0.5, "full": 1.0}
    plan_fn = _fake_plan({"none": 1, "save_dots": 1, "full": 1}, lambda r, b: times[r])
    found = search.search(dataclasses.replace(BASE, search_max_batch=1), plan_fn)
    assert [(c.fits, c.rows_per_second) for c in found] == [(True, 0.0), (True, 2.0), (True, 1.0)]
    assert search.fastest(found).remat == "save_dots"


@pytest.mark.host
def test_an_axis_the_mesh_leaves_out_holds_one_device():
    """``--mesh data=2,tensor=4``: no fsdp axis, so 2 devices hold different rows;
    ``--mesh tensor=8``: every device holds the same rows."""
    v5e8 = dataclasses.replace(BASE, topology="v5e-8")
    assert search.data_parallel(dataclasses.replace(v5e8, mesh={"data": 2, "tensor": 4})) == 2
    assert search.data_parallel(dataclasses.replace(v5e8, mesh={"tensor": 8})) == 1
    assert search.data_parallel(dataclasses.replace(v5e8, mesh={"fsdp": 4, "tensor": 2})) == 4


def _chip(seconds: dict, refuse: set = frozenset(), seen=None):
    """A chip's run of a candidate: ``seconds[(remat, batch)]`` a step; (remat, batch) in
    ``refuse``: out of memory."""

    def measure_fn(options):
        key = (options.remat, options.per_device_batch_size)
        if seen is not None:
            seen.append((*key, options.run_steps))
        if key in refuse:
            error = "RESOURCE_EXHAUSTED: " + "y" * 110 + "0123456789"  # 140 characters
            return types.SimpleNamespace(fits=False, step_seconds=0.0, error=error)
        return types.SimpleNamespace(fits=True, step_seconds=seconds[key], error="")

    return measure_fn


@pytest.mark.host
def test_with_run_steps_each_fitting_candidate_runs_and_the_chips_fastest_wins():
    """The estimate ranks none first (0.5 s a row); the chip runs full's two rows fastest
    (0.6 s a step, 3.33 rows/s). Every candidate the plan fits is run, with the search's
    steps, and nothing else; one the chip refuses does not fit and stops its policy."""
    plan_fn = _fake_plan({"none": 1, "save_dots": 4, "full": 4}, lambda r, b: 0.5 * b)
    chip = {("none", 1): 1.0, ("save_dots", 1): 0.9, ("full", 1): 0.32, ("full", 2): 0.6}
    seen = []
    measure_fn = _chip(chip, refuse={("save_dots", 2), ("full", 4)}, seen=seen)
    options = dataclasses.replace(BASE, search_max_batch=4, run_steps=3)
    found = search.search(options, plan_fn, measure_fn)
    assert seen == [
        ("none", 1, 3),
        ("save_dots", 1, 3),
        ("save_dots", 2, 3),
        ("full", 1, 3),
        ("full", 2, 3),
        ("full", 4, 3),
    ]
    by = {(c.remat, c.per_device_batch_size): c for c in found}
    assert ("none", 2) in by and by[("none", 2)].measured_seconds == 0.0  # the plan refused it
    assert ("save_dots", 4) not in by  # the chip refused 2: its policy stops there
    refused = by[("save_dots", 2)]
    assert refused.fits is False and refused.rows_per_second == 0.0
    assert refused.refusal == "the chip refused it: RESOURCE_EXHAUSTED: " + "y" * 100
    best = search.fastest(found)
    assert (best.remat, best.per_device_batch_size) == ("full", 2)
    assert best.rows_per_second == pytest.approx(2 / 0.6)
    assert best.measured_mfu == pytest.approx(0.2 * 1.0 / 0.6)  # the plan's MFU x est / chip
    assert search.advice(found) == (
        "fastest that fits, on the chip: --remat full --per-device-batch-size 2 "
        "(600.0 ms a step, MFU 33.3%)"
    )
    header, *rows = search.table(found, 16).splitlines()
    assert header.split()[-5:] == ["chip", "ms", "chip", "MFU", "verdict"]
    star = next(r for r in rows if r.startswith("*"))
    assert star.split() == [
        "*",
        "full",
        "2",
        "2.00",
        "1000.0",
        "53",
        "20.0%",
        "600.0",
        "33.3%",
        "fits",
    ]
    # measured: nothing left to tell apart (full at 1 row, 3.1 rows/s, is within 15%)
    assert by[("full", 1)].rows_per_second >= 0.85 * best.rows_per_second
    assert search.close_calls(found) == []
    # the verdicts line up under the header's, measured columns or blanks before them
    at = header.index("verdict")
    assert all(r.find("fits") == at or r.find("does not fit") == at for r in rows), rows
    for r in rows:  # a row that does not fit: its setting, then blanks up to the verdict
        if "does not fit" in r:
            assert len(r[:at].split()) == 2, r


@pytest.mark.host
def test_a_chips_rows_count_every_data_parallel_device():
    """``run_candidate`` on a slice of 4 data-parallel devices (v5e-4, every chip on
    fsdp): 2 rows each, 8 in all, over the chip's 0.5 s step."""
    options = dataclasses.replace(BASE, topology="v5e-4", per_device_batch_size=2, run_steps=2)
    planned = search.Candidate("full", 2, True, 2**30, 1.0, 8.0, 0.1)
    ran = search.run_candidate(planned, options, _chip({("full", 2): 0.5}))
    assert ran.rows_per_second == pytest.approx(16.0) and ran.measured_seconds == 0.5


@pytest.mark.host
def test_the_advice_names_the_candidates_the_estimate_cannot_tell_from_the_fastest():
    """Without the chip: full at 0.85 of none's rate is within the estimate's 15% (named),
    save_dots at 0.80 is not, and full's second row (0.9) is; with none within it, the
    advice says only the fastest."""
    times = {"none": 0.5, "save_dots": 0.625, "full": 0.5 / 0.85}
    plan_fn = _fake_plan(
        {"none": 1, "save_dots": 1, "full": 2},
        lambda r, b: times[r] * b if (r, b) != ("full", 2) else 2 * 0.5 / 0.9,
    )
    found = search.search(dataclasses.replace(BASE, search_max_batch=2), plan_fn)
    near = [(c.remat, c.per_device_batch_size) for c in search.close_calls(found)]
    assert near == [("full", 1), ("full", 2)]
    assert search.advice(found) == (
        "fastest that fits: --remat none --per-device-batch-size 1 (500.0 ms a step, MFU "
        "10.0% estimated); within the estimate's 15% of it: --remat full "
        "--per-device-batch-size 1; --remat full --per-device-batch-size 2 "
        "(--run-steps N on the slice's chips runs each and picks by their steps)"
    )
    # three are still named (full's two rows and save_dots' at 0.90), four are counted
    best = search.fastest(found)
    three = [
        dataclasses.replace(c, rows_per_second=0.9 * best.rows_per_second)
        if (c.remat, c.per_device_batch_size) == ("save_dots", 1)
        else c
        for c in found
    ]
    assert len(search.close_calls(three)) == 3
    assert "15% of it: --remat save_dots --per-device-batch-size 1; --remat full" in (
        search.advice(three)
    )
    alone = [c for c in found if c.remat != "full" and c.fits]
    assert search.close_calls(alone) == [] and search.advice(alone).endswith("estimated)")


@pytest.mark.host
def test_where_the_estimate_is_level_the_fewest_bytes_a_row_win_and_the_rest_are_counted():
    """Every candidate at 100 rows a second (compute-bound, as the v5e's estimate puts
    every such step of one length): the one accessing the fewest bytes a row wins (full
    at 8: 3 GB a row + 8 GB a step, 4 GB a row, against save_dots at 4's 4.25 and none's
    5); the eight others are within the estimate's error, counted in the advice and
    marked ``~`` in the table."""
    per_row = {"none": (5e9, 0.0), "save_dots": (4e9, 1e9), "full": (3e9, 8e9)}
    plan_fn = _fake_plan(
        {"none": 2, "save_dots": 4, "full": 8},
        lambda r, b: 0.01 * b,
        moved=lambda r, b: per_row[r][0] * b + per_row[r][1],
    )
    found = search.search(dataclasses.replace(BASE, search_max_batch=8), plan_fn)
    best = search.fastest(found)
    assert (best.remat, best.per_device_batch_size) == ("full", 8)
    assert best.bytes_per_row == pytest.approx(4e9)
    assert len(search.close_calls(found)) == 8
    assert search.advice(found) == (
        "fastest that fits: --remat full --per-device-batch-size 8 (80.0 ms a step, MFU "
        "80.0% estimated); 8 others are within the estimate's 15% of it (marked ~) "
        "(--run-steps N on the slice's chips runs each and picks by their steps)"
    )
    marks = [line[0] for line in search.table(found, 16).splitlines()[1:]]
    fitting = [c.fits for c in found]
    assert marks.count("*") == 1 and marks.count("~") == 8
    assert all(m == " " for m, fits in zip(marks, fitting, strict=True) if not fits)
