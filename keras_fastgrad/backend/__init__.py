"""Which Keras backend the step runs on: its shell, picked once, and what
each backend refuses.

`keras_fastgrad` runs its own train step on Keras' TensorFlow backend and on
Keras' JAX backend. `FastGradModel` calls its backend's shell through
`shell()`, picked once as Keras' `models/model.py` picks its trainer: the
module `keras_fastgrad.backend.tensorflow.trainer` or
`keras_fastgrad.backend.jax.trainer`, each defining every name of
`keras_fastgrad.step.trainer.SHELL_ENTRY_POINTS` with the same contract.

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
    implement (`step.trainer.check_options`, from the support record).

    Args:
        options: Dict of `FastGradModel`'s options.
        defaults: Dict of their default values.

    Raises:
        NotImplementedError: naming the option.
    """
    core.check_options(options, defaults, shell().NAME)


def check_telemetry_keys(keys):
    """Refuses the telemetry keys the backend's step does not measure: none
    at present, on either backend (every key is measured on both)."""
    del keys


def check_callback(callback, model=None):
    """Refuses a keras_fastgrad callback the backend's step does not serve
    (`step.trainer.check_callback`, from the support record; none at
    present).

    Raises:
        NotImplementedError: naming the callback.
    """
    core.check_callback(callback, model, shell().NAME)
