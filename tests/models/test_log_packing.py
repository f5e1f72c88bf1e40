"""The telemetry keys travel packed through Keras' TensorFlow train function
(`keras_fastgrad.backend.tensorflow.log_packing`) and come back as they
were: the values `fit`, History, `train_on_batch` and a subclass's own step
see are checked against gradients worked out by hand."""

import keras
import numpy as np
import pytest

import keras_fastgrad
from keras_fastgrad.backend.tensorflow import log_packing
from keras_fastgrad.callbacks import GradientNormLogger, NonFiniteGuard, TapeVariableCounter

pytestmark = pytest.mark.tensorflow_only(
    reason="Keras' TensorFlow train function unpacks its outputs on the host; JAX's does not"
)

W, B = np.array([[0.5], [-1.0]], "float32"), np.array([0.25], "float32")
X = np.array([[1.0, 2.0], [0.0, -1.0], [3.0, 1.0], [-2.0, 0.5]], "float32")
Y = np.array([[1.0], [0.0], [2.0], [-1.0]], "float32")


def hand_norm():
    """||grad|| of mean((x w + b - y)^2) over the batch, by hand."""
    residual = X @ W + B - Y
    g_out = 2 * residual / len(X)
    g_w, g_b = X.T @ g_out, g_out.sum(0)
    return float(np.sqrt(np.sum(g_w**2) + np.sum(g_b**2)))


def linear(cls=keras_fastgrad.FastGradModel, **options):
    inputs = keras.Input((2,))
    model = cls(inputs, keras.layers.Dense(1, name="dense")(inputs), **options)
    model.set_weights([W, B])
    # lr 0: the weights stay, every step has the hand-worked gradient
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    return model


def three_callbacks():
    return [GradientNormLogger(), NonFiniteGuard("raise"), TapeVariableCounter()]


def test_history_holds_each_key_with_its_value():
    model = linear()
    history = model.fit(X, Y, batch_size=4, epochs=2, verbose=0, callbacks=three_callbacks())
    logs = history.history
    assert log_packing.PACKED_KEY not in logs
    np.testing.assert_allclose(logs["grad_norm"], [hand_norm()] * 2, rtol=1e-5)
    assert logs["nonfinite_count"] == [0.0, 0.0]
    assert logs["nonfinite_first_index"] == [-1.0, -1.0]
    assert logs["nonfinite_num_variables"] == [0.0, 0.0]
    assert logs["tape_variables"] == [2.0, 2.0]  # kernel and bias


def test_the_train_function_returns_float32_values_under_their_names():
    model = linear(telemetry=True)
    model.fit(X, Y, batch_size=4, verbose=0)
    assert len(model.fastgrad_step_state.packed_names) > 1  # (packed indeed)
    logs = model.train_on_batch(X, Y, return_dict=True)
    assert log_packing.PACKED_KEY not in logs
    assert set(keras_fastgrad.LOG_KEYS) <= set(logs)
    np.testing.assert_allclose(logs["grad_norm"], hand_norm(), rtol=1e-5)
    assert logs["updates"] == 2.0  # the fit's step and this one
    assert logs["loss_scale"] == 1.0
    # what `fit` gets, before Keras' `pythonify_logs`: float32 scalars
    import tensorflow as tf

    raw = model.train_function(iter(tf.data.Dataset.from_tensors((X, Y))))
    assert log_packing.PACKED_KEY not in raw
    assert all(np.asarray(raw[k]).dtype == np.float32 for k in keras_fastgrad.LOG_KEYS)
    assert all(np.shape(raw[k]) == () for k in keras_fastgrad.LOG_KEYS)
    assert raw["updates"] == 3.0


def test_a_subclass_reads_the_keys_from_the_base_step():
    class Doubling(keras_fastgrad.FastGradModel):
        def train_step(self, data):
            logs = super().train_step(data)
            logs["twice_grad_norm"] = 2.0 * logs["grad_norm"]
            return logs

    model = linear(Doubling)
    history = model.fit(X, Y, batch_size=4, verbose=0, callbacks=three_callbacks())
    np.testing.assert_allclose(history.history["grad_norm"], [hand_norm()], rtol=1e-5)
    np.testing.assert_allclose(history.history["twice_grad_norm"], [2 * hand_norm()], rtol=1e-5)


def test_a_plain_model_fit_gets_the_keys_unpacked():
    model = linear(keras.Model)
    history = model.fit(X, Y, batch_size=4, verbose=0, callbacks=three_callbacks())
    np.testing.assert_allclose(history.history["grad_norm"], [hand_norm()], rtol=1e-5)
    assert history.history["nonfinite_count"] == [0.0]
    assert log_packing.PACKED_KEY not in history.history
    assert not isinstance(model, keras_fastgrad.FastGradModel)


def test_steps_per_execution_hands_back_the_last_steps_keys():
    model = linear(telemetry=True)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", steps_per_execution=3)
    history = model.fit(np.tile(X, (3, 1)), np.tile(Y, (3, 1)), batch_size=4, verbose=0)
    assert history.history["updates"] == [3.0]
    np.testing.assert_allclose(history.history["grad_norm"], [hand_norm()], rtol=1e-5)


def test_a_vector_that_does_not_fit_the_names_is_refused():
    class State:
        packed_names = ("grad_norm", "updates")

    import tensorflow as tf

    def function(iterator):
        return {"loss": 0.5, log_packing.PACKED_KEY: tf.zeros([3])}

    with pytest.raises(RuntimeError, match=r"3 values for the 2 keys \['grad_norm', 'updates'\]"):
        log_packing.unpacking(function, State())(None)


def test_packing_step_stacks_the_recorded_names():
    class State:
        telemetry_names, packed_names = ("grad_norm", "updates"), ()

    state = State()
    step = lambda data: {"loss": 0.5, "grad_norm": 2.0, "updates": 3.0}  # noqa: E731
    logs = log_packing.packing_step(step, state)(None)
    assert sorted(logs) == [log_packing.PACKED_KEY, "loss"]
    assert logs[log_packing.PACKED_KEY].numpy().tolist() == [2.0, 3.0]
    assert state.packed_names == ("grad_norm", "updates")
