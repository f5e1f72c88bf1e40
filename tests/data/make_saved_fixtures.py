"""Writes the `.keras` / `.weights.h5` fixtures that later releases must
keep loading (run with the release named in the file names' README entry).

    PYTHONPATH=<checkout of that release> python tests/data/make_saved_fixtures.py

Each file holds a small model trained on `fixture_data()` (below, copied in
the test that reads it) for 3 batches of 2 rows, with `accumulation_steps=2`:
a window half full, so loading must resume the window.
"""

import os
import sys

import keras
import numpy as np

import keras_fastgrad


def fixture_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 3)).astype("float32")
    y = rng.normal(size=(8, 1)).astype("float32")
    return x, y


def mid_window_model():
    keras.utils.set_random_seed(7)
    inputs = keras.Input((3,))
    h = keras.layers.Dense(4, activation="tanh")(inputs)
    model = keras_fastgrad.FastGradModel(inputs, keras.layers.Dense(1)(h), accumulation_steps=2)
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    x, y = fixture_data()
    for i in range(3):
        model.train_on_batch(x[2 * i:2 * i + 2], y[2 * i:2 * i + 2])
    return model


if __name__ == "__main__":
    out = os.path.dirname(os.path.abspath(__file__))
    tag = sys.argv[1]
    model = mid_window_model()
    model.save(os.path.join(out, f"mid_window_{tag}.keras"))
    model.save_weights(os.path.join(out, f"mid_window_{tag}.weights.h5"))
    print("saved", keras_fastgrad.__file__)
