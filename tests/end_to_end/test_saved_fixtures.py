"""Files saved by earlier releases keep loading, bit for bit, and resume.

The fixtures in `tests/data/` were written by `make_saved_fixtures.py`
running on the commit in their names (before the modules moved): a plain
`FastGradModel`, one with an accumulation window half full, a multi-task
model with GradVac's state, a `FastGradSequential`, and `fastgrad` on a
subclassed model. The `.npz` beside each holds the weights and step state
as that release saw them.
"""

import os

import keras
import numpy as np
import pytest

import keras_fastgrad

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
from tests.data import make_saved_fixtures as fixtures  # noqa: E402  (registers `Regressor`)

RELEASE = "3b3f576"
EXPECTED_CLASS = {
    "plain": "FastGradModel",
    "mid_window": "FastGradModel",
    "multitask_gradvac": "FastGradModel",
    "sequential": "FastGradSequential",
    "fastgrad_subclass": "Regressor",
}


def stored(case):
    with np.load(os.path.join(DATA, f"{case}_{RELEASE}.npz")) as f:
        weights = [f[f"weight_{i}"] for i in range(sum(k.startswith("weight_") for k in f))]
        state = [
            f[f"state_{i}"] for i in range(sum(k[6:].isdigit() for k in f if k[:6] == "state_"))
        ]
    return weights, state


def state_values(model):
    store = {}
    model.fastgrad_step_state.save_own_variables(store)
    return [np.asarray(store[str(i)]) for i in range(sum(k.isdigit() for k in store))]


def assert_bit_exact(model, case):
    weights, state = stored(case)
    got = model.get_weights()
    assert len(got) == len(weights)
    for a, b in zip(weights, got):
        np.testing.assert_array_equal(b, a)
    # The state may have grown since (new variables go last).
    for a, b in zip(state, state_values(model)[: len(state)]):
        np.testing.assert_array_equal(b, a)


@pytest.mark.parametrize("case", list(EXPECTED_CLASS))
def test_keras_file_loads_bit_exact(case):
    model = keras.saving.load_model(os.path.join(DATA, f"{case}_{RELEASE}.keras"))
    assert isinstance(model, keras_fastgrad.FastGradModel)
    assert type(model).__name__ == EXPECTED_CLASS[case]
    assert_bit_exact(model, case)


@pytest.mark.parametrize("case", list(EXPECTED_CLASS))
def test_weights_file_loads_bit_exact(case):
    model = fixtures.CASES[case]()
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    model.load_weights(os.path.join(DATA, f"{case}_{RELEASE}.weights.h5"))
    assert_bit_exact(model, case)


@pytest.mark.tensorflow_only(
    reason="the reference rebuilds the file's model from its seed, and Keras' JAX "
    "backend draws other initial weights from it; on JAX these files load bit-exact "
    "(above) and a window saved on TensorFlow resumes (tests/models/test_saving_jax.py)"
)
@pytest.mark.parametrize("case", ["mid_window", "sequential", "fastgrad_subclass"])
def test_half_full_window_resumes_exactly(case):
    # The 4th batch completes the saved window: the same weights as 4
    # batches in one go with today's code.
    x, y = fixtures.fixture_data()
    whole = fixtures.CASES[case]()
    whole.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    for i in range(4):
        whole.train_on_batch(x[2 * i : 2 * i + 2], y[2 * i : 2 * i + 2])
    resumed = keras.saving.load_model(os.path.join(DATA, f"{case}_{RELEASE}.keras"))
    assert resumed.accumulation_steps == 2
    resumed.train_on_batch(x[6:8], y[6:8])
    assert int(resumed.optimizer.iterations.numpy()) == 2
    for a, b in zip(whole.get_weights(), resumed.get_weights()):
        np.testing.assert_allclose(b, a, atol=1e-7)
