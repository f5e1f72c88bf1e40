"""Files written on JAX load with equal weights and step state; a file
written on TensorFlow (with a window pending) loads on JAX."""

import keras
import numpy as np
import pytest

import keras_fastgrad as kf
from tests.helpers import ROOT, run_on_tensorflow
from tests.helpers import max_weight_diff as max_diff
from tests.helpers import mlp_16 as mlp
from tests.helpers import uneven_data as data


def _trained_with_pending_window():
    x, y = data()
    model = mlp(kf.FastGradModel, accumulation_steps=4)
    model.compile(keras.optimizers.Adam(1e-2), "mse")
    for start in (0, 16):  # two micro-batches of a window of four: pending
        model.train_on_batch(x[start : start + 16], y[start : start + 16])
    return model


def test_keras_and_weights_files_round_trip(tmp_path):
    model = _trained_with_pending_window()
    state = [np.asarray(v) for v in model.fastgrad_step_state.values()]
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    assert type(loaded).__name__ == "FastGradModel" and loaded.accumulation_steps == 4
    assert max_diff(model, loaded) == 0.0
    assert len(loaded.weights) == len(mlp().weights)  # the step's state is no weight
    loaded_state = loaded.fastgrad_step_state.values()
    assert all(np.array_equal(a, b) for a, b in zip(state, loaded_state, strict=True))
    # The pending window resumes: both apply it alike.
    model.apply_partial_window()
    loaded.apply_partial_window()
    assert max_diff(model, loaded) < 1e-6
    model.save_weights(tmp_path / "m.weights.h5")
    fresh = mlp(kf.FastGradModel, accumulation_steps=4)
    fresh.load_weights(tmp_path / "m.weights.h5")
    assert max_diff(model, fresh) == 0.0


_WRITE_ON_TF = """
import sys, numpy as np, keras
sys.path.insert(0, {tests!r})
from tests.helpers import uneven_data as data, mlp_16 as mlp
import keras_fastgrad as kf
x, y = data()
model = mlp(kf.FastGradModel, accumulation_steps=4)
model.compile(keras.optimizers.Adam(1e-2), "mse")
for start in (0, 16):
    model.train_on_batch(x[start : start + 16], y[start : start + 16])
model.save({path!r})
np.save({path!r} + ".npy", np.concatenate([w.ravel() for w in model.get_weights()]))
model.apply_partial_window()  # what resuming must give
np.save({path!r} + ".after.npy", np.concatenate([w.ravel() for w in model.get_weights()]))
"""


@pytest.mark.needs_tensorflow(reason="the file is saved by a TensorFlow process")
def test_a_file_saved_on_tensorflow_loads_and_resumes(tmp_path):
    path = str(tmp_path / "tf.keras")
    run_on_tensorflow(
        _WRITE_ON_TF.format(
            tests=ROOT,
            path=path,
        )
    )
    loaded = keras.saving.load_model(path)
    weights = np.concatenate([w.ravel() for w in loaded.get_weights()])
    np.testing.assert_array_equal(weights, np.load(path + ".npy"))
    acc = loaded.fastgrad_step_state.accumulator
    assert int(acc.micro_step.numpy()) == 2 and int(acc.included.numpy()) == 2
    assert float(acc.normaliser.numpy()) == 32.0  # mse: a loss per row, 2 x 16 rows
    loaded.apply_partial_window()  # on JAX, with the optimizer state from TF
    weights = np.concatenate([w.ravel() for w in loaded.get_weights()])
    np.testing.assert_allclose(weights, np.load(path + ".after.npy"), atol=1e-5)
