"""What each Keras backend supports: one record, read by the refusals and
shown by the docs.

`BACKEND_SUPPORT` is a tuple of `Feature` rows (what a user sets or calls,
what the TensorFlow step does with it, what the JAX step does). The JAX
refusals raise the error `refusal(key, received)` builds from their row, so
an error says what the row says; `markdown_table()` renders the rows for
docs/jax.md and `summary()` the differences for the README
(`tests/test_backend_support.py` checks both copies against these rows and
every refusal the code raises against the rows' keys).

This module imports nothing: the documentation's checks read it without
Keras.
"""

import dataclasses

SUPPORTED = "supported"
REFUSED = "refused, by name"
NOT_TESTED = "not tested"


@dataclasses.dataclass(frozen=True)
class Feature:
    """One row: a feature and what each backend does with it.

    Attributes:
        feature: Markdown, what a user sets or calls.
        tensorflow: `SUPPORTED`, `REFUSED`, `NOT_TESTED` or a few words.
        jax: The same, on Keras' JAX backend.
        note: Markdown, the limits, or a refusal's reason.
        key: A refusal's name in the code (`refusal(key, ...)`), or `""`.
        fix: A refusal's own fix, offered before the generic one, or `""`.
    """

    feature: str
    tensorflow: str = "supported"  # (SUPPORTED, spelled out for the API page)
    jax: str = "supported"
    note: str = ""
    key: str = ""
    fix: str = ""


BACKEND_SUPPORT = (
    Feature(
        "`accumulation_steps`, `apply_partial_window`",
        note="exact: uneven and partial windows, sample weights, masked and per-pixel losses",
    ),
    Feature("`clip_norm`, `clip_adaptive`, `clip_adaptive_eps`"),
    Feature("`skip_nonfinite`, `max_consecutive_nonfinite`"),
    Feature("`LossScaleOptimizer`, `mixed_float16`"),
    Feature(
        "an optimizer's fixed `loss_scale_factor`",
        jax=REFUSED,
        note="not implemented in the JAX step yet (`LossScaleOptimizer` is)",
        key="loss_scale_factor",
    ),
    Feature("`micro_batches`", note="exact: the whole batch's gradient, one update"),
    Feature('`batchnorm_statistics` (`"window"`, `"micro_batch"`)'),
    Feature(
        "`multitask` (every aggregator, parameter and features space) and its `task_*` keys",
        note="with `accumulation_steps`; with `micro_batches` in parameter space (features "
        "space refuses slices on both backends)",
    ),
    Feature(
        "`telemetry`, `enable_telemetry`: the keys of `LOG_KEYS`, `grad_norm/<layer>`, "
        "`update_ratio`, `agc_clipped_fraction`",
        note="`tape_variables` on JAX: the trainable variables the gradient is taken for",
    ),
    Feature(
        "the gradient noise scale (`gns_*` keys, `GradientNoiseScale`)",
        jax="with `accumulation_steps` >= 2",
        note="on JAX the small batches are the window's micro-batches only, not "
        "`micro_batches` slices nor devices; without a second batch size it is refused, "
        "naming `accumulation_steps` (as on TensorFlow)",
    ),
    Feature(
        "the callbacks `GradientNormLogger`, `NonFiniteGuard`, `TapeVariableCounter`, "
        "`RetraceWatch`, on a `FastGradModel` and on a plain model's `fit`"
    ),
    Feature(
        "the callbacks on a plain Keras model's `fit` under a `keras.distribution`",
        tensorflow=NOT_TESTED,
        note="on JAX equal to the same `fit` on one device (`DataParallel` on 2 host "
        "devices, `ModelParallel` on a 2 x 4 mesh); on TensorFlow use `tf.distribute`",
    ),
    Feature("`steps_per_execution`, `jit_compile`, `evaluate`, `train_on_batch`"),
    Feature(
        "saving: `.keras` and `.weights.h5` files, a pending window included",
        note="the files move between the backends",
    ),
    Feature(
        "`profile_step`",
        note='on JAX the `"function"` mode (`tf.function` without XLA) is reported as skipped',
    ),
    Feature(
        "`tf.distribute` (`MirroredStrategy`, `MultiWorkerMirroredStrategy`)",
        jax="TensorFlow's API",
        note="equal to one device; several replicas need Keras >= 3.10; `jit_compile=True` "
        "on several local devices or several CPU replicas, and `steps_per_execution > 1` on "
        "several replicas, are refused by name (TensorFlow cannot run them)",
    ),
    Feature(
        "`keras.distribution.DataParallel`",
        tensorflow=NOT_TESTED,
        note="on JAX equal to one device (tested on 2 host devices); on TensorFlow use "
        "`tf.distribute`",
    ),
    Feature(
        "`keras.distribution.ModelParallel` (a `LayoutMap`)",
        tensorflow=NOT_TESTED,
        note="on JAX equal to one device (tested on a 2 x 4 mesh of 8 host devices); the "
        "window's sums are sharded as their variables, the norms and the finite check global",
    ),
    Feature(
        "the callbacks' `tensorboard_dir`",
        jax="needs TensorFlow installed",
        note="TensorFlow writes the events; without it an `ImportError` says so",
    ),
)

# The JAX refusals the code raises, by key.
JAX_REFUSALS = {row.key: row for row in BACKEND_SUPPORT if row.key}


def refusal(key, received):
    """The error for a feature the JAX step refuses, from its row.

    Args:
        key: String, the row's `key` (`JAX_REFUSALS`).
        received: String, what was received, e.g. `"loss_scale_factor=8.0"`.

    Returns:
        A `NotImplementedError` to raise.

    Example:

    >>> str(refusal("loss_scale_factor", "loss_scale_factor=8.0")).split(" (")[0]
    "An optimizer's fixed `loss_scale_factor`: not yet supported on Keras' JAX backend"
    """
    row = JAX_REFUSALS[key]
    return NotImplementedError(
        f"{row.feature[0].upper()}{row.feature[1:]}: not yet supported on Keras' JAX "
        f"backend ({row.note}). Received: {received} with keras.backend.backend()='jax'. "
        f"Fix: {row.fix}train with `KERAS_BACKEND=tensorflow`, or leave the option at its "
        "default. What each backend supports: docs/jax.md "
        "(`keras_fastgrad.step.support.BACKEND_SUPPORT`)."
    )


def markdown_table(rows=None):
    """The rows as a Markdown table (docs/jax.md shows it).

    Example:

    >>> print(markdown_table(BACKEND_SUPPORT[:1]).splitlines()[0])
    | feature | TensorFlow | JAX | note |
    """
    rows = BACKEND_SUPPORT if rows is None else rows
    lines = ["| feature | TensorFlow | JAX | note |", "|---|---|---|---|"]
    lines += [f"| {r.feature} | {r.tensorflow} | {r.jax} | {r.note} |" for r in rows]
    return "\n".join(lines)


def summary(rows=None):
    """Where JAX differs from TensorFlow, as a Markdown list (the README's).

    Example:

    >>> print(summary().splitlines()[0])
    On Keras' JAX backend everything runs as on TensorFlow, but:
    """
    rows = BACKEND_SUPPORT if rows is None else rows
    differ = [f"- {r.feature}: {r.jax};" for r in rows if r.jax != SUPPORTED]
    differ[-1] = differ[-1][:-1] + "."
    return "\n".join(["On Keras' JAX backend everything runs as on TensorFlow, but:", ""] + differ)
