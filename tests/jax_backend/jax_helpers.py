"""Models, data and the reference runs shared by tests/jax_backend."""

import os

import keras
import numpy as np

import keras_fastgrad as kf

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))  # the repo root: scripts import `tests.jax_backend`
ROWS = 58  # batches of 16: 16, 16, 16, 10 (an uneven last batch)


def data(seed=0, d_in=8, d_out=3):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(ROWS, d_in)).astype("float32")
    y = rng.normal(size=(ROWS, d_out)).astype("float32")
    return x, y


def mlp(cls=keras.Model, **options):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    h = keras.layers.Dense(16, activation="tanh")(inputs)
    return cls(inputs, keras.layers.Dense(3)(h), **options)


def masked_gru(cls=keras.Model, **options):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((7,), dtype="int32")
    h = keras.layers.Embedding(20, 8, mask_zero=True)(inputs)
    h = keras.layers.GRU(6)(h)
    return cls(inputs, keras.layers.Dense(3)(h), **options)


def conv(cls=keras.Model, **options):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6, 6, 2))
    h = keras.layers.Conv2D(4, 3, padding="same", activation="relu")(inputs)
    return cls(inputs, keras.layers.Conv2D(1, 1)(h), **options)


def embedding(cls=keras.Model, **options):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,), dtype="int32")
    h = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(30, 4)(inputs))
    return cls(inputs, keras.layers.Dense(3)(h), **options)


def max_diff(a, b):
    return max(
        float(np.max(np.abs(np.asarray(u) - np.asarray(v))))
        for u, v in zip(a.get_weights(), b.get_weights(), strict=True)
    )


def reference(build, x, y, epochs=2, batch_size=ROWS, sample_weight=None, loss="mse", **adam):
    """A plain `keras.Model` (same initial weights) trained on `batch_size`."""
    model = build(keras.Model)
    model.compile(keras.optimizers.Adam(1e-2, **adam), loss)
    model.fit(
        x,
        y,
        sample_weight=sample_weight,
        batch_size=batch_size,
        epochs=epochs,
        shuffle=False,
        verbose=0,
    )
    return model


def fastgrad_run(
    build,
    x,
    y,
    epochs=2,
    batch_size=16,
    sample_weight=None,
    loss="mse",
    optimizer=None,
    compile_kw=None,
    **options,
):
    model = build(kf.FastGradModel, **options)
    model.compile(optimizer or keras.optimizers.Adam(1e-2), loss, **(compile_kw or {}))
    history = model.fit(
        x,
        y,
        sample_weight=sample_weight,
        batch_size=batch_size,
        epochs=epochs,
        shuffle=False,
        verbose=0,
    )
    return model, history


def run_on_tensorflow(script, timeout=300):
    """Runs `script` in a fresh Python under `KERAS_BACKEND=tensorflow` (from
    the repository's root); fails the test with its stderr if it fails.
    Returns its stdout."""
    # (imported here: the scripts run on TF import this module with only
    # tests/jax_backend on their path)
    from tests.subprocesses import run_python

    env = {**os.environ, "KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "3"}
    return run_python(script, env, ROOT, timeout)
