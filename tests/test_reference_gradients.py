"""`helpers.reference_gradients`, the tests' backend-neutral gradient
reference, against values worked out by hand (run under TensorFlow and
under `KERAS_BACKEND=jax`)."""

import keras
import numpy as np
import pytest

from tests.helpers import reference_gradients

X = np.array([[1.0, 2.0], [3.0, -1.0]], "float32")
Y = np.array([[1.0], [0.0]], "float32")


def dense(**regularizers):
    """Dense(1), kernel (0.5, -1), bias 0.1: predictions (-1.4, 2.6),
    errors against `Y` (-2.4, 2.6)."""
    inputs = keras.Input((2,))
    layer = keras.layers.Dense(
        1,
        kernel_initializer=keras.initializers.Constant([[0.5], [-1.0]]),
        bias_initializer=keras.initializers.Constant(0.1),
        **regularizers,
    )
    return keras.Model(inputs, layer(inputs))


def test_mse_of_a_dense_layer_on_two_rows():
    # mse = (2.4^2 + 2.6^2) / 2 = 6.26; d/dw = (2/2) x^T err
    # = (1*-2.4 + 3*2.6, 2*-2.4 - 1*2.6) = (5.4, -7.4); d/db = 0.2.
    model = dense()
    value, (kernel, bias) = reference_gradients(
        model, lambda: keras.ops.mean(keras.losses.mean_squared_error(Y, model(X)))
    )
    assert value == pytest.approx(6.26, rel=1e-6)
    np.testing.assert_allclose(kernel, [[5.4], [-7.4]], rtol=1e-6)
    np.testing.assert_allclose(bias, [0.2], rtol=1e-5)


def test_compute_loss_counts_both_regularisers_and_unreached_variables_get_zeros():
    # Kernel L2(0.1): 0.1 * (0.25 + 1) = 0.125, d/dw = 0.2 w = (0.1, -0.2).
    # Activity L2(0.5), divided by the 2 rows: 0.5 * (1.96 + 6.76) / 2 =
    # 2.18, d/dw = 0.5 x^T y_pred = (3.2, -2.7), d/db = 0.5 * 1.2 = 0.6.
    # With the mse: 8.565, (8.7, -10.3), 0.8. (Under JAX the activity term
    # is in `model.losses` only if the scope collects the layers' losses.)
    model = dense(
        kernel_regularizer=keras.regularizers.L2(0.1),
        activity_regularizer=keras.regularizers.L2(0.5),
    )
    model.compile(loss="mse")
    unused = keras.layers.Dense(3)
    unused.build((None, 4))
    value, (kernel, bias, unused_kernel, _) = reference_gradients(
        model,
        lambda: model.compute_loss(x=X, y=Y, y_pred=model(X, training=True)),
        variables=model.trainable_variables + unused.trainable_variables,
    )
    assert value == pytest.approx(8.565, rel=1e-6)
    np.testing.assert_allclose(kernel, [[8.7], [-10.3]], rtol=1e-6)
    np.testing.assert_allclose(bias, [0.8], rtol=1e-5)
    np.testing.assert_array_equal(unused_kernel, np.zeros((4, 3)))
