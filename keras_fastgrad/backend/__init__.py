"""Which Keras backend the step runs on, and what each one supports.

`keras_fastgrad` runs its own train step on Keras' TensorFlow backend
(`keras_fastgrad.step`) and, for a first set of options, on Keras' JAX
backend (`keras_fastgrad.backend.jax_step`: a stateless
`train_step(state, data)` in the manner of Keras' JAX trainer). On JAX every
option or feature outside that set is refused by name, when the model is
built, compiled or trained, or when a callback is attached: it never trains
differently from TensorFlow in silence.

Supported on JAX: `accumulation_steps` (exact: uneven batches, sample
weights, masked and per-pixel losses, the partial window at an epoch's end,
`apply_partial_window`), `clip_norm`, `skip_nonfinite`,
`max_consecutive_nonfinite`, `LossScaleOptimizer` / `mixed_float16`,
`micro_batches` (exact, `keras_fastgrad.backend.jax_micro_batches`),
`clip_adaptive` (`keras_fastgrad.backend.jax_agc`),
`batchnorm_statistics` `"window"` (moved once per update from the
window's pooled moments, `keras_fastgrad.backend.jax_batchnorm`) and
`"micro_batch"`,
`steps_per_execution`, `jit_compile`, `evaluate`, `train_on_batch`, saving,
`telemetry` and `enable_telemetry` with the fixed keys (`LOG_KEYS`) and
the optional `grad_norm/<layer>`, `update_ratio`, `agc_clipped_fraction`
(`keras_fastgrad.backend.jax_telemetry`), the callbacks
`GradientNormLogger` (every option), `NonFiniteGuard`, `TapeVariableCounter` on a
`FastGradModel` and on a plain model's `fit` (the step attached for that
`fit`, `keras_fastgrad.models.adapt`), `RetraceWatch`, `profile_step`; the gradient noise scale (the `gns_*` keys,
`GradientNoiseScale`) with `accumulation_steps`, each micro-batch a small
batch (`keras_fastgrad.backend.jax_noise_scale`);
`keras.distribution.DataParallel` (the step's arrays are global: its sums,
counts and norms are the whole batch's; other distributions refused);
`multitask` in parameter and features space, with accumulation, and its
telemetry keys (`keras_fastgrad.backend.jax_multitask`, `jax_features`),
with `micro_batches` in parameter space (`jax_micro_batches`: the task
gradients summed over the slices, merged once).
"""

import keras

JAX_SUPPORTS = (
    "accumulation_steps, clip_norm, skip_nonfinite, max_consecutive_nonfinite, "
    "LossScaleOptimizer / mixed_float16, micro_batches, clip_adaptive, "
    "batchnorm_statistics='window' and 'micro_batch', "
    "steps_per_execution, jit_compile, evaluate, train_on_batch, saving, "
    "telemetry / enable_telemetry with the keys of LOG_KEYS, grad_norm/<layer>, "
    "update_ratio and agc_clipped_fraction, the callbacks "
    "GradientNormLogger, NonFiniteGuard, TapeVariableCounter (on a FastGradModel or "
    "a plain model's fit), RetraceWatch, profile_step, "
    "the gradient noise scale (gns_* keys, GradientNoiseScale) with accumulation_steps, "
    "keras.distribution.DataParallel, "
    "multitask (parameter and features space, with accumulation_steps; with micro_batches "
    "in parameter space) and its task_* telemetry keys"
)

# The options whose non-default values the JAX step does not implement yet.
_JAX_REFUSED_OPTIONS = ()

# The keras_fastgrad callbacks the JAX step does not serve yet (by name).
_JAX_REFUSED_CALLBACKS = ()


def is_jax():
    """Whether Keras runs on its JAX backend (Python bool)."""
    return keras.backend.backend() == "jax"


def not_on_jax(what, received, fix=""):
    """The error for a feature the JAX step does not support yet.

    Args:
        what: String, the option or feature, e.g. "`micro_batches`".
        received: String, what was received, e.g. "micro_batches=2".
        fix: String, a JAX fix to offer before the generic one.

    Returns:
        A `NotImplementedError` to raise.
    """
    return NotImplementedError(
        f"{what} is not yet supported on Keras' JAX backend (keras_fastgrad "
        f"supports on JAX: {JAX_SUPPORTS}). Received: {received} with "
        f"keras.backend.backend()='jax'. Fix: {fix}train with "
        "`KERAS_BACKEND=tensorflow`, or leave the option at its default."
    )


def check_options(options, defaults):
    """Refuses, on JAX, the options (checked, by name) the JAX step does not
    implement; a no-op on TensorFlow.

    Args:
        options: Dict of `FastGradModel`'s options.
        defaults: Dict of their default values.

    Raises:
        NotImplementedError: naming the option.
    """
    if not is_jax():
        return
    for name in _JAX_REFUSED_OPTIONS:
        if options[name] != defaults[name]:
            raise not_on_jax(f"`{name}`", f"{name}={options[name]!r}")


def check_model(model):
    """Refuses, on JAX, what a model that trains would need of the step
    beyond the supported set (read when the train function is made).

    Raises:
        NotImplementedError: naming the feature.
    """
    distribution = keras.distribution.distribution()
    # DataParallel: the step's arrays are global (sharded over the batch),
    # so its sums, counts and norms are the whole batch's as they stand.
    if distribution is not None and type(distribution) is not keras.distribution.DataParallel:
        raise not_on_jax(
            f"The `keras.distribution` `{type(distribution).__name__}` (only "
            "`DataParallel` is supported)",
            f"distribution={distribution!r}",
            "use `keras.distribution.DataParallel`, or ",
        )
    check_telemetry_keys(model.fastgrad_step_state.log_keys)
    optimizer = model.optimizer
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if getattr(inner, "loss_scale_factor", None) is not None:
        raise not_on_jax(
            "An optimizer's fixed `loss_scale_factor`",
            f"loss_scale_factor={inner.loss_scale_factor!r}",
        )


def check_telemetry_keys(keys):
    """Refuses, on JAX, the telemetry keys the JAX step does not measure
    (none at present: the multi-task keys come with `multitask`, as on
    TensorFlow); a no-op on TensorFlow.

    Raises:
        NotImplementedError: naming the keys.
    """
    del keys  # every key is measured on JAX


def check_callback(callback, model=None):
    """Refuses, on JAX, the callbacks not ported (`RetraceWatch`), and the
    others on a plain model's `fit` under a `keras.distribution`; a no-op
    on TensorFlow. (On a plain model's `fit` they attach the step as on
    TensorFlow: `models.adapt`.)

    Raises:
        NotImplementedError: naming the callback.
    """
    if not is_jax():
        return
    name = type(callback).__name__
    if name in _JAX_REFUSED_CALLBACKS:
        raise not_on_jax(f"The callback `{name}`", f"{name}(...)")
    plain = model is not None and not any(
        c.__name__ == "FastGradModel" for c in type(model).__mro__
    )
    distribution = keras.distribution.distribution()
    if plain and distribution is not None:  # its sharded state: untested
        raise not_on_jax(
            f"The callback `{name}` on a plain Keras model's `fit` under a `keras.distribution`",
            f"{name}(...) with distribution={distribution!r}",
            "build the model as a `keras_fastgrad.FastGradModel` (or "
            "`keras_fastgrad.fastgrad(model)`), which trains under `DataParallel`, or ",
        )
