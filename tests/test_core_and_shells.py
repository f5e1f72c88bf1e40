"""The step's layout, checked (docs/architecture.md): the backend-neutral
core imports neither TensorFlow nor JAX, nor a shell; each rule of the step
is defined in the core and in no shell; the architecture page quotes the
figures `tools/step_lines.py` prints for the tree as it is."""

import ast
import importlib.util
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = REPO / "keras_fastgrad"

# The backend-neutral core: every decision of the step.
CORE = (
    "keras_fastgrad/step",
    "keras_fastgrad/maths",
    "keras_fastgrad/aggregators",
    "keras_fastgrad/multitask",
)
# The shells: how the step runs on each backend.
SHELLS = ("keras_fastgrad/backend/tensorflow", "keras_fastgrad/backend/jax")
# What a core module may not import (a shell imports its backend).
BACKEND_MODULES = (
    "tensorflow",
    "jax",
    "keras_fastgrad._tf_startup",
    "keras_fastgrad.backend.tensorflow",
    "keras_fastgrad.backend.jax",
)

# Each rule of the step (issue 50's list): the core module that decides it
# and the names it defines there. A shell module defines none of these names
# but to hand the rule to the core (an alias, or a function calling the
# core's function of that name with the backend's primitives).
RULES = {
    "which micro-batch is kept or dropped, and whether an update is checked": [
        (
            "keras_fastgrad.step.verdict",
            ("Verdict", "checks", "checks_norm", "norm_finite", "keep", "update_check"),
        ),
    ],
    "what counts towards the streak, the divergence stop, the NaN loss": [
        (
            "keras_fastgrad.step.divergence",
            ("counts_as_failure", "streak_after", "diverged", "loss_result"),
        ),
    ],
    "each micro-batch's weight": [
        ("keras_fastgrad.step.weighting", ("LossShares", "forward_with_share", "weighed_loss")),
        ("keras_fastgrad.maths.weighting", ("normaliser", "share_of")),
    ],
    "the window: its division, when it is complete, what a partial one does": [
        (
            "keras_fastgrad.step.accumulation",
            ("WindowState", "MicroBatch", "added", "is_complete", "applies", "window_gradient")
            + ("emptied", "restarted", "pending", "closes", "flushed"),
        ),
    ],
    "micro_batches: the slices, their weights and sums": [
        ("keras_fastgrad.step.splitting", ("SlicePlan", "plan", "slice_sizes")),
        (
            "keras_fastgrad.step.slicing",
            ("SliceTotals", "add_slice", "batch_normaliser", "batch_loss", "batch_gradient")
            + ("slice_losses", "surplus_regularization", "slice_loss", "slice_terms")
            + ("SlicedBatch", "after_slices", "weight_penalty"),
        ),
    ],
    "the loss's terms beyond the output losses: told apart, weighted or refused": [
        (
            "keras_fastgrad.step.compile_loss",
            ("loss_terms", "present_terms", "check_extra_terms", "check_present_terms"),
        ),
    ],
    "the clip factors, global and adaptive": [
        (
            "keras_fastgrad.maths.norms",
            ("scaled_norm", "clip", "clip_factor", "fits_clip", "fitted"),
        ),
        ("keras_fastgrad.maths.adaptive_clipping", ("clip_weight", "clip_unitwise")),
        (
            "keras_fastgrad.step.adaptive_clipping",
            ("clip", "clipped_fraction", "before_gate", "counted_at_verdict") + ("both_finite",),
        ),
    ],
    "the update's order: divide, noise record, AGC, clip, check, apply or drop, records": [
        ("keras_fastgrad.step.update", ("Prepared", "prepare", "apply_or_drop", "recorded")),
    ],
    "a micro-batch before its update: what is kept, where its drop is recorded, what it records": [
        (
            "keras_fastgrad.step.micro_batch",
            ("kept", "grows_per_micro_batch", "drop_place", "dropped", "before_update"),
        ),
    ],
    "the loss-scale rule": [("keras_fastgrad.maths.loss_scale", ("next_scale",))],
    "BatchNorm pooling": [
        (
            "keras_fastgrad.step.batchnorm",
            ("pools_window", "pooled_over_replicas", "completes_window"),
        ),
        ("keras_fastgrad.maths.batchnorm", ("pooled", "momentum_step")),
    ],
    "the noise-scale estimators": [
        (
            "keras_fastgrad.step.noise_scale",
            ("Estimates", "after_window", "measurable", "small_batch_of"),
        ),
        ("keras_fastgrad.maths.noise_scale", ("estimate", "window_estimate", "moving_averages")),
    ],
    "the telemetry counters and keys": [
        (
            "keras_fastgrad.step.telemetry",
            ("LOG_KEYS", "Counters", "dropped", "dropped_update", "updated", "input_shape")
            + ("measures_after", "counts_nonfinite", "locates_nonfinite", "location")
            + ("Change", "micro_batch_dropped", "update_applied", "update_dropped")
            + ("counted_once", "apply_change", "partial_window_keys"),
        ),
    ],
    "the multi-task merge": [
        (
            "keras_fastgrad.step.multitask",
            ("TaskMerge", "merge", "reaching_of", "keep_state", "next_state")
            + ("task_telemetry", "task_logs", "logged_task_keys")
            + ("merge_features", "features_gram", "features_cotangents"),
        ),
        ("keras_fastgrad.maths.multitask", ("gram", "split_by_reaching_tasks")),
    ],
    "the options as the step reads them": [("keras_fastgrad.step.options", ("StepOptions",))],
    "the options and their refusals": [
        (
            "keras_fastgrad.step.option_checks",
            ("checked_options", "check_option_values", "check_keyword_names")
            + ("check_accumulation_steps", "check_clip_norm", "check_clip_adaptive")
            + ("check_multitask", "check_multitask_space", "check_batchnorm_statistics"),
        ),
        ("keras_fastgrad.step.compile_checks", ("check_compiled", "check_optimizer_ownership")),
    ],
    "the refusals, and the divergence stop added to `fit`": [
        (
            "keras_fastgrad.step.trainer",
            ("refuses", "check_options", "check_callback", "check_model", "check_strategy")
            + ("check_trainable_unchanged", "with_divergence_stop"),
        ),
    ],
}


def _step_lines():
    spec = importlib.util.spec_from_file_location("step_lines", REPO / "tools" / "step_lines.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _modules(folders):
    return sorted(p for folder in folders for p in (REPO / folder).rglob("*.py"))


def backend_imports(source):
    """The backend or shell modules `source` imports (sorted)."""
    return sorted(
        name
        for name in _step_lines().imported(source)  # (every import, function-level too)
        if any(name == b or name.startswith(b + ".") for b in BACKEND_MODULES)
    )


def defined_names(source):
    """The names a module defines at its top level (functions, classes,
    assignments)."""
    return set(_definitions(source))


def _definitions(source):
    """`{name: node}` of a module's top-level definitions."""
    found = {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found.update((t.id, node) for t in targets if isinstance(t, ast.Name))
    return found


def _delegates(name, node):
    """Whether a shell's definition of `name` hands the rule to the core:
    an alias of it (`name = core.name`), or a function that calls
    `<module>.name(...)` (passing the backend's primitives in)."""
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        return isinstance(node.value, ast.Attribute) and node.value.attr == name
    return any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == name
        for n in ast.walk(node)
    )


def shell_rules(source, names):
    """The rule `names` a shell module defines without delegating to the
    core (sorted)."""
    found = _definitions(source)
    return sorted(n for n in names if n in found and not _delegates(n, found[n]))


def test_the_checkers_find_planted_violations():
    planted = (
        "import numpy\n"
        "from keras_fastgrad._tf_startup import tf\n"
        "def f():\n"
        "    import jax.numpy as jnp\n"
        "    from keras_fastgrad.backend.tensorflow import slicing\n"
        "window_weight = 1\n"
        "class Verdict: pass\n"
    )
    assert backend_imports(planted) == [
        "jax.numpy",
        "keras_fastgrad._tf_startup",
        "keras_fastgrad._tf_startup.tf",
        "keras_fastgrad.backend.tensorflow",
        "keras_fastgrad.backend.tensorflow.slicing",
    ]
    assert defined_names(planted) == {"f", "window_weight", "Verdict"}
    shell = (
        "from keras_fastgrad.step import accumulation as rules\n"
        "is_last = rules.is_last\n"
        "def window_gradient(acc):\n"
        "    return rules.window_gradient(acc.sums, acc.n, True, tf.math.divide_no_nan)\n"
        "def is_complete(step, steps):\n"
        "    return step + 1 >= steps\n"
    )
    names = ("is_last", "window_gradient", "is_complete", "added")
    assert shell_rules(shell, names) == ["is_complete"]
    assert backend_imports("import keras\nfrom keras import ops\nimport jaxtyping\n") == []


@pytest.mark.parametrize("path", _modules(CORE), ids=lambda p: p.relative_to(REPO).as_posix())
def test_a_core_module_imports_no_backend_and_no_shell(path):
    found = backend_imports(path.read_text())
    assert not found, (
        f"{path.relative_to(REPO)} is in the backend-neutral core ({', '.join(CORE)}) "
        f"but imports {found}. Fix: write the rule with `keras.ops` (or take the "
        "backend's primitive as an argument) and move what only one backend does "
        f"to its shell ({', '.join(SHELLS)})."
    )


def _misplaced(rule, module, names, shells):
    """What is wrong with where `rule`'s `names` are defined: `module` is
    not a core module or lacks one; a shell (`{path: names}`) defines one."""
    path = REPO / (module.replace(".", "/") + ".py")
    if not any(path.is_relative_to(REPO / c) for c in CORE):
        return [f"{rule}: {module} is not a core module"]
    found = []
    missing = set(names) - defined_names(path.read_text())
    if missing:
        found.append(f"{rule}: {module} defines no {sorted(missing)}")
    for shell, source in shells.items():
        again = shell_rules(source, names)
        if again:
            found.append(f"{rule}: {shell.relative_to(REPO)} defines {sorted(again)} again")
    return found


def test_the_rule_checker_finds_a_rule_written_in_a_shell():
    shell = REPO / "keras_fastgrad/backend/jax/window.py"
    found = _misplaced(
        "the window",
        "keras_fastgrad.step.accumulation",
        ("is_complete",),
        {shell: "def is_complete(step, steps):\n    return step + 1 >= steps\n"},
    )
    assert found == [
        "the window: keras_fastgrad/backend/jax/window.py defines ['is_complete'] again"
    ]
    assert _misplaced("x", "keras_fastgrad.backend.jax.window", ("f",), {}) == [
        "x: keras_fastgrad.backend.jax.window is not a core module"
    ]


def test_every_rule_is_defined_in_the_core_and_in_no_shell():
    shells = {p: p.read_text() for p in _modules(SHELLS)}
    problems = []
    for rule, places in RULES.items():
        for module, names in places:
            problems.extend(_misplaced(rule, module, names, shells))
    assert not problems, (
        "Each rule of the step is written once, in the core, and called by the "
        "shells: " + "; ".join(problems)
    )


def test_the_line_counter_counts_code_lines_only():
    step_lines = _step_lines()
    source = (
        '"""Module\ndocstring."""\n\n'
        "# a comment\n"
        "import jax\n"
        "def f(x):\n"
        '    """Doc."""\n'
        "    return x  # trailing\n"
    )
    assert step_lines.code_lines(source) == 3
    assert step_lines.backend_of(source) == "jax"
    assert step_lines.backend_of("def g():\n    import tensorflow as tf\n") == "tensorflow"
    assert step_lines.backend_of("from keras_fastgrad._tf_startup import tf\n") == "tensorflow"
    assert step_lines.backend_of("import keras\n") == "neither"


def test_the_architecture_page_quotes_the_current_figures():
    step_lines = _step_lines()
    rows, totals = step_lines.count()
    share = f"{totals['neither'] / sum(totals.values()):.1%}"
    page = (REPO / "docs" / "architecture.md").read_text()
    outside = f"{step_lines.neutral_outside_shells(rows) / sum(totals.values()):.1%}"
    expected = [share, outside] + [
        f"{step_lines.shell_lines(rows, shell)} lines" for shell in ("tensorflow", "jax")
    ]
    missing = [text for text in expected if text not in page]
    assert not missing, (
        f"docs/architecture.md does not quote {missing} (`python tools/step_lines.py` "
        "prints them for the tree as it is). Fix: update the page's figures."
    )
