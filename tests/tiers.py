"""The two test tiers, assigned by file and by test name (README, "Tests").

- The fast tier, `python -m pytest -q -n 2` (`-m "not full"` in
  pyproject.toml's `addopts`): the unit tests, the doctests and at least one
  test of every option, callback, aggregator, `fastgrad()` and saving.
- The full tier, `python -m pytest -q -n 2 -m full`: what is listed here
  and every `slow` test (whole programs in fresh processes: the
  MirroredStrategy and multi-worker cases, the notebooks, the profiler's
  command line, the demo, `benchmarks/run_all.py`), the KerasHub models,
  the sweeps over every aggregator, XLA and the dtypes, and the repeats of
  what the fast tier already checks once.

conftest.py marks the tests (`full`), so the test files carry no tier marks;
tests/test_tiers.py checks that every entry here names a test that exists
and that the fast tier still touches everything it must. `.ci/run` runs both
tiers; `-m ""` runs both at once.
"""

_SWEEP = "a sweep; the fast tier keeps the module's single cases"
_XLA = "the XLA variant of a case the fast tier runs in graph mode"
_REPEAT = "a repeat of what a fast test checks, on more models or settings"

# Whole files, with why.
FULL_FILES = {
    "tests/aggregators/test_properties.py": "the property sweep over every aggregator, dtype and scale",
    "tests/aggregators/test_in_models.py": "every aggregator in a model (each has its own method tests)",
}

# Tests by file and function name (every parametrization), with why.
_BY_FILE = {
    "tests/aggregators/test_dual_cone.py": {
        "test_dual_cone_weights_do_not_depend_on_task_order_or_xla": _XLA,
        "test_dual_cone_weights_are_the_exact_qp_solution": _SWEEP,
        "test_keras_files_saved_with_max_iter_load_and_train": _REPEAT,
        "test_upgrad_and_dualproj_match_active_set_qp": _SWEEP,
    },
    "tests/aggregators/test_registry.py": {
        "test_xla_and_graph_match_eager_and_keep_dtype": _XLA,
        "test_graph_and_xla_match_eager_on_conflicting_tasks": _XLA,
        "test_degenerate_grams_give_finite_weights": _SWEEP,
        "test_nonfinite_gram_gives_nonfinite_weights_without_error": _XLA,
    },
    "tests/aggregators/test_imtl.py": {"test_imtl_under_xla_does_not_depend_on_the_scale": _XLA},
    "tests/aggregators/test_pcgrad.py": {
        "test_pcgrad_random_order_under_xla": _XLA,
        "test_pcgrad_seed_makes_its_orders_reproducible": _REPEAT,
    },
    "tests/callbacks/test_callbacks.py": {
        "test_a_fit_that_raises_leaves_a_plain_model": _REPEAT,
        "test_all_callbacks_under_xla_steps_per_execution_accumulation_clipping": _XLA,
        "test_tensorboard_gets_the_task_keys_of_a_multitask_model": _REPEAT,
    },
    "tests/end_to_end/test_adaptive_clipping_fit.py": {
        "test_under_xla": _XLA,
        "test_nan_gradient_never_reaches_the_weights": _REPEAT,
        "test_options_round_trip_through_a_keras_file": _REPEAT,
    },
    "tests/end_to_end/test_bring_your_own.py": {
        "test_fastgrad_mobilenet_v3_small_trains_like_keras_model": "a keras.applications model",
        "test_fastgrad_kerashub_classifier_accumulates_exactly_and_saves": "KerasHub",
        "test_callbacks_on_a_plain_kerashub_fit_leave_its_training_bit_identical": "KerasHub",
        "test_pickled_models_keep_their_class_and_options": _REPEAT,
        "test_sequential_without_options_trains_like_keras_sequential": _REPEAT,
        "test_legacy_h5_files_load_without_custom_objects": _REPEAT,
        "test_callbacks_on_a_plain_sequential_leave_its_training_bit_identical": _REPEAT,
    },
    "tests/end_to_end/test_dropin.py": {
        "test_loss_scale_factor_with_accumulation_and_clipping": _REPEAT,
        "test_loss_scale_factor_trains_like_keras_model": _REPEAT,
        "test_clone_trains_like_the_original_with_accumulation": _REPEAT,
    },
    "tests/end_to_end/test_edges.py": {
        "test_accumulated_embedding_update_is_the_dense_big_batch_step": _REPEAT,
        "test_all_padding_batch_of_a_masked_rnn_matches_keras": _REPEAT,
        "test_batch_with_all_zero_sample_weights_matches_keras": _REPEAT,
        "test_window_with_all_zero_sample_weights_makes_keras_zero_step": _REPEAT,
        "test_padding_rows_do_not_poison_masked_pooling": _REPEAT,
    },
    "tests/end_to_end/test_exactness.py": {
        "test_masked_rnn_micro_batches_equal_the_unsplit_step": _SWEEP,
        "test_batchnorm_model_default_options_train_exactly_like_keras": _REPEAT,
        "test_masked_rnn_under_xla_and_steps_per_execution": _XLA,
        "test_masked_rnn_with_sample_weights": _REPEAT,
        "test_sequence_outputs_micro_batches": _REPEAT,
        "test_clip_norm_trains_like_keras_global_clipnorm": _SWEEP,
        "test_outputs_with_different_normalisers_warn": _REPEAT,
        "test_outputs_with_the_same_rows_normaliser_are_exact_without_warning": _REPEAT,
        "test_per_pixel_loss_with_pixel_weights_and_accumulation": _REPEAT,
    },
    "tests/end_to_end/test_extra_loss_terms.py": {
        "test_terms_equal_the_big_batch_sweep": _SWEEP,
    },
    "tests/end_to_end/test_micro_batch_padding.py": {
        "test_every_term_equals_the_unsplit_step": _SWEEP,
        "test_xla_and_steps_per_execution": _XLA,
        "test_batchnorm_normalises_each_slice_by_its_real_rows": _SWEEP,
    },
    "tests/end_to_end/test_window_edges.py": {
        "test_unknown_size_data_partial_window_beyond_an_mlp": _REPEAT,
        "test_empty_micro_batches_in_windows_match_the_big_batches": _REPEAT,
        "test_only_empty_batches_step_and_log_zero_as_keras_does": _REPEAT,
        "test_empty_batches_step_as_keras_does": _SWEEP,
        "test_unknown_size_data_applies_the_epochs_partial_window": _SWEEP,
        "test_saved_pending_window_applies_after_loading": _SWEEP,
    },
    "tests/models/test_keras_hooks.py": {
        "test_same_seed_same_run_as_keras_model": _REPEAT,
        "test_training_only_layer_trains_like_keras_model": _REPEAT,
        "test_run_eagerly_with_eager_only_call_trains_like_keras_model": _REPEAT,
    },
    "tests/models/test_model.py": {
        "test_jit_compile_equals_graph_mode": _XLA,
        "test_checkpoint_mid_window_resumes_exactly": _REPEAT,
        "test_multi_output_default_equals_keras_model": _REPEAT,
        "test_mixed_float16_overflowing_batch_is_dropped_and_scale_lowered": _REPEAT,
    },
    "tests/models/test_refusals.py": {
        "test_another_backend_is_refused_at_import": "a fresh process per backend",
        "test_the_backend_check_names_what_keras_reports": "a fresh process",
        "test_own_step_refuses_options_it_would_ignore_before_any_update": _SWEEP,
    },
    "tests/multitask/test_feature_space.py": {
        "test_two_tasks_update_is_weighted_sum_with_weights_from_z_gram": _SWEEP,
        "test_accumulation_equals_the_big_batch": _REPEAT,
        "test_steps_per_execution_3_equals_1": _REPEAT,
        "test_mixed_float16_unscales_once": _REPEAT,
        "test_three_tasks_mgda": _REPEAT,
        "test_three_tasks_pcgrad_is_algorithm1_for_some_order": _REPEAT,
        "test_subclassed_model_with_a_named_layer": _REPEAT,
    },
    "tests/multitask/test_merger.py": {
        "test_steps_per_execution_3_equals_1": _REPEAT,
        "test_three_tasks_each_step_is_algorithm1_for_some_order_and_orders_vary": _REPEAT,
        "test_tug_of_war_pcgrad_lowers_both_losses_where_the_sum_raises_one": _REPEAT,
        "test_pcgrad_two_conflicting_tasks_match_algorithm1": _REPEAT,
    },
    "tests/multitask/test_multitask_models.py": {
        "test_micro_batches_with_multitask_on_a_gru_equal_the_unsplit_step": _REPEAT,
        "test_micro_batches_with_masks_on_several_outputs_warn_that_rows_weigh": _REPEAT,
        "test_features_space_on_a_masked_gru": _REPEAT,
    },
    "tests/end_to_end/test_saved_fixtures.py": {
        "test_half_full_window_resumes_exactly": _REPEAT,
    },
    "tests/profiling/test_profiling.py": {
        "test_runs_on_functional_and_subclassed_models": _REPEAT,
        "test_phases_are_ordered_on_a_model_big_enough": "profiles a larger model",
        "test_xla_mode_runs_adaptive_clipping": _XLA,
        "test_weights_and_optimizer_state_are_unchanged": _REPEAT,
        "test_global_dtype_policy_is_restored": _REPEAT,
    },
    "tests/step/test_batchnorm.py": {
        "test_every_batchnorm_of_a_keras_application_pools_what_it_saw": "a keras.applications model",
        "test_masked_batchnorm_pools_the_mask_weighted_moments": _REPEAT,
        "test_a_file_whose_step_state_does_not_fit_leaves_no_pooled_moments": _REPEAT,
        "test_dropped_micro_batch_is_left_out_of_the_pooled_moments": _REPEAT,
        "test_synchronized_batchnorm_with_micro_batches_runs_without_a_strategy": _REPEAT,
    },
    "tests/step/test_noise_scale.py": {
        "test_recovers_the_closed_form_noise_scale_of_a_linear_regression": _SWEEP,
        "test_equals_the_paper_estimators_on_plain_keras_gradients": _SWEEP,
        "test_state_round_trips_through_keras_files_and_older_files_load": _REPEAT,
    },
    "tests/step/test_slicing.py": {
        "test_micro_batches_with_multitask_equal_the_unsplit_merge": _REPEAT,
        "test_xla_equals_graph_mode": _XLA,
        "test_mixed_float16": _REPEAT,
        "test_slice_sizes_are_numpy_array_split_without_empty_slices": _SWEEP,
        "test_uneven_split_equals_the_whole_batch": _REPEAT,
        "test_adam_and_sample_weights": _REPEAT,
        "test_micro_batches_larger_than_the_batch": _REPEAT,
    },
    "tests/test_docs.py": {
        "test_page_code_runs": "every page's code, run as shown (trains models)",
    },
    "tests/test_tf_startup.py": {
        "test_the_demo_and_an_import_print_no_tensorflow_lines": "fresh processes",
    },
    "tests/aggregators/test_gradvac.py": {
        "test_gradvac_state_restored_by_weights_file_and_plain_model_loads_it": _REPEAT,
    },
    "tests/aggregators/test_mgda.py": {
        "test_mgda_min_norm_point_when_task_norms_differ_by_orders": _SWEEP,
    },
    "tests/aggregators/test_nashmtl.py": {
        "test_nashmtl_solves_the_bargaining_condition": _SWEEP,
    },
    "tests/end_to_end/test_safety.py": {
        "test_a_nonfinite_loss_with_finite_gradients_is_dropped": _REPEAT,
        "test_many_models_do_not_warn_about_retracing_the_flush": _REPEAT,
    },
    "tests/end_to_end/test_unchecked_paths.py": {
        "test_clip_norm_applies_a_nonfinite_batch_like_keras_sweep": _SWEEP,
        "test_loss_scaling_still_drops_a_nan_batch_sweep": _SWEEP,
        "test_no_cond_path_is_exact_on_every_model": _SWEEP,
    },
    "tests/models/test_options.py": {
        "test_optimizer_options_alone_stay_allowed": _REPEAT,
        "test_an_empty_multitask_features_is_refused_at_construction": _SWEEP,
    },
    "tests/test_bench_step_memory.py": {
        "test_a_small_run_reads_the_allocators_peak": "a benchmark run (two processes, ~25 s)",
    },
    "tests/test_bench_targets.py": {
        "test_gated_anchor_with_accumulation_on_batchnorm_and_sparse_models": _REPEAT,
        "test_bench_targets_main_times_a_row_against_its_anchor": "a benchmark run (~15 s)",
        "test_instance_spread_times_every_cross_pair_and_each_sides_consecutive_instances": (
            "a benchmark run (~20 s)"
        ),
    },
}
# Moved on 2026-12-02 (the fast tier measured 336 s on 2 idle cores after
# issue 27's new tests): each repeats on another model or setting what a
# fast test still checks once.
_TIME = "a repeat of a fast test's check, moved to keep the fast tier within 5 minutes"
_MOVED_FOR_TIME = {
    "tests/end_to_end/test_one_device_strategy.py": [
        "test_accumulation_with_an_uneven_last_batch_and_sparse_gradients",
        "test_micro_batches_on_a_per_pixel_loss",
        "test_clip_norm_clips_alike",
        "test_a_nonfinite_micro_batch_is_dropped",
        "test_mixed_float16_loss_scaling",
        "test_batchnorm_window_statistics",
        "test_multitask_pcgrad",
        "test_callback_on_a_plain_keras_model",
    ],
    "tests/end_to_end/test_extra_loss_terms.py": ["test_terms_equal_the_big_batch"],
    "tests/step/test_batchnorm.py": [
        "test_moving_statistics_equal_keras_on_the_concatenated_batch"
    ],
    "tests/end_to_end/test_exactness.py": [
        "test_masked_rnn_accumulation_equals_the_big_batch",
        "test_per_pixel_loss_micro_batches",
    ],
    "tests/end_to_end/test_saved_fixtures.py": ["test_weights_file_loads_bit_exact"],
    "tests/end_to_end/test_safety.py": [
        "test_evaluate_inside_fit_does_not_change_training",
        "test_isolated_bad_batches_train_on_without_alarm",
        "test_clipping_never_makes_a_silently_zero_update",
        "test_max_consecutive_nonfinite_is_validated",
    ],
    "tests/multitask/test_merger.py": [
        "test_accumulation_merges_each_micro_batch_then_accumulates",
        "test_clipping_applies_to_the_merged_gradient",
        "test_save_load_round_trip_restores_the_aggregator",
    ],
    "tests/multitask/test_feature_space.py": ["test_save_load_keeps_the_options"],
    "tests/multitask/test_multitask_models.py": [
        "test_features_space_on_a_conv_trunk_with_per_pixel_losses"
    ],
    "tests/models/test_refusals.py": [
        "test_own_step_with_honoured_options_trains_like_keras_model"
    ],
    "tests/end_to_end/test_micro_batch_padding.py": [
        "test_batchnorm_micro_batch_statistics_move_per_real_slice"
    ],
    "tests/end_to_end/test_edges.py": [
        "test_window_of_padding_only_in_a_masked_rnn_makes_keras_zero_step"
    ],
    "tests/end_to_end/test_adaptive_clipping_fit.py": [
        "test_unit_norm_beyond_float32_drops_the_update_loudly"
    ],
    "tests/models/test_model.py": ["test_partial_window_applied_at_epoch_end_with_adam"],
    "tests/profiling/test_profiling.py": [
        "test_keras_tape_watches_frozen_variables_fastgrad_does_not"
    ],
}
for _path, _names in _MOVED_FOR_TIME.items():
    for _name in _names:
        _BY_FILE.setdefault(_path, {}).setdefault(_name, _TIME)

FULL_TESTS = {(path, name): why for path, tests in _BY_FILE.items() for name, why in tests.items()}


# Files both backends run that belong to the full tier on TensorFlow alone
# (under JAX, the only run CI makes is the fast tier): their TensorFlow run
# repeats what TensorFlow's own files check in the fast tier, or needs
# KerasHub (installed for TensorFlow's full tier, README "Tests"; by
# docs/jax.md's install line for the JAX run). With why.
FULL_ON_TENSORFLOW = {
    "tests/end_to_end/test_lora.py": "KerasHub (LoRA on a BERT backbone)",
    "tests/step/test_micro_batches.py": "micro-batches vs the big batch: tests/step/test_slicing.py",
    "tests/callbacks/test_plain_callbacks.py": "a plain fit's callbacks: tests/callbacks/test_callbacks.py",
    "tests/step/test_adaptive_clipping_paper.py": (
        "AGC vs the paper: tests/end_to_end/test_adaptive_clipping_fit.py"
    ),
}


def is_full(path, name, slow, backend="tensorflow"):
    """Whether the test `name` (its function's name, without the
    parametrization) of the file `path` (relative to the repository, with
    `/`) is in the full tier under `backend`; `slow`: it carries the `slow`
    mark."""
    return (
        slow
        or path in FULL_FILES
        or (path, name) in FULL_TESTS
        or (backend == "tensorflow" and path in FULL_ON_TENSORFLOW)
    )


# Which backend collects a file (conftest.py's `pytest_ignore_collect`):
# both, unless the file says otherwise where pytest need not import it to
# read it (the other backend's venv may lack what it imports: README's
# TensorFlow venv has no `jax`, docs/jax.md's JAX venv no `tensorflow`):
# 1. a module-level `pytestmark` holding `pytest.mark.tensorflow_only` or
#    `pytest.mark.jax_only` (with its reason): that backend alone;
# 2. a test file named `test_<topic>_jax.py`: JAX alone (the JAX step's
#    own tests; a TensorFlow counterpart, if any, is `test_<topic>.py`);
# 3. a module of a shell, `keras_fastgrad/backend/tensorflow/` or
#    `keras_fastgrad/backend/jax/` (their doctests): that backend alone;
# 4. an `import` of `tensorflow` (or `keras_fastgrad._tf_startup`, its
#    stand-in) or of `jax` at the top level: that
#    backend alone.
# A test of a file both backends collect that exists on one backend alone
# carries the mark itself (conftest.py skips it on the other, with its
# reason).
_TENSORFLOW_MODULES = ("tensorflow", "keras_fastgrad._tf_startup")  # (tools/step_lines.py's)
_JAX_MODULES = ("jax", "jaxlib")
_SHELLS = {"keras_fastgrad/backend/tensorflow/": "tensorflow", "keras_fastgrad/backend/jax/": "jax"}


def only_backend(path, source):
    """`"tensorflow"`, `"jax"` or `None` (both): the backend that alone
    collects the module `path` (with `/`) of text `source` (the rules
    above)."""
    import ast

    body = ast.parse(source).body
    for node in body:
        targets = getattr(node, "targets", [])
        if isinstance(node, ast.Assign) and any(
            getattr(t, "id", "") == "pytestmark" for t in targets
        ):
            marks = ast.unparse(node.value)
            if "mark.tensorflow_only" in marks:
                return "tensorflow"
            if "mark.jax_only" in marks:
                return "jax"
    name = path.rsplit("/", 1)[-1]
    if name.startswith("test_") and name.endswith("_jax.py"):
        return "jax"
    for folder, backend in _SHELLS.items():
        if f"/{folder}" in f"/{path}":
            return backend
    within = lambda name, roots: any(name == r or name.startswith(r + ".") for r in roots)
    for node in body:
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        if any(within(n, _TENSORFLOW_MODULES) for n in names):
            return "tensorflow"
        if any(within(n, _JAX_MODULES) for n in names):
            return "jax"
    return None
