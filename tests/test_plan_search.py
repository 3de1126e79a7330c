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


def _fake_plan(fits_up_to: dict[str, int], seconds, refuse: set = frozenset(), seen=None):
    """A planner whose policy ``remat`` fits up to ``fits_up_to[remat]`` rows a device,
    with the step taking ``seconds(remat, batch)``; (remat, batch) in ``refuse``: the
    compiler refuses it."""

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
        figures = types.SimpleNamespace(peak=options.per_device_batch_size * 2**30)
        return types.SimpleNamespace(verdict=verdict, figures=figures)

    return plan_fn


@pytest.mark.host
def test_each_policy_doubles_its_batch_to_the_limit_in_order():
    options = dataclasses.replace(BASE, search_max_batch=5, remat="full", run_steps=3)
    got = [(c.remat, c.per_device_batch_size) for c in search.candidates(options)]
    assert got == [(r, b) for r in ("none", "save_dots", "full") for b in (1, 2, 4)]
    assert all(not c.search and c.run_steps == 0 for c in search.candidates(options))


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
    assert len(found) == 3 and search.fastest(found) is None
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
