"""The models beyond the MLP that the JAX distribution tests train
(`test_data_parallel_jax.py`, `test_model_parallel_jax.py`): a masked
GRU (per-timestep masked loss), a per-pixel Conv2D, an Embedding model,
a `keras.Sequential` and a subclass with a training-only branch, on rows
and windows both tests share. Imported inside their device processes."""

import numpy as np

ROWS = 40
WINDOWS = [(0, 16), (16, 32), (32, 40)]
EPOCHS = 2


def lengths():
    """The masked GRU's unmasked timesteps a row: in each window the first
    micro-batch's rows are short, the second's long, and each device's 4
    rows of a micro-batch hold a different count from the other's."""
    short, long = [1, 2, 1, 3, 2, 1, 1, 2], [7, 5, 6, 7, 4, 6, 7, 5]
    return np.array(short + long + short[::-1] + long[::-1] + [3, 7, 1, 6, 2, 5, 4, 7])


def model_case(name):
    """`(builder, x, y)`: a builder takes `keras.Model` (the plain model)
    or `FastGradModel` and its options; the same initial weights each call."""
    import keras

    from tests import helpers

    rng = np.random.default_rng(5)
    n = ROWS
    if name == "masked_gru":  # right padding (zeros): the loss is masked
        x = rng.integers(1, 20, size=(n, 7))
        x[np.arange(7)[None, :] >= lengths()[:, None]] = 0
        y = rng.normal(size=(n, 7, 3)).astype("float32")
        return (lambda cls, **o: helpers.masked_gru(cls, sequences=True, **o)), x.astype("int32"), y
    if name == "per_pixel_conv":
        x = rng.normal(size=(n, 6, 6, 2)).astype("float32")
        return helpers.conv, x, rng.normal(size=(n, 6, 6, 1)).astype("float32")
    if name == "embedding":
        x = rng.integers(0, 30, size=(n, 5)).astype("int32")
        return helpers.embedding, x, rng.normal(size=(n, 3)).astype("float32")
    x, y = helpers.uneven_data()
    if name == "sequential":
        return helpers.sequential_16, x[:n], y[:n]
    x, y = x[:n, :4], y[:n, :1]

    def training_branch(cls, **options):
        keras.utils.set_random_seed(0)
        model = (helpers.TrainingBranch if cls is keras.Model else helpers.FGTrainingBranch)(
            **options
        )
        # Its training-only branch built too: Keras' JAX trainer cannot
        # create a layer's weights inside its traced step.
        model(x[:1], training=True)
        return model

    return training_branch, x, y
