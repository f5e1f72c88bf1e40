"""Shared base of the FastGradModel callbacks: checks the model they are
attached to and asks its step for the telemetry keys they read."""

import keras


class FastGradCallback(keras.callbacks.Callback):
    """Base class of the callbacks that read `FastGradModel`'s telemetry.

    Subclasses list the step's log keys they need in `telemetry_keys`.
    """

    telemetry_keys = ()

    def set_model(self, model):
        super().set_model(model)
        from keras_fastgrad.model import FastGradModel

        if not isinstance(model, FastGradModel):
            raise ValueError(
                f"`{type(self).__name__}` reads measurements made inside "
                "the train step of a `keras_fastgrad.FastGradModel`, but it "
                f"was attached to a `{type(model).__name__}`. Fix: build the "
                "model with `keras_fastgrad.FastGradModel(inputs, outputs)` "
                "(or subclass it) instead of `keras.Model`."
            )
        model.enable_telemetry(self.telemetry_keys)
