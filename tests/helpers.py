"""Small models and data shared by the tests. References are plain
`keras.Model`s built with the same initial weights."""

import keras
import numpy as np
import pytest

import keras_fastgrad
from keras_fastgrad import _keras_compat

# FastGradModel refuses several replicas on Keras < 3.10 (a clear error,
# tested in test_keras_compat.py); these tests need them.
needs_multi_replica_keras = pytest.mark.skipif(
    not _keras_compat.MULTI_REPLICA_SUPPORTED,
    reason=f"several replicas need Keras >= 3.10 (installed: {keras.__version__})",
)


def data(n=12, features=3, outputs=1, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    y = rng.normal(size=(n, outputs)).astype("float32")
    return x, y


def mlp(cls=keras.Model, features=3, outputs=1, seed=7, **options):
    """A two-layer MLP; the same `seed` gives the same initial weights."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((features,))
    hidden = keras.layers.Dense(5, activation="tanh", name="hidden")(inputs)
    out = keras.layers.Dense(outputs, name="out")(hidden)
    return cls(inputs, out, **options)


def fast(**options):
    return mlp(keras_fastgrad.FastGradModel, **options)


def max_weight_diff(a, b):
    return max(
        float(np.max(np.abs(x - y))) for x, y in zip(a.get_weights(), b.get_weights())
    )


def same_start(a, b):
    assert max_weight_diff(a, b) == 0.0


def pcgrad_np(J, orders):
    """Yu et al. (2020), Algorithm 1, on the gradient vectors themselves.

    `J` is T x P (one task gradient per row); `orders[i]` is the visiting
    order of the other tasks for task i. The merged gradient is the sum of
    the projected task gradients.
    """
    merged = np.zeros(J.shape[1])
    for i in range(len(J)):
        g = J[i].copy()
        for j in orders[i]:
            dot = g @ J[j]
            if dot < 0:
                g = g - dot / (J[j] @ J[j]) * J[j]
        merged += g
    return merged
