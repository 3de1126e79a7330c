"""The functions mutation testing mutates where not all of a module's are
(:data:`FUNCTIONS`), read by :mod:`harness.tools.mutants` beside
:data:`harness.tools.mutant_targets.TARGETS`.
"""

from __future__ import annotations

# module -> the functions mutated, by mutmut's names
# (:func:`harness.tools.mutant_sources.function_names`); a module
# not listed has every function mutated, and ``--functions`` overrides either.
# ``xǁClassǁmethod`` names a method, ``x_name`` a module-level function (mutmut's
# mangling). mutmut 3 leaves decorated functions alone (the step's
# ``create_train_step_fn`` is ``@override``), except those
# :func:`harness.tools.mutant_sources.undecorate` frees
# (metrics.py's ``all_finite``, ``@jax.jit``).
FUNCTIONS: dict[str, tuple[str, ...]] = {
    # the load-balancing weight the step reads, not the trainer's Tunix plumbing (saves,
    # placement, closing); the step itself (objective, gradients, the update or skip, the
    # logged terms) is training/step.py, every function of it
    "src/posttrain/training/trainer.py": ("x_default_moe_aux_loss_weight",),
    # what #55 added or changed (the checkpoint fill-in for old releases has its own tests)
    "src/posttrain/training/tunix_compat.py": (
        "x__is_train_step_assign",
        "x__call_name",
        "x__donated",
        "x__bound_attributes",
        "x_detect_from_source",
        "x_donated_by",
        "x_bind_like",
    ),
    # the host init and the model build (#54's), not the parameter-count helpers
    "src/posttrain/models/params.py": ("x_init_on_host", "x_build_model"),
    # #58: the Qwen-style sliding-window fields, shared instead of copied per family
    "src/posttrain/hf_schema/hf_fields.py": ("x_max_window_layers", "x_max_window_fields"),
}
