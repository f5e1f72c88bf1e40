"""What `apply_partial_window` returns and when a multi-task step logs its
task keys: the same keys on both backends (the suite runs under TensorFlow
and under JAX), against key lists written out here and values worked out
with numpy.

The rules: a flush returns every fixed telemetry key, the optional keys the
step measures for the model and the noise scale's where it is measured,
never the multi-task keys; a multi-task step logs its task keys while any
telemetry key is requested, and none otherwise."""

import keras
import numpy as np
import pytest

import keras_fastgrad
from tests.multitask_helpers import build, compiled, conflicting, make_data

LR = 0.1
FIXED = [  # the fixed keys, in the logs' order
    "grad_norm",
    "clipped_updates",
    "updates",
    "nonfinite_count",
    "nonfinite_first_index",
    "nonfinite_num_variables",
    "loss_scale",
    "tape_variables",
    "input_shape_changes",
]
W0 = np.array([[0.5], [-0.3], [0.2]], "float32")
B0 = np.array([0.1], "float32")


def _linear(**options):
    inputs = keras.Input((3,))
    outputs = keras.layers.Dense(1, name="dense")(inputs)
    model = keras_fastgrad.FastGradModel(inputs, outputs, accumulation_steps=2, **options)
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    model.set_weights([W0, B0])
    return model


def _data():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(12, 3)).astype("float32")
    y = (x @ np.array([[1.0], [2.0], [-1.0]], "float32") + 0.5).astype("float32")
    return x, y


def _mse_gradient(w, b, x, y):
    """d/d(w, b) of mean((x w + b - y)^2), by hand."""
    r = x.astype("float64") @ w + b - y
    return 2.0 / len(x) * x.T @ r, 2.0 / len(x) * r.sum(axis=0)


def _one_window_and_a_pending_one(model):
    """Two micro-batches of 4 rows (a complete window, applied), then a
    third pending: the flush's logs."""
    x, y = _data()
    for rows in (slice(0, 4), slice(4, 8), slice(8, 12)):
        model.train_on_batch(x[rows], y[rows])
    return model.apply_partial_window()


def _reference():
    """The weights before the flush and the flush's gradient: SGD on the
    first 8 rows' mean loss, then the last 4 rows' gradient there."""
    x, y = _data()
    gw, gb = _mse_gradient(W0, B0, x[:8], y[:8])
    w1, b1 = W0 - LR * gw, B0 - LR * gb
    return (w1, b1), _mse_gradient(w1, b1, x[8:], y[8:])


def test_the_flush_returns_every_fixed_key_without_telemetry():
    logs = _one_window_and_a_pending_one(_linear())
    assert list(logs) == FIXED
    assert logs["updates"] == 2.0  # the window, then the flush
    assert logs["nonfinite_count"] == 0.0 and logs["nonfinite_first_index"] == -1.0
    assert logs["loss_scale"] == 1.0
    assert logs["tape_variables"] == 2.0  # the kernel and the bias
    assert all(isinstance(v, float) for v in logs.values())


def test_the_flush_returns_the_measured_keys_of_its_update():
    model = _linear()
    model.enable_telemetry(["grad_norm", "grad_norm/dense", "update_ratio"])
    logs = _one_window_and_a_pending_one(model)
    assert list(logs) == FIXED + ["grad_norm/dense", "update_ratio"]
    (w1, b1), (gw, gb) = _reference()
    norm = np.sqrt(np.sum(gw**2) + np.sum(gb**2))
    np.testing.assert_allclose(logs["grad_norm"], norm, rtol=1e-5)
    np.testing.assert_allclose(logs["grad_norm/dense"], norm, rtol=1e-5)  # one layer
    ratio = LR * norm / np.sqrt(np.sum(w1**2) + np.sum(b1**2))
    np.testing.assert_allclose(logs["update_ratio"], ratio, rtol=1e-4)
    assert logs["updates"] == 2.0


def test_the_flush_returns_the_noise_scales_keys_where_it_is_measured():
    logs = _one_window_and_a_pending_one(_linear(telemetry=True))
    assert list(logs) == FIXED + ["gns_simple", "gns_grad_sq", "gns_trace"]
    assert logs["updates"] == 2.0
    assert logs["input_shape_changes"] == 0.0  # every micro-batch 4 x 3


@pytest.mark.parametrize("keys", [None, ["updates"]])
def test_task_keys_are_logged_only_while_telemetry_is_on(keys):
    model = compiled(conflicting(build(multitask="pcgrad")))
    if keys:
        model.enable_telemetry(keys)
    x, y = make_data()
    logs = model.train_on_batch(x, y, return_dict=True)
    task_keys = sorted(k for k in logs if k.startswith("task_"))
    if keys is None:
        assert task_keys == [] and "updates" not in logs
    else:
        assert task_keys == [
            "task_conflicts",
            "task_cosine/a/b",
            "task_grad_norm/a",
            "task_grad_norm/b",
        ]
        assert logs["task_conflicts"] == 1.0  # `conflicting`'s weights: the tasks conflict
        assert logs["updates"] == 1.0


def test_a_multitask_flush_returns_no_task_key():
    model = compiled(conflicting(build(multitask="pcgrad", accumulation_steps=2)))
    model.enable_telemetry(["updates", "task_conflicts"])
    x, y = make_data()
    assert "task_conflicts" in model.train_on_batch(x, y, return_dict=True)
    logs = model.apply_partial_window()
    assert list(logs) == FIXED
    assert logs["updates"] == 1.0
