"""Mutation targets of the harness's own modules: module -> the tests that exercise it
(pytest node ids, or a -k expression after "-k"). :data:`harness.tools.mutant_targets.TARGETS`
holds them after the library's."""

from __future__ import annotations

# tests/test_docs_run.py without those that read this checkout's git or docs/
_OWN_PAGES = (
    "not every_docs_command and not quick_pages and not every_figure_names "
    "and not command_line_runs and not every_page_s_markers"
)

HARNESS_TARGETS: dict[str, list[str]] = {
    "harness/matrix/progress.py": ["tests/test_matrix_progress.py"],
    "harness/tools/op_profile.py": ["tests/test_op_profile.py"],
    "harness/tools/divergence.py": ["tests/test_divergence.py"],
    # #58: imports inside functions, each listed (the entry-point tests start interpreters)
    "harness/tools/local_imports.py": ["tests/test_local_imports.py", "-k", "not entry_point"],
    "harness/bisect/bisect.py": ["tests/test_bisect.py"],
    # runs only in child pytest sessions: mutmut records no test for it (scored "no tests")
    "harness/gate/deprecation_recorder.py": ["tests/test_verdicts.py"],
    "harness/matrix/run_cells.py": ["tests/test_matrix.py", "tests/test_matrix_sources.py"],
    # without the bisections that build environments (a minute per mutant)
    "harness/bisect/suggestions.py": ["tests/test_bisect.py", "-k", "suggests"],
    "harness/bisect/git_history.py": [
        "tests/test_bisect.py",
        "-k",
        "not real_bisection and not matrix_bisect_runs",
    ],
    # the gate's command, exit status and summary; the subcommands' bodies (#37's split)
    "harness/gate/gate.py": ["tests/test_verdicts.py", "tests/test_harness.py"],
    "harness/subcommands.py": [
        "tests/test_matrix_progress.py",
        "tests/test_bisect.py",
        "tests/test_harness.py",
    ],
    "harness/gate/chip_precision.py": ["tests/test_chip_precision.py"],
    # the suites' compilation cache: pruned before a run, JAX's own size limit off
    "harness/devices/compile_cache.py": ["tests/test_compile_cache.py"],
    # --compile-report: a line per test of JAX's trace, lower and compile figures
    "harness/gate/compile_report.py": ["tests/test_compile_report.py"],
    "harness/gate/sizes.py": ["tests/test_code_size.py"],
    # what a chip's tier leaves out: the wiring and chip_sample markers beside host
    "harness/gate/chip_tier.py": ["tests/test_chip_tier.py", "tests/test_harness.py"],
    # #58: the pytest plugin's options and marker descriptions, out of pytest_plugin.py
    "harness/gate/plugin_options.py": ["tests/test_harness.py", "tests/test_plugin_options.py"],
    "harness/gate/session_tuning.py": [
        "tests/test_harness.py",
        "tests/test_session_tuning.py",
        "-k",
        "profile or gc or session_tuning",
    ],
    # its own tests, without those that read the weekly workflow (not in mutmut's copy)
    "harness/tools/mutant_sources.py": [
        "tests/test_mutants.py",
        "-k",
        "undecorate or each_function_names or scratch_copy or patterns",
    ],
    "harness/report/shape.py": ["tests/test_matrix_inputs.py"],  # #56: a malformed part
    # #58: the report's files apart from the report (its renderings import it one way only)
    "harness/report/files.py": [
        "tests/test_matrix.py",
        "-k",
        "first_failing or rerun_rows or report_files",
    ],
    # the committed reports/ are not in the scratch copy: their test stays out
    "harness/report/fits.py": ["tests/test_fits.py", "-k", "not committed_rows"],
    # the docs run: the gate's tests that need neither the checkout's git nor docs/ (not
    # in mutmut's copy): the pages' reading, the figures, a repository of their own
    "harness/tools/docs_run.py": ["tests/test_docs_run.py", "-k", _OWN_PAGES],
    "harness/tools/docs_figures.py": ["tests/test_docs_run.py", "-k", _OWN_PAGES],
    "harness/tools/figure_checks.py": ["tests/test_docs_run.py", "-k", _OWN_PAGES],
    "harness/matrix/distill_cell.py": ["tests/test_matrix.py", "-k", "distill"],
    "harness/matrix/vision_cell.py": ["tests/test_matrix.py", "-k", "vision"],  # #39
}
