"""Which Keras backend the step runs on: its shell, picked once, and what
each backend refuses.

`keras_fastgrad` runs its own train step on Keras' TensorFlow backend and on
Keras' JAX backend. `FastGradModel` calls its backend's shell through
`shell()`, picked once as Keras' `models/model.py` picks its trainer: the
module `keras_fastgrad.backend.tensorflow.trainer` or
`keras_fastgrad.backend.jax.trainer`, each defining every name of
`SHELL_ENTRY_POINTS` with the same contract.

What each backend supports is one record,
`keras_fastgrad.step.support.BACKEND_SUPPORT` (docs/jax.md shows it); on
JAX what it marks refused is refused by name, with the error its row makes
(`support.refusal`), when the model is built, compiled or trained, or when a
callback is attached: it never trains differently from TensorFlow in
silence.
"""

import functools

import keras

from keras_fastgrad.step import trainer as core

# The options whose non-default values the JAX step does not implement (each
# needs its row in `support.BACKEND_SUPPORT`, keyed by the option's name).
_JAX_REFUSED_OPTIONS = ()

# The keras_fastgrad callbacks the JAX step does not serve (each needs its row,
# keyed by the callback's class name).
_JAX_REFUSED_CALLBACKS = ()

# What each shell's `trainer` module defines (same names, same contracts):
SHELL_ENTRY_POINTS = (
    "NAME",  # "tensorflow" or "jax": the Keras backend it runs on
    "STEP_UNIT_CLASSES",  # (telemetry, divergence) classes for `StepState`
    "BUILDS_BEFORE_FIT",  # whether `fit` builds the model before its train function
    "LOSS_SCALING",  # the loss scaling unit's class (`StepState.scaling`)
    "STATE_METHODS",  # Keras' trainer methods reading the state between batches
    "TAPE",  # whether gradients come from a tape watching a subset of variables
    "RECOMPILES_UNTRACED",  # whether a new input shape recompiles without a retrace
    "MULTITASK",  # `TaskMerger`'s primitives (the protocol in `multitask.merger`)
    "loss_tracker",  # (streak) -> the `loss` metric, NaN while micro-batches drop
    "make_train_function",  # (model, make, force) -> Keras' train function, the step in it
    "train_step",  # (model, *Keras' train_step arguments) -> the step's result
    "apply_partial_window",  # (compiled model) -> the pending window applied, its logs
    "with_divergence_stop",  # (model, args, kwargs) -> `fit`'s arguments, the stop added
    "arrays_kept_for_a_refusal",  # (model) -> what `fit` gives back if tracing raises
    "step_variables",  # (model) -> the step's variables Keras must thread
    "tape_variable_count",  # (model) -> variables differentiated, or None
    "trace_count",  # (the compiled step function) -> times traced/compiled
)


def is_jax():
    """Whether Keras runs on its JAX backend (Python bool)."""
    return keras.backend.backend() == "jax"


@functools.lru_cache(maxsize=None)
def shell():
    """The shell of the backend Keras runs on (its `trainer` module).

    Returns:
        The module `keras_fastgrad.backend.jax.trainer` on Keras' JAX
        backend, else `keras_fastgrad.backend.tensorflow.trainer`: the same
        module on every call (Keras' backend is fixed when Keras is
        imported).
    """
    if is_jax():
        from keras_fastgrad.backend.jax import trainer
    else:
        from keras_fastgrad.backend.tensorflow import trainer
    return trainer


def check_options(options, defaults):
    """Refuses the options (checked, by name) the backend's step does not
    implement (on JAX: `_JAX_REFUSED_OPTIONS`; `step.trainer.check_options`).

    Args:
        options: Dict of `FastGradModel`'s options.
        defaults: Dict of their default values.

    Raises:
        NotImplementedError: naming the option.
    """
    refused = _JAX_REFUSED_OPTIONS if is_jax() else ()
    core.check_options(options, defaults, refused)


def check_telemetry_keys(keys):
    """Refuses the telemetry keys the backend's step does not measure: none
    at present, on either backend (every key is measured on both)."""
    del keys


def check_callback(callback, model=None):
    """Refuses a keras_fastgrad callback the backend's step does not serve:
    on JAX, those of `_JAX_REFUSED_CALLBACKS` (none at present)
    (`step.trainer.check_callback`).

    Raises:
        NotImplementedError: naming the callback.
    """
    refused = _JAX_REFUSED_CALLBACKS if is_jax() else ()
    core.check_callback(callback, model, refused, shell().NAME)
