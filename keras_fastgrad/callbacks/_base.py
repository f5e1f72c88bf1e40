"""Shared base of the FastGradModel callbacks: checks the model they are
attached to, asks its step for the telemetry keys they read, and holds the
argument checks they share (Keras-style messages)."""

import keras

# The argument checks the callbacks share live with the model's.
from keras_fastgrad._validation import (  # noqa: F401
    check_bool,
    check_choice,
    check_int,
    check_optional_path,
)

# The step's cumulative counters that callbacks difference between calls.
COUNTERS = ("updates", "clipped_updates", "nonfinite_count")


class FastGradCallback(keras.callbacks.Callback):
    """Base class of the callbacks that read `FastGradModel`'s telemetry.

    Subclasses list the step's log keys they need in `telemetry_keys`, or
    override `required_telemetry(model)` when the keys depend on the model
    (e.g. one `grad_norm/<layer>` key per layer), and read them from the
    `logs` of `on_train_batch_end` / `on_epoch_end`. Keras calls
    `set_model` before it builds the train function, so the step is traced
    with the keys already switched on. Counters in the logs are cumulative
    over the model's life: difference them between calls.

    Raises:
        ValueError: from `set_model` (at the start of `fit`) when the model
            is not a `FastGradModel`, or when `check_model` refuses it.

    Example:

    >>> import keras, numpy as np, keras_fastgrad
    >>> class UpdatesPerEpoch(keras_fastgrad.callbacks.FastGradCallback):
    ...     telemetry_keys = ("updates",)
    ...     def on_epoch_end(self, epoch, logs=None):
    ...         print(f"epoch {epoch}: {logs['updates']:.0f} updates so far")
    >>> inputs = keras.Input((2,))
    >>> model = keras_fastgrad.FastGradModel(
    ...     inputs, keras.layers.Dense(1)(inputs), accumulation_steps=2)
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> history = model.fit(np.ones((8, 2)), np.ones((8, 1)), batch_size=2,
    ...                     epochs=2, verbose=0, callbacks=[UpdatesPerEpoch()])
    epoch 0: 2 updates so far
    epoch 1: 4 updates so far
    """

    telemetry_keys = ()

    def required_telemetry(self, model):
        """The telemetry keys this callback reads from `model`'s logs."""
        return self.telemetry_keys

    def set_model(self, model):
        from keras_fastgrad.model import FastGradModel

        if not isinstance(model, FastGradModel):
            raise ValueError(
                f"`{type(self).__name__}` reads measurements made inside "
                "the train step of a `keras_fastgrad.FastGradModel`, but it "
                f"was attached to a `{type(model).__name__}`. Fix: build the "
                "model with `keras_fastgrad.FastGradModel(inputs, outputs)` "
                "(or subclass it) instead of `keras.Model`."
            )
        super().set_model(model)
        self.check_model(model)
        model.enable_telemetry(self.required_telemetry(model))

    def check_model(self, model):
        """Hook: raise if this callback's settings do not fit `model`."""


def read_counters(model):
    """The model's cumulative step counters now (`model.telemetry_counters`).

    Callbacks difference the counters between calls; this gives the value
    before the first call of a `fit`.
    """
    counters = model.telemetry_counters()
    return {name: counters[name] for name in COUNTERS}
