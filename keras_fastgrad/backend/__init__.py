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
`batchnorm_statistics="micro_batch"` (or BatchNorm without a split batch),
`steps_per_execution`, `jit_compile`, `evaluate`, `train_on_batch`, saving.
"""

import contextlib
import warnings

import keras

JAX_SUPPORTS = (
    "accumulation_steps, clip_norm, skip_nonfinite, max_consecutive_nonfinite, "
    "LossScaleOptimizer / mixed_float16, batchnorm_statistics='micro_batch', "
    "steps_per_execution, jit_compile, evaluate, train_on_batch, saving"
)

# The options whose non-default values the JAX step does not implement yet.
_JAX_REFUSED_OPTIONS = (
    "clip_adaptive",
    "multitask",
    "micro_batches",
    "telemetry",
)


def is_jax():
    """Whether Keras runs on its JAX backend (Python bool)."""
    return keras.backend.backend() == "jax"


@contextlib.contextmanager
def int64_as_int32():
    """Within the block, JAX's warning that an int64 variable is stored as
    int32 (64-bit types are off by default) is silenced: the step's counters
    (`micro_step`, `included_micro_batches`) are int64 on TensorFlow and
    int32 on JAX, which the files convert either way."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Explicitly requested dtype int64")
        yield


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
    from keras_fastgrad.step.batchnorm import pools_window

    if keras.distribution.distribution() is not None:
        raise not_on_jax(
            "A `keras.distribution` (data or model parallel)",
            f"distribution={keras.distribution.distribution()!r}",
        )
    if pools_window(model):
        raise not_on_jax(
            "BatchNorm window statistics (`batchnorm_statistics='window'`, "
            "the default, with `accumulation_steps` > 1 and a "
            "`BatchNormalization` layer)",
            f"batchnorm_statistics={model.batchnorm_statistics!r}, "
            f"accumulation_steps={model.accumulation_steps}",
            "pass `batchnorm_statistics='micro_batch'` (each micro-batch moves "
            "the moving statistics, as Keras' own accumulation does), or ",
        )
    keys = sorted(model.fastgrad_step_state.log_keys)
    if keys:  # `enable_telemetry`, the callbacks: their keys are not measured here
        raise not_on_jax("Telemetry keys in the step's logs", f"keys {keys}")
    optimizer = model.optimizer
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if getattr(inner, "loss_scale_factor", None) is not None:
        raise not_on_jax(
            "An optimizer's fixed `loss_scale_factor`",
            f"loss_scale_factor={inner.loss_scale_factor!r}",
        )


def check_callback(callback, model=None):
    """Refuses a keras_fastgrad callback on JAX (none is ported yet)."""
    if is_jax():
        raise not_on_jax(
            f"The callback `{type(callback).__name__}`", f"{type(callback).__name__}(...)"
        )
