"""Which Keras backend the step runs on, and what each one refuses.

`keras_fastgrad` runs its own train step on Keras' TensorFlow backend
(`keras_fastgrad.step`) and on Keras' JAX backend
(`keras_fastgrad.backend.jax.step`: a stateless `train_step(state, data)` in
the manner of Keras' JAX trainer). What each backend supports is one
record, `keras_fastgrad.backend.support.BACKEND_SUPPORT` (docs/jax.md shows
it); on JAX what it marks refused is refused by name, with the error its row
makes (`support.refusal`), when the model is built, compiled or trained, or
when a callback is attached: it never trains differently from TensorFlow in
silence.
"""

import keras

from keras_fastgrad.backend.support import refusal

# The options whose non-default values the JAX step does not implement (each
# needs its row in `support.BACKEND_SUPPORT`, keyed by the option's name).
_JAX_REFUSED_OPTIONS = ()

# The keras_fastgrad callbacks the JAX step does not serve (each needs its row,
# keyed by the callback's class name).
_JAX_REFUSED_CALLBACKS = ()


def is_jax():
    """Whether Keras runs on its JAX backend (Python bool)."""
    return keras.backend.backend() == "jax"


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
            raise refusal(name, f"{name}={options[name]!r}")


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
        raise refusal("distribution", f"distribution={type(distribution).__name__}(...)")
    check_telemetry_keys(model.fastgrad_step_state.log_keys)
    optimizer = model.optimizer
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if getattr(inner, "loss_scale_factor", None) is not None:
        raise refusal("loss_scale_factor", f"loss_scale_factor={inner.loss_scale_factor!r}")


def check_telemetry_keys(keys):
    """Refuses, on JAX, the telemetry keys the JAX step does not measure
    (none at present: the multi-task keys come with `multitask`, as on
    TensorFlow); a no-op on TensorFlow.

    Raises:
        NotImplementedError: naming the keys.
    """
    del keys  # every key is measured on JAX


def check_callback(callback, model=None):
    """Refuses, on JAX, the callbacks of `_JAX_REFUSED_CALLBACKS` (none at
    present), and every callback on a plain model's `fit` under a
    `keras.distribution`; a no-op on TensorFlow. (On a plain model's `fit` they attach the step as on
    TensorFlow: `models.adapt`.)

    Raises:
        NotImplementedError: naming the callback.
    """
    if not is_jax():
        return
    name = type(callback).__name__
    if name in _JAX_REFUSED_CALLBACKS:
        raise refusal(name, f"{name}(...)")
    plain = model is not None and not any(
        c.__name__ == "FastGradModel" for c in type(model).__mro__
    )
    distribution = keras.distribution.distribution()
    if plain and distribution is not None:  # its sharded state: untested
        raise refusal(
            "plain_fit_under_distribution",
            f"{name}(...) with distribution={type(distribution).__name__}(...)",
        )
