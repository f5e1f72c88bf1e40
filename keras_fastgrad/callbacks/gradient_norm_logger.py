"""`GradientNormLogger`: puts the step's gradient norm into the logs."""

import keras

from keras_fastgrad.callbacks._base import FastGradCallback


class GradientNormLogger(FastGradCallback):
    """Logs `grad_norm`: the global L2 norm, before clipping, of the gradient
    of the model's most recent optimizer update.

    The value is computed inside the compiled train step (graph mode and
    XLA alike) and arrives with the step's logs, so it shows in the progress
    bar, `History` and `CSVLogger` without any extra pass over the data.

    Example:

    >>> inputs = keras.Input((2,))
    >>> model = keras_fastgrad.FastGradModel(inputs, keras.layers.Dense(1)(inputs))
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> history = model.fit(np.ones((4, 2)), np.zeros((4, 1)), verbose=0,
    ...                     callbacks=[GradientNormLogger()])
    >>> "grad_norm" in history.history
    True
    """

    telemetry_keys = ("grad_norm",)
