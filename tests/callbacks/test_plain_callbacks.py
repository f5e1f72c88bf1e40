"""The callbacks on a plain model's `fit`, on both backends: the model
trains exactly as `keras.Model` does without them (the reference: the same
model, `fit` without callbacks), the logged values are those of numpy's
worked gradient, and after `fit` the model is the plain model it was
(its class, files, a later `fit` without callbacks)."""

import keras
import numpy as np
import pytest

import keras_fastgrad as kf
from tests.helpers import ROWS
from tests.helpers import max_weight_diff as max_diff
from tests.helpers import mlp_16 as mlp
from tests.helpers import uneven_data as data


def linear(cls=keras.Model):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    return cls(inputs, keras.layers.Dense(3)(inputs))


def sequential(cls=None):
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)]
    )


class Subclassed(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(16, activation="tanh")
        self.out = keras.layers.Dense(3)
        self.drop = keras.layers.Dropout(0.5, seed=1)

    def call(self, x, training=False):
        return self.out(self.drop(self.hidden(x), training=training))


def subclassed(cls=None):
    keras.utils.set_random_seed(0)
    return Subclassed()


def callbacks():
    return [
        kf.callbacks.GradientNormLogger(),
        kf.callbacks.NonFiniteGuard("warn"),
        kf.callbacks.TapeVariableCounter(),
    ]


def trained(build, x, y, with_callbacks, epochs=2):
    model = build(keras.Model)
    model.compile(keras.optimizers.Adam(1e-2), "mse")
    history = model.fit(
        x,
        y,
        batch_size=16,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=callbacks() if with_callbacks else [],
    )
    return model, history.history


@pytest.mark.parametrize(
    "build",
    [mlp, sequential, subclassed],
    ids=["functional", "seq", "sub"],
)
def test_plain_fit_with_the_callbacks_trains_as_keras(build):
    x, y = data()
    model, logs = trained(build, x, y, True, epochs=1)
    reference, _ = trained(build, x, y, False, epochs=1)
    assert type(model) is type(reference)  # plain again after `fit`
    assert max_diff(model, reference) == 0.0
    assert logs["tape_variables"] == [4.0]
    assert logs["nonfinite_count"] == [0.0]
    assert np.isfinite(logs["grad_norm"][0]) and logs["grad_norm"][0] > 0
    np.testing.assert_allclose(model.evaluate(x, y, verbose=0), reference.evaluate(x, y, verbose=0))
    # A later `fit` without the callbacks: Keras' own step, as the reference's.
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    reference.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert max_diff(model, reference) == 0.0


def test_grad_norm_is_numpys_worked_gradient():
    """One batch of a linear model under "mse": the gradient is
    `2/(n*k) X^T (X W + b - Y)` (and its column sums for `b`)."""
    x, y = data()
    model = linear()
    model.compile(keras.optimizers.SGD(0.0), "mse")  # the weights stay
    w, b = (np.asarray(v, "float64") for v in model.get_weights())
    history = model.fit(x, y, batch_size=ROWS, epochs=1, verbose=0, callbacks=callbacks())
    residual = x @ w + b - y
    scale = 2.0 / residual.size
    expected = np.sqrt(
        np.sum((scale * x.T @ residual) ** 2) + np.sum((scale * residual.sum(0)) ** 2)
    )
    np.testing.assert_allclose(history.history["grad_norm"][0], expected, rtol=1e-5)


def test_a_nan_batch_is_counted_and_applied_as_keras_applies_it():
    x, y = data()
    x[ROWS - 3, 2] = np.nan  # in the last batch: one non-finite micro-batch
    with pytest.warns(RuntimeWarning, match="1 non-finite micro-batch"):
        model, logs = trained(mlp, x, y, True, epochs=1)
    assert logs["nonfinite_count"] == [1.0]
    reference, _ = trained(mlp, x, y, False, epochs=1)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_array_equal(a, b)  # NaN where Keras' are NaN


def test_the_model_saves_as_the_plain_model(tmp_path):
    x, y = data()
    model, _ = trained(mlp, x, y, True, epochs=1)
    path = str(tmp_path / "plain.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert type(loaded) is type(model) and not isinstance(loaded, kf.FastGradModel)
    assert max_diff(loaded, model) == 0.0
