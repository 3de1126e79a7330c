"""Mutation testing of the numerics-critical modules with mutmut, one module at a time.

``python -m harness.mutants [MODULE ...] [--max-children N] [--report-dir DIR]
[--functions NAME,...]`` (what ``tox -e mutants`` runs): for each module (default: all of
:data:`TARGETS`) it copies the project into a scratch directory, writes a
``[tool.mutmut]`` section that mutates only that module (only the functions
``--functions`` or :data:`FUNCTIONS` names, where either names some) and runs only
its targeted test selection, runs ``mutmut run`` there, and collects
mutmut's own counts (``mutmut export-cicd-stats``). The report, ``mutants.json`` and
``mutants.md`` in the report directory, gives per module: killed, survived, timed out,
no tests, the score (killed / (killed + survived + timeout)), and the surviving mutants'
names (``mutmut show NAME`` in that module's scratch directory prints each diff).

Each selection is sized so one module's run fits in about 20 minutes on 2 cores; the
attention's 413 mutants run as two shards (``--functions``) in the weekly workflow.
Workers are forked from a fork server that has imported nothing (``forkserver_warmup =
none``): JAX is not fork-safe once its backend has started.

Jitted functions: :mod:`harness.mutant_sources` (how their mutants are reached).

Without mutmut (or what the copies' tests import) it stops before copying anything: one
line naming the first missing module and how to get it, exit 2
(:func:`missing_prerequisite`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence

from harness.mutant_sources import (  # noqa: F401 (TRANSFORMS: tools read it here)
    TRANSFORMS,
    function_names,
    mutant_patterns,
    undecorate,
)
from posttrain import atomic

# module -> the tests that exercise it (pytest node ids or -k expressions after "-k").
# tests/test_plan.py without its compiles (seconds, not a minute, per mutant): the logic
# modules' own tests are the table, roofline, verdict, options and depth-line ones
_NO_COMPILE = (
    "not small_lora and not record_carries and not abstract_lora and not dpo_compiles "
    "and not grpo_plan and not zeroed_lora_b and not old_policy"
)

TARGETS: dict[str, list[str]] = {
    "src/posttrain/layers/moe/router.py": [
        "tests/test_moe.py",
        "tests/test_bf16.py::test_router_picks_the_fp32_winner_when_bf16_rounding_would_tie",
    ],
    "src/posttrain/layers/moe/dispatch.py": ["tests/test_moe.py"],
    # test_bf16: the tiny MoE presets run the sorted experts in bfloat16
    "src/posttrain/layers/moe/experts.py": ["tests/test_moe.py", "tests/test_bf16.py"],
    # its backward is hand-written: test_moe's gradients against dense (float32, bfloat16)
    "src/posttrain/layers/moe/grouped.py": [
        "tests/test_moe_grouped.py",
        "tests/test_moe.py",
        "tests/test_bf16.py::test_experts_multiply_in_bf16_and_return_the_weighted_sum_in_float32",
    ],
    # the block against HF's MoE families (shared expert, router input, capacity), each
    # MoE field perturbed, the objective's weighted load-balancing loss
    "src/posttrain/layers/moe/block.py": [
        "tests/test_moe.py",
        "tests/test_sft_objective.py",
        "tests/test_bf16.py",
        "tests/test_models.py::test_each_documented_stage_scope_holds_its_work",
        "tests/test_conversion_parity.py::test_converted_logits_match_transformers",
        "tests/test_conversion_parity.py::test_config_variants_match_transformers",
        "tests/test_config_sensitivity.py",
    ],
    # the attention's values come from HF parity (every family, the config variants, each
    # quirk switched off), the field perturbations and the cached decode; test_models and
    # test_bf16 only for what parity cannot see (stage scopes, logical axes, sharding
    # constraints on a mesh, float32 islands and param dtypes): their scan, remat and MoE
    # tests compare the attention with itself
    "src/posttrain/layers/attention.py": [
        "tests/test_models.py::test_forward_shapes_and_tunix_convention",
        "tests/test_models.py::test_sharded_forward_equals_single_device",
        "tests/test_models.py::test_parameters_name_only_known_logical_axes",
        "tests/test_models.py::test_activations_name_only_known_logical_axes",
        "tests/test_models.py::test_attention_shards_its_heads_over_tensor_and_d_model_over_fsdp",
        "tests/test_models.py::test_a_mesh_check_mesh_accepts_shards_every_parameter",
        "tests/test_models.py::test_profiles_name_the_attention_and_moe_stages",
        "tests/test_models.py::test_each_documented_stage_scope_holds_its_work",
        "tests/test_bf16.py::test_bf16_model_agrees_with_its_fp32_twin",
        "tests/test_bf16.py::test_float32_islands_stay_float32_in_a_bf16_model",
        "tests/test_bf16.py::test_every_parameter_takes_the_param_dtype",
        "tests/test_bf16.py::test_attention_hands_its_dtypes_to_every_projection_and_keeps_its_float32_islands",
        "tests/test_conversion_parity.py::test_converted_logits_match_transformers",
        "tests/test_conversion_parity.py::test_config_variants_match_transformers",
        "tests/test_parity_fixtures.py",
        "tests/test_config_sensitivity.py",
        "tests/test_generate.py::test_incremental_decoding_equals_the_full_forward",
        "tests/test_attention_blocks.py",
        # the vision tower's attention: its 2-D RoPE's two sections
        "tests/test_vision.py::test_vision_logits_match_transformers",
    ],
    # the projections and gated MLP: values from HF parity (every family's activation,
    # biases, clipped vision linears), token_einsum's merge and its sharding guard
    "src/posttrain/layers/mlp.py": [
        "tests/test_attention_blocks.py",
        "tests/test_conversion_parity.py::test_converted_logits_match_transformers",
        "tests/test_bf16.py::test_bf16_model_agrees_with_its_fp32_twin",
        "tests/test_vision.py",
    ],
    # RoPE values against HF (the families of each RoPE kind, Llama 3's bands with
    # factors other than its published 1 / 4, YaRN's clamped and collapsed correction
    # ranges, Gemma 4's half rotary; HF's init functions over drawn parameters), each
    # RoPE field perturbed, the bfloat16 round trip
    "src/posttrain/layers/rope.py": [
        "tests/test_rope.py",
        "tests/test_conversion_parity.py::test_converted_logits_match_transformers",
        "tests/test_conversion_parity.py::test_config_variants_match_transformers",
        "tests/test_config_sensitivity.py",
        "tests/test_bf16.py::test_rope_rotates_in_float32_and_returns_the_activation_dtype",
        "-k",
        "llama3-hub or gpt_oss-hub or gemma4-hub or qwen3-hub or rope-bands or yarn or rotary "
        "or Rope or rope_rotates",
    ],
    # the tower's values come from HF parity with images (patches, 2-D RoPE, pooling,
    # padding, standardisation, projection, placement) and the placement/pixel properties
    "src/posttrain/layers/vision.py": [
        "tests/test_vision.py",
        "tests/test_vision_bidirectional.py",
        "tests/test_rope.py",
    ],
    # the tower's rows and config.json reader/writer: parity and the bit-exact round trip
    "src/posttrain/families/gemma4_vision.py": [
        "tests/test_vision.py",
        "tests/test_families.py",
        "tests/test_conversion_roundtrip.py",
    ],
    # images against transformers' own processor, the token expansion, the file errors
    "src/posttrain/sft/vision_data.py": ["tests/test_vision_data.py"],
    "src/posttrain/vision_config.py": [
        "tests/test_vision.py::test_vision_config_refuses_what_the_tower_cannot_run",
        "tests/test_vision.py::test_every_vision_field_is_perturbed_shaped_or_the_data_s",
        "tests/test_vision.py::test_perturbing_a_vision_field_moves_the_logits",
    ],
    "src/posttrain/sft/vision_default_data.py": ["tests/test_vision_data.py"],
    # #39: the rows' tests without the real run (a minute per surviving mutant)
    "src/posttrain/sft/vision_rows.py": ["tests/test_vision_sft.py", "-k", "not short_vision"],
    "src/posttrain/sft/vision_run.py": ["tests/test_vision_sft.py"],
    "src/posttrain/commands/generate_image.py": ["tests/test_vision_generate.py"],
    # check-logits' image batch: placement, padding and the two models' inputs (the HF
    # parity runs themselves are slow-tier, which mutation runs leave out)
    "src/posttrain/conversion/vision_parity.py": ["tests/test_vision_check_logits.py"],
    "src/posttrain/conversion/directories.py": ["tests/test_atomic_writes.py"],
    "src/posttrain/conversion/transforms.py": [
        "tests/test_conversion_roundtrip.py",
        "tests/test_conversion_errors.py",
        "tests/test_conversion_parity.py::test_square_expert_kernels_convert_by_value",
        "tests/test_conversion_parity.py::test_converted_logits_match_transformers",
    ],
    "src/posttrain/sft/loss.py": ["tests/test_sft_loss.py", "tests/test_sft_objective.py"],
    # the LoRA run: in full fine-tuning the frozen part of the step's split is empty, so
    # mutants of its filter and its copy passed the others; the NaN-weights save: the
    # check before saving
    "src/posttrain/sft/trainer.py": [
        "tests/test_sft_objective.py",
        "contracts/test_sft_conventions.py",
        "tests/test_sft_run.py::test_lora_run_checkpoints_only_the_adapters",
        "tests/test_sft_run.py::test_non_finite_weights_are_never_checkpointed",
    ],
    "src/posttrain/sft/metrics.py": ["tests/test_sft_run.py", "contracts/test_sft_conventions.py"],
    "src/posttrain/layers/kv_cache.py": ["tests/test_generate.py", "-k", "incremental or cache"],
    "src/posttrain/generate.py": ["tests/test_generate.py", "-k", "not cli"],
    "src/posttrain/lora/merge.py": ["tests/test_lora.py", "-k", "merge or zero_adapter"],
    "src/posttrain/lora/adapters.py": ["tests/test_lora.py", "tests/test_loaders.py"],
    "src/posttrain/rl/policy.py": ["tests/test_rl.py", "contracts/test_tunix_rl.py"],
    "src/posttrain/rl/rewards.py": ["tests/test_rl.py", "tests/test_reward_probe.py"],
    "harness/progress.py": ["tests/test_matrix_progress.py"],
    "harness/op_profile.py": ["tests/test_op_profile.py"],
    "harness/bisect.py": ["tests/test_bisect.py"],
    # runs only in child pytest sessions: mutmut records no test for it (scored "no tests")
    "harness/deprecation_recorder.py": ["tests/test_verdicts.py"],
    "harness/run_cells.py": ["tests/test_matrix.py", "tests/test_matrix_sources.py"],
    # without the bisections that build environments (a minute per mutant)
    "harness/bisect_suggestions.py": ["tests/test_bisect.py", "-k", "suggests"],
    "harness/git_history.py": [
        "tests/test_bisect.py",
        "-k",
        "not real_bisection and not matrix_bisect_runs",
    ],
    # the gate's command, exit status and summary; the subcommands' bodies (#37's split)
    "harness/gate.py": ["tests/test_verdicts.py", "tests/test_harness.py"],
    "harness/subcommands.py": [
        "tests/test_matrix_progress.py",
        "tests/test_bisect.py",
        "tests/test_harness.py",
    ],
    # the CLI generated from the options, and the checks every run shares
    "src/posttrain/flags.py": ["tests/test_cli_options.py", "tests/test_run_options.py"],
    "src/posttrain/runs/options.py": [
        "tests/test_run_options.py",
        "tests/test_model_option.py",
        "tests/test_sft_run.py::test_cli_bad_input_is_one_line_and_exit_2",
        "tests/test_preference.py::test_the_run_config_names_the_bad_field",
        "tests/test_rl.py::test_the_run_config_names_the_bad_field",
    ],
    "src/posttrain/runs/tunix_loss.py": ["tests/test_tunix_compat.py"],
    # the plan's logic and one real compile (libtpu: the tpu extra); not the seeds' (minutes)
    "src/posttrain/plan/topology.py": ["tests/test_plan.py", "-k", _NO_COMPILE],
    "src/posttrain/plan/report.py": [
        "tests/test_plan.py",
        "tests/test_plan_chip.py",
        "-k",
        _NO_COMPILE,
    ],
    # --run-steps: the checks of the chips and a real run of a tiny step on the CPU
    "src/posttrain/plan/measure.py": ["tests/test_plan_chip.py"],
    "harness/chip_precision.py": ["tests/test_chip_precision.py"],
    "harness/session_tuning.py": ["tests/test_harness.py", "-k", "profile or gc"],
    "harness/mutant_sources.py": ["tests/test_mutants.py"],
    "src/posttrain/plan/options.py": ["tests/test_plan.py", "-k", _NO_COMPILE],
    "src/posttrain/plan/depth.py": ["tests/test_plan.py", "-k", _NO_COMPILE],
    "src/posttrain/plan/sizes.py": ["tests/test_plan.py", "-k", "refuses"],  # #56 7
    "src/posttrain/plan/abstract.py": ["tests/test_plan.py"],
    "src/posttrain/plan/steps.py": ["tests/test_plan.py"],
    "src/posttrain/plan/compile.py": ["tests/test_plan.py"],
    "src/posttrain/plan/cli.py": ["tests/test_plan.py"],
    "src/posttrain/plan/workflows.py": ["tests/test_plan.py"],
    # the committed reports/ are not in the scratch copy: their test stays out
    "harness/fits.py": ["tests/test_fits.py", "-k", "not committed_rows"],
    "src/posttrain/lora/abstract.py": ["tests/test_plan.py", "-k", "abstract_lora"],
    # a checkpoint's formats: the family tests (transformers' masks and ids, SFT and DPO spans
    # of each format), the unit tests; not greedy generation (a compile per mutant)
    "src/posttrain/chat/template.py": [
        "tests/test_chat.py",
        "tests/test_chat_families.py",
        "-k",
        "not greedy",
    ],
    "src/posttrain/chat/sandbox.py": ["tests/test_chat_bounds.py", "tests/test_chat.py"],
    "src/posttrain/chat/encode.py": [
        "tests/test_chat.py",
        "tests/test_chat_families.py",
        "tests/test_preference.py",
        "-k",
        "not greedy",
    ],
    "src/posttrain/chat/generation_config.py": [
        "tests/test_chat.py",
        "tests/test_chat_families.py",
        "-k",
        "not greedy",
    ],
    # distillation: the hand-computed loss, the broken variants, a real run, accumulation
    "src/posttrain/distill/loss.py": [
        "contracts/test_tunix_distill.py",
        "contracts/test_tunix_distill_features.py",
    ],
    "src/posttrain/distill/tunix_distill.py": ["contracts/test_tunix_distill.py"],
    # the written-out logit loss and its check against the release's own
    "src/posttrain/distill/logit_loss.py": [
        "contracts/test_tunix_distill.py",
        "-k",
        "written_out or hand_computed or accumulated",
    ],
    "src/posttrain/distill/trainer.py": [
        "contracts/test_tunix_distill.py",
        "contracts/test_tunix_distill_features.py",
        "tests/test_distill_teacher_dtype.py",
    ],
    "harness/distill_cell.py": ["tests/test_matrix.py", "-k", "distill"],
    "src/posttrain/distill/features.py": ["contracts/test_tunix_distill_features.py"],
    "src/posttrain/models/taps.py": [
        "tests/test_taps.py",
        "contracts/test_tunix_distill_features.py",
    ],
    "harness/vision_cell.py": ["tests/test_matrix.py", "-k", "vision"],  # #39
    # the run base and the generated CLI (#37): their targets, first scores to come
    "src/posttrain/cli_options.py": ["tests/test_cli_options.py", "tests/test_run_options.py"],
    "src/posttrain/commands/checkpoints.py": [
        "tests/test_conversion_errors.py",
        "tests/test_cli_options.py",
    ],
    "src/posttrain/commands/generate.py": [
        "tests/test_generate.py",
        "tests/test_chat_families.py",
        "-k",
        "cli or greedy",
    ],
    "src/posttrain/commands/training.py": [
        "tests/test_sft_run.py",
        "tests/test_preference.py",
        "tests/test_rl.py",
        "tests/test_distill_run.py",
    ],
    "src/posttrain/distill/options.py": ["tests/test_distill_run.py", "tests/test_run_options.py"],
    "src/posttrain/distill/run.py": ["tests/test_distill_run.py"],
    "src/posttrain/preference/options.py": [
        "tests/test_preference.py",
        "tests/test_run_options.py",
    ],
    "src/posttrain/rl/metrics.py": ["tests/test_rl.py"],
    "src/posttrain/rl/options.py": ["tests/test_rl.py", "tests/test_run_options.py"],
    "src/posttrain/rl/tunix_cluster.py": ["tests/test_rl.py", "contracts/test_tunix_rl.py"],
    # the run's Tunix configs and cluster (#37's split of rl/run.py)
    "src/posttrain/rl/build.py": ["contracts/test_tunix_rl.py", "tests/test_rl.py"],
    "src/posttrain/runs/directory.py": ["tests/test_sft_run.py", "tests/test_run_options.py"],
    "src/posttrain/runs/export.py": [
        "tests/test_sft_run.py",
        "tests/test_lora.py",
        "-k",
        "export or run",
    ],
    # the runs in the checkpoint's format, the refusals, the export's files
    "src/posttrain/runs/formats.py": [
        "tests/test_chat_runs.py",
        "tests/test_sft_run.py",
        "-k",
        "chat or template or bad_input",
    ],
    "src/posttrain/runs/loading.py": ["tests/test_sft_run.py", "tests/test_preference.py"],
    "src/posttrain/runs/shards.py": ["tests/test_process_layouts.py", "tests/test_sft_run.py"],
    "src/posttrain/runs/training.py": ["tests/test_option_sensitivity.py", "tests/test_sft_run.py"],
    "src/posttrain/sft/options.py": [
        "tests/test_sft_run.py",
        "tests/test_run_options.py",
        "tests/test_model_option.py",
    ],
    # reliability of the inputs and faults (#40)
    "src/posttrain/limits.py": ["tests/test_generate_inputs.py"],
    "src/posttrain/commands/generate_inputs.py": ["tests/test_generate_inputs.py"],
    "src/posttrain/runs/checks.py": ["tests/test_run_checks.py"],
    "src/posttrain/runs/record.py": ["tests/test_run_checks.py", "tests/test_sft_run.py"],
    "src/posttrain/signals.py": ["tests/test_signals.py"],
    "src/posttrain/runs/stops.py": ["tests/test_disk_full.py", "tests/test_signals.py"],
}
# module -> the functions mutated, by mutmut's names (:func:`function_names`); a module
# not listed has every function mutated, and ``--functions`` overrides either.
# ``xǁClassǁmethod`` names a method, ``x_name`` a module-level function (mutmut's
# mangling). mutmut 3 leaves decorated functions alone (the step's
# ``create_train_step_fn`` is ``@override``), except those :func:`undecorate` frees
# (metrics.py's ``all_finite``, ``@jax.jit``).
FUNCTIONS: dict[str, tuple[str, ...]] = {
    # the step (objective, gradients, the update or skip, the logged terms), not the
    # trainer's Tunix plumbing (saves, placement, closing)
    "src/posttrain/sft/trainer.py": (
        "xǁSFTTrainerMixinǁ_objective",
        "xǁSFTTrainerMixinǁ_report",
        "xǁSFTTrainerMixinǁ_grads",
        "xǁSFTTrainerMixinǁ_step_body",
        "x_default_moe_aux_loss_weight",
    ),
}
# the gate's tier, and this module as a plugin (the stats phase's cache clearing)
_PYTEST_ARGS = ["-p", "no:cacheprovider", "-p", "harness.mutants", "-x", "-q", "-m", "not slow"]
_COPIED = ("src", "harness", "tests", "contracts", "pyproject.toml", "README.md", ".gitignore")


# what a run needs in this interpreter (mutmut's copies run their tests with it), first
# missing first, and where each comes from
PREREQUISITES = (
    ("mutmut", "the mutants dependency group"),
    ("pytest", "the test dependency group"),
    ("hypothesis", "the test dependency group"),
    ("tunix", "the train extra"),
)
_GET_THEM = (
    "uvx --with tox-uv tox -e mutants (from a fresh clone), or "
    "uv run --extra train --group test --group mutants python -m harness.mutants"
)


def missing_prerequisite() -> str | None:
    """One line naming the first of :data:`PREREQUISITES` this interpreter lacks and how
    to get it; None when every one imports."""
    for module, source in PREREQUISITES:
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed ({source}); run: {_GET_THEM}"
    return None


def _section(module: str, selection: list[str], max_children: int) -> str:
    def toml_list(items):
        return "[" + ", ".join(json.dumps(i) for i in items) + "]"

    top = module.split("/")[0]  # src (the posttrain package) or harness: mutmut's import root
    # README.md: pyproject's readme, without which the matrix's and bisect's environment
    # builds of this checkout (tests/test_bisect.py) fail inside mutmut's copy
    copied = [d for d in ("src", "harness", "contracts", ".gitignore", "README.md") if d != top]
    return (
        "\n[tool.mutmut]\n"
        f"source_paths = {toml_list([top])}\n"
        f"only_mutate = {toml_list([module])}\n"
        f"pytest_add_cli_args_test_selection = {toml_list(selection)}\n"
        f"pytest_add_cli_args = {toml_list(_PYTEST_ARGS)}\n"
        'process_isolation = "forkserver"\n'
        'forkserver_warmup = "none"\n'
        f"max_children = {max_children}\n"
        f"also_copy = {toml_list(copied)}\n"
    )


def run_module(
    module: str,
    root: pathlib.Path,
    work: pathlib.Path,
    max_children: int,
    functions: Sequence[str] = (),
) -> dict:
    """Runs mutmut on ``module`` in ``work`` (a fresh copy of ``root``), on the mutants of
    ``functions`` only where given (mutmut's names); returns its row."""
    for name in _COPIED:
        source = root / name
        if source.is_dir():
            shutil.copytree(source, work / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif source.exists():
            shutil.copy2(source, work / name)
    target = work / module
    target.write_text(undecorate(target.read_text(encoding="utf-8")), encoding="utf-8")
    pyproject = work / "pyproject.toml"
    pyproject.write_text(
        pyproject.read_text(encoding="utf-8") + _section(module, TARGETS[module], max_children),
        encoding="utf-8",
    )
    env = {**os.environ, "HYPOTHESIS_PROFILE": "ci"}
    run = subprocess.run(
        [sys.executable, "-m", "mutmut", "run", f"--max-children={max_children}"]
        + mutant_patterns(module, functions),
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
    )
    subprocess.run([sys.executable, "-m", "mutmut", "export-cicd-stats"], cwd=work, env=env)
    stats_file = work / "mutants" / "mutmut-cicd-stats.json"
    if run.returncode != 0 or not stats_file.exists():
        tail = (run.stdout + run.stderr).strip().splitlines()[-3:]
        return {"module": module, "error": " | ".join(tail) or f"exit {run.returncode}"}
    stats = json.loads(stats_file.read_text())
    results = subprocess.run(
        [sys.executable, "-m", "mutmut", "results"], cwd=work, capture_output=True, text=True
    ).stdout
    survivors = [line.split(":")[0].strip() for line in results.splitlines() if "survived" in line]
    judged = stats["killed"] + stats["survived"] + stats["timeout"]
    return {
        "module": module,
        **{k: stats[k] for k in ("killed", "survived", "timeout", "no_tests", "total")},
        "score": None if not judged else stats["killed"] / judged,
        "survivors": survivors,
        "workdir": str(work),
    }


def pytest_runtest_setup(item) -> None:
    """In mutmut's stats phase (``MUTANT_UNDER_TEST=stats``), JAX's caches cleared before
    each test: a jitted function's trampoline runs when JAX traces it, so each test must
    trace again for mutmut to record that it reaches the function."""
    if os.environ.get("MUTANT_UNDER_TEST") == "stats" and "jax" in sys.modules:
        sys.modules["jax"].clear_caches()


def markdown(rows: list[dict]) -> str:
    lines = [
        "# Mutation scores (mutmut)",
        "",
        "| module | killed | survived | timeout | no tests | score |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| `{r['module']}` | error: {r['error']} | | | | |")
            continue
        score = "-" if r["score"] is None else f"{r['score']:.1%}"
        lines.append(
            f"| `{r['module']}` | {r['killed']} | {r['survived']} | {r['timeout']} | "
            f"{r['no_tests']} | {score} |"
        )
    for r in rows:
        if r.get("survivors"):
            lines += ["", f"Surviving in `{r['module']}`: " + ", ".join(r["survivors"])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.mutants", description=__doc__)
    parser.add_argument("modules", nargs="*", help=f"default: all of {len(TARGETS)}")
    parser.add_argument("--max-children", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--report-dir", default="reports")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directories")
    parser.add_argument(
        "--functions",
        help="comma-separated functions of the one MODULE to mutate, by mutmut's names "
        "(x_name, xǁClassǁmethod; default: FUNCTIONS' or all): one shard of a long run",
    )
    args = parser.parse_args(argv)
    unknown = [m for m in args.modules if m not in TARGETS]
    if unknown:
        parser.error(f"unknown module {unknown[0]!r}; expected one of {sorted(TARGETS)}")
    root = pathlib.Path(__file__).resolve().parent.parent
    functions = {m: FUNCTIONS.get(m, ()) for m in args.modules or list(TARGETS)}
    if args.functions is not None:
        if len(args.modules) != 1:
            parser.error(f"--functions needs exactly one MODULE, got {len(args.modules)}")
        (module,) = args.modules
        names = tuple(n.strip() for n in args.functions.split(","))
        known = function_names(module, root)
        bad = [n for n in names if n not in known]
        if bad:
            parser.error(
                f"--functions {bad[0]!r} is not a function mutmut mutates in {module}; "
                f"expected one of {sorted(known)}"
            )
        functions[module] = names
    if args.max_children < 1:
        parser.error(f"--max-children {args.max_children}: expected >= 1")
    report_dir = pathlib.Path(args.report_dir)
    if report_dir.exists() and not report_dir.is_dir():
        parser.error(f"--report-dir {report_dir} is a file, expected a directory")
    if missing := missing_prerequisite():
        print(f"python -m harness.mutants: {missing}", file=sys.stderr)
        return 2
    rows = []
    for module, names in functions.items():
        work = pathlib.Path(tempfile.mkdtemp(prefix="mutants-"))
        print(f"mutants: {module} in {work}", flush=True)
        row = run_module(module, root, work, args.max_children, names)
        rows.append(row)
        print(markdown([row]).splitlines()[-1], flush=True)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
            row.pop("workdir", None)
    report_dir.mkdir(parents=True, exist_ok=True)
    atomic.write_text(report_dir / "mutants.json", json.dumps(rows, indent=2) + "\n")
    atomic.write_text(report_dir / "mutants.md", markdown(rows))
    print(markdown(rows))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
