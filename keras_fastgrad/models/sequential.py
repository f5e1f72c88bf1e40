"""`FastGradSequential`: the swap for `keras.Sequential`."""

import keras

from keras_fastgrad.models.model import FastGradModel


@keras.saving.register_keras_serializable(package="keras_fastgrad")
class FastGradSequential(FastGradModel, keras.Sequential):
    """A `keras.Sequential` with `FastGradModel`'s train step.

    Use it wherever you would use `keras.Sequential` (a list of layers,
    `add`, `pop`); the options are `FastGradModel`'s, with the same
    defaults: with none given it trains exactly like `keras.Sequential`.

    Args:
        layers: Optional list of layers, as for `keras.Sequential`.
        name: Optional name of the model.
        trainable: Boolean, as for `keras.Sequential`.
        **options: `FastGradModel`'s options (`accumulation_steps`,
            `clip_norm`, `clip_adaptive`, `clip_adaptive_eps`, `multitask`,
            `multitask_space`,
            `multitask_features`, `skip_nonfinite`, `micro_batches`,
            `max_consecutive_nonfinite`, `telemetry`, `batchnorm_statistics`).

    Raises:
        ValueError, TypeError: on invalid options, as `FastGradModel`.

    Example:

    >>> model = FastGradSequential(
    ...     [keras.Input((3,)), keras.layers.Dense(1)], accumulation_steps=2)
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> x, y = np.ones((8, 3)), np.zeros((8, 1))
    >>> history = model.fit(x, y, batch_size=2, epochs=1, verbose=0)
    >>> int(model.optimizer.iterations.numpy())  # 4 batches, 2 per update
    2
    >>> isinstance(model, keras.Sequential)
    True
    """

    def __init__(self, layers=None, trainable=True, name=None, **options):
        super().__init__(layers=layers, trainable=trainable, name=name, **options)

    def get_config(self):
        # `keras.Sequential`'s config (its layers), not Keras' automatic
        # config of constructor arguments (which layers are not).
        return super().get_config()


# For legacy `.h5` files (see the same alias in `model.py`).
keras.saving.get_custom_objects().setdefault("FastGradSequential", FastGradSequential)
