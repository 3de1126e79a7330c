"""What mutation testing mutates, and with which tests: :data:`TARGETS` (module -> its
test selection; the harness's own modules' from :mod:`harness.tools.harness_targets`, the
plan's from :mod:`harness.tools.plan_targets`; the
functions mutated where not all are: :mod:`harness.tools.mutant_functions`), read by
:mod:`harness.tools.mutants` and kept in step with the weekly workflow's mutants jobs
(``.github/workflows/matrix.yml``, checked by tests/test_mutants.py).
"""

from __future__ import annotations

from harness.tools.harness_targets import HARNESS_TARGETS
from harness.tools.plan_targets import PLAN_TARGETS

# module -> the tests that exercise it (pytest node ids or -k expressions after "-k").
TARGETS: dict[str, list[str]] = {
    "src/posttrain/layers/moe/router.py": [
        "tests/test_moe.py",
        "tests/test_bf16.py::test_router_picks_the_fp32_winner_when_bf16_rounding_would_tie",
    ],
    "src/posttrain/layers/moe/dispatch.py": ["tests/test_moe.py"],
    # test_bf16: the tiny MoE presets run the sorted experts in bfloat16;
    # test_moe_tpu_compile: ragged_dot's two ways around XLA:TPU (compiled for a v5e)
    "src/posttrain/layers/moe/experts.py": [
        "tests/test_moe.py",
        "tests/test_bf16.py",
        "tests/test_moe_tpu_compile.py",
    ],
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
    # splash (#55): equal to XLA interpreted, the NaN mask, the refusal; its costs (#54)
    "src/posttrain/layers/splash.py": ["tests/test_splash_attention.py"],
    "src/posttrain/layers/splash_costs.py": ["tests/test_splash_costs.py"],
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
    # #58's split of sharding.py: the rules (resolution, the batch and sequence sizes, mesh
    # specs and meshes), the current mesh and constrain, parameters and their placement;
    # each against the models it shards (sharded forward = one device, the refusals)
    "src/posttrain/sharding/rules.py": [
        "tests/test_models.py",
        "tests/test_fuzz_inputs.py::test_mesh_specs",
        "tests/test_lora.py::test_dummy_batch_shape_multiplies_the_rule_axes",
    ],
    "src/posttrain/sharding/activations.py": [
        "tests/test_models.py",
        "tests/test_attention_blocks.py",
    ],
    "src/posttrain/sharding/params.py": ["tests/test_models.py"],
    # the tower's values come from HF parity with images (patches, 2-D RoPE, pooling,
    # padding, standardisation, projection, placement) and the placement/pixel properties
    "src/posttrain/layers/vision.py": [
        "tests/test_vision.py",
        "tests/test_vision_bidirectional.py",
        "tests/test_rope.py",
    ],
    "src/posttrain/families/family.py": ["tests/test_families.py"],  # #58: apart from the registry
    # the tower's rows and config.json reader/writer: parity and the bit-exact round trip
    "src/posttrain/families/gemma4_vision.py": [
        "tests/test_vision.py",
        "tests/test_families.py",
        "tests/test_conversion_roundtrip.py",
    ],
    # images against transformers' own processor, the token expansion, the file errors
    "src/posttrain/vision/data.py": ["tests/test_vision_data.py"],
    # #58: MoEConfig, out of config.py: each refusal and each field at its edge; the MoE
    # block on the defaults
    "src/posttrain/moe_config.py": ["tests/test_moe_config.py", "tests/test_moe.py"],
    "src/posttrain/vision_config.py": [
        "tests/test_vision.py::test_vision_config_refuses_what_the_tower_cannot_run",
        "tests/test_vision.py::test_every_vision_field_is_perturbed_shaped_or_the_data_s",
        "tests/test_vision.py::test_perturbing_a_vision_field_moves_the_logits",
    ],
    "src/posttrain/vision/default_data.py": ["tests/test_vision_data.py"],
    # #39: the rows' tests without the real run (a minute per surviving mutant)
    "src/posttrain/vision/rows.py": ["tests/test_vision_sft.py", "-k", "not short_vision"],
    "src/posttrain/vision/run.py": ["tests/test_vision_sft.py"],
    # posttrain sft's run: text only (--vision is run_vision's); the pass-through is
    # every SFT run test's
    "src/posttrain/sft/run.py": ["tests/test_vision_sft.py", "-k", "refuse_each_others"],
    "src/posttrain/commands/generate_image.py": ["tests/test_vision_generate.py"],
    # check-logits' image batch: placement, padding and the two models' inputs (the HF
    # parity runs themselves are slow-tier, which mutation runs leave out)
    "src/posttrain/conversion/vision_parity.py": ["tests/test_vision_check_logits.py"],
    "src/posttrain/conversion/directories.py": ["tests/test_atomic_writes.py"],
    "src/posttrain/hf_schema/hf_fields.py": ["tests/test_hf_window_fields.py"],
    "src/posttrain/hf_schema/transforms.py": [
        "tests/test_conversion_roundtrip.py",
        "tests/test_conversion_errors.py",
        "tests/test_conversion_parity.py::test_square_expert_kernels_convert_by_value",
        "tests/test_conversion_parity.py::test_converted_logits_match_transformers",
    ],
    "src/posttrain/training/loss.py": [
        "tests/test_sft_loss.py",
        "tests/test_sft_objective.py",
        "tests/test_chunked_loss.py",
    ],
    # equal to the full logits' NLL (chunk sizes, tail, bf16, LoRA on lm_head, meshes), the
    # compiled step's temporaries, the frozen head, the plan's uncounted costs
    "src/posttrain/training/chunked_loss.py": ["tests/test_chunked_loss.py"],
    # the LoRA run: in full fine-tuning the frozen part of the step's split is empty, so
    # mutants of its filter and its copy passed the others; the NaN-weights save: the
    # check before saving
    "src/posttrain/training/trainer.py": [
        "tests/test_sft_objective.py",
        "contracts/test_sft_conventions.py",
        "tests/test_sft_run.py::test_lora_run_checkpoints_only_the_adapters",
        "tests/test_sft_run.py::test_non_finite_weights_are_never_checkpointed",
    ],
    # the step (#58: out of trainer.py, whose FUNCTIONS it was), with the trainer's tests;
    # test_donation: what the step donates (#55)
    "src/posttrain/training/step.py": [
        "tests/test_sft_objective.py",
        "contracts/test_sft_conventions.py",
        "tests/test_sft_run.py::test_lora_run_checkpoints_only_the_adapters",
        "tests/test_sft_run.py::test_non_finite_weights_are_never_checkpointed",
        "tests/test_donation.py",
        # SFTStep.loss_options reaching sft_terms (the loss's form, #55)
        "tests/test_chunked_loss.py::test_a_trainers_loss_options_reach_its_objective",
    ],
    # reading Tunix's step convention and donation from its source, binding our jitted step
    # as Tunix bound its own (#55): the detector's tests, the donation's, every convention
    "src/posttrain/training/tunix_compat.py": [
        "tests/test_tunix_compat.py",
        "tests/test_donation.py",
        "contracts/test_sft_conventions.py",
    ],
    # the supervised run end to end (#58's split of sft/run.py): the text runs, their
    # refusals and resumes, and one image run (its held-out line and its export)
    "src/posttrain/training/supervised.py": [
        "tests/test_supervised_run.py",
        "tests/test_sft_run.py",
        "tests/test_run_checks.py",
        "tests/test_vision_sft.py::test_a_short_vision_run_trains_the_projector_and_leaves_the_tower",
    ],
    "src/posttrain/training/metrics.py": [
        "tests/test_sft_run.py",
        "contracts/test_sft_conventions.py",
    ],
    "src/posttrain/layers/kv_cache.py": ["tests/test_generate.py", "-k", "incremental or cache"],
    "src/posttrain/generate.py": ["tests/test_generate.py", "-k", "not cli"],
    "src/posttrain/lora/merge.py": ["tests/test_lora.py", "-k", "merge or zero_adapter"],
    "src/posttrain/lora/adapters.py": ["tests/test_lora.py", "tests/test_loaders.py"],
    "src/posttrain/training/policy.py": ["tests/test_rl.py", "contracts/test_tunix_rl.py"],
    "src/posttrain/rl/rewards.py": ["tests/test_rl.py", "tests/test_reward_probe.py"],
    # the CLI generated from the options, and the checks every run shares
    "src/posttrain/flags.py": [
        "tests/test_cli_options.py",
        "tests/test_run_options.py",
        # the rows themselves (the tests that compare docs/ with them read files that the
        # mutation copy does not hold)
        "tests/test_options_docs.py::test_a_row_is_the_flag_its_default_and_its_help",
    ],
    "src/posttrain/training/options.py": [
        "tests/test_run_options.py",
        "tests/test_supervised_run.py",
        "tests/test_model_option.py",
        "tests/test_sft_run.py::test_cli_bad_input_is_one_line_and_exit_2",
        "tests/test_preference.py::test_the_run_config_names_the_bad_field",
        "tests/test_rl.py::test_the_run_config_names_the_bad_field",
    ],
    "src/posttrain/training/tunix_loss.py": ["tests/test_tunix_compat.py"],
    **PLAN_TARGETS,  # posttrain.plan's modules
    "src/posttrain/models/params.py": [
        "tests/test_model_host_init.py",
        "tests/test_loaders.py",
    ],
    # #58's decoder split: RoPE tables and masks, cached or not: sliding windows against HF,
    # cached decodes against the full forward, splash against XLA, images (cached too)
    "src/posttrain/models/layer_inputs.py": [
        "tests/test_conversion_parity.py::test_converted_logits_match_transformers",
        "tests/test_generate.py::test_incremental_decoding_equals_the_full_forward",
        "tests/test_generate.py::test_a_cached_prefill_longer_than_the_window_then_decoding",
        "tests/test_splash_attention.py",
        "tests/test_vision_bidirectional.py",
        "tests/test_vision_generate.py::test_cached_generation_with_an_image_equals_the_uncached_greedy_loop",
    ],
    "src/posttrain/lora/abstract.py": ["tests/test_plan.py", "-k", "abstract_lora"],
    # #58: apply_lora's refusals, out of apply.py (each refusal before any trace, the rank
    # over min(d_in, d_out), the vision tower); test_lora_checks: each check on its own
    "src/posttrain/lora/checks.py": [
        "tests/test_lora_checks.py",
        "tests/test_lora.py",
        "tests/test_sft_run.py",
        "tests/test_vision_sft.py",
        "-k",
        "lora_checks or bad_input or wrongly or refuses_the_tower",
    ],
    # a checkpoint's formats: the family tests (transformers' masks and ids, SFT and DPO spans
    # of each format), the unit tests; not greedy generation (a compile per mutant)
    "src/posttrain/chat/template.py": [
        "tests/test_chat.py",
        "tests/test_chat_families.py",
        "-k",
        "not greedy",
    ],
    "src/posttrain/chat/sandbox.py": [
        "tests/test_chat_bounds.py",
        "tests/test_chat_sandbox.py",
        "tests/test_chat.py",
    ],
    # #58: the bounds and the size estimates, out of sandbox.py (test_chat_sandbox: each
    # estimate at its edge; test_chat_bounds: the runaway templates; test_chat_estimates:
    # each estimate called as the sandbox calls it)
    "src/posttrain/chat/bounds.py": [
        "tests/test_chat_estimates.py",
        "tests/test_chat_bounds.py",
        "tests/test_chat_sandbox.py",
        "tests/test_chat.py",
    ],
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
    "src/posttrain/distill/features.py": ["contracts/test_tunix_distill_features.py"],
    "src/posttrain/models/taps.py": [
        "tests/test_taps.py",
        "contracts/test_tunix_distill_features.py",
    ],
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
    "src/posttrain/training/directory.py": ["tests/test_sft_run.py", "tests/test_run_options.py"],
    "src/posttrain/training/export.py": [
        "tests/test_sft_run.py",
        "tests/test_lora.py",
        "-k",
        "export or run",
    ],
    # the runs in the checkpoint's format, the refusals, the export's files
    "src/posttrain/training/formats.py": [
        "tests/test_chat_runs.py",
        "tests/test_sft_run.py",
        "-k",
        "chat or template or bad_input",
    ],
    "src/posttrain/training/loading.py": ["tests/test_sft_run.py", "tests/test_preference.py"],
    "src/posttrain/training/shards.py": ["tests/test_process_layouts.py", "tests/test_sft_run.py"],
    "src/posttrain/training/optimizer.py": [
        "tests/test_option_sensitivity.py",
        "tests/test_sft_run.py",
    ],
    "src/posttrain/sft/options.py": [
        "tests/test_sft_run.py",
        "tests/test_run_options.py",
        "tests/test_model_option.py",
    ],
    # reliability of the inputs and faults (#40)
    "src/posttrain/limits.py": ["tests/test_generate_inputs.py"],
    "src/posttrain/commands/generate_inputs.py": ["tests/test_generate_inputs.py"],
    "src/posttrain/atomic.py": [
        "tests/test_atomic.py",
        "tests/test_generate_inputs.py",
        "tests/test_atomic_writes.py",
    ],
    "src/posttrain/training/checks.py": ["tests/test_run_checks.py"],
    "src/posttrain/training/record.py": ["tests/test_run_checks.py", "tests/test_sft_run.py"],
    "src/posttrain/signals.py": ["tests/test_signals.py"],
    "src/posttrain/xla_flags.py": ["tests/test_xla_flags.py"],
    "src/posttrain/training/stops.py": ["tests/test_disk_full.py", "tests/test_signals.py"],
    **HARNESS_TARGETS,  # the harness's own modules, after the library's
}
