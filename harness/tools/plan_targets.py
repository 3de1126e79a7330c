"""Mutation targets of :mod:`posttrain.plan`'s modules: module -> the tests that exercise
it (pytest node ids, or a -k expression after "-k"). :data:`harness.tools.mutant_targets.TARGETS`
holds them among the library's."""

from __future__ import annotations

# tests/test_plan.py without its compiles (seconds, not a minute, per mutant): the logic
# modules' own tests are the table, roofline, verdict, options and depth-line ones
_NO_COMPILE = (
    "not small_lora and not record_carries and not abstract_lora and not dpo_compiles "
    "and not grpo_plan and not zeroed_lora_b and not old_policy"
)

PLAN_TARGETS: dict[str, list[str]] = {
    # the plan's logic and one real compile (libtpu: the tpu extra); not the seeds' (minutes)
    "src/posttrain/plan/topology.py": ["tests/test_plan.py", "-k", _NO_COMPILE],
    "src/posttrain/plan/report.py": [
        "tests/test_plan.py",
        "tests/test_plan_chip.py",
        "tests/test_plan_headroom.py",
        "-k",
        _NO_COMPILE,
    ],
    "src/posttrain/plan/measure.py": [
        "tests/test_plan_chip.py",
        "tests/test_plan_measure.py",
        "tests/test_plan_headroom.py",
        "tests/test_plan_profile.py",
    ],
    "src/posttrain/plan/profile.py": ["tests/test_plan_profile.py"],
    "src/posttrain/plan/headroom.py": ["tests/test_plan_headroom.py"],
    # --run-steps' chips: the backend, the count and the generation refused in one line each;
    # a chip's peak by its kind (a measured MFU's denominator)
    "src/posttrain/plan/chips.py": [
        "tests/test_plan_chip.py::test_run_steps_runs_only_on_the_topologys_own_chips",
        "tests/test_plan_chip.py::test_the_topologys_chips_come_back_in_id_order",
        "tests/test_plan_measure.py::test_a_one_chip_slice_runs_on_its_one_chip",
        "tests/test_plan_measure.py::test_the_first_chip_in_id_order_names_the_generation",
        "tests/test_plan_measure.py::test_a_chip_with_no_tpu_kind_is_refused_naming_none",
        "tests/test_plan_measure.py::test_a_chips_peak_is_the_tables_by_its_kind_and_other_devices_have_none",
    ],
    "src/posttrain/plan/options.py": ["tests/test_plan.py", "-k", _NO_COMPILE],
    # #55: the remat x batch search, against fake planners (and one real v5e search)
    "src/posttrain/plan/search.py": ["tests/test_plan_search.py", "-m", "host"],
    "src/posttrain/plan/depth.py": ["tests/test_plan.py", "-k", _NO_COMPILE],
    # #56 7: each bound at its edge, and the CLI's refusals (checked before any compile)
    "src/posttrain/plan/sizes.py": [
        "tests/test_plan_sizes.py",
        "tests/test_plan.py::test_cli_refuses_bad_input_with_one_line_before_compiling",
    ],
    "src/posttrain/plan/abstract.py": ["tests/test_plan.py"],
    "src/posttrain/plan/steps.py": ["tests/test_plan.py"],
    "src/posttrain/plan/compile.py": ["tests/test_plan.py"],
    "src/posttrain/plan/cli.py": ["tests/test_plan.py"],
    "src/posttrain/plan/workflows.py": ["tests/test_plan.py"],
}
