"""`profile_step` on Keras' JAX backend: the phases of the eager and jitted
step are timed, the mode with no JAX counterpart (`tf.function` without
XLA) is reported as skipped with its reason, and the model is left exactly
as it was (weights, optimizer, metrics, the step's window)."""

import keras
import numpy as np
import pytest

import keras_fastgrad as kf
from tests.helpers import mlp_16 as mlp
from tests.helpers import uneven_data as data


def state(model):
    variables = list(model.variables) + list(model.optimizer.variables)
    return [np.array(v) for v in variables + list(model.metrics_variables)]


@pytest.mark.parametrize("cls", [kf.FastGradModel, keras.Model], ids=["fastgrad", "keras"])
def test_profile_step_times_the_phases_and_leaves_the_model(cls):
    options = {"accumulation_steps": 2, "clip_norm": 1.0} if cls is kf.FastGradModel else {}
    model = mlp(cls, **options)
    model.compile(keras.optimizers.Adam(1e-2), "mse")
    x, y = data()
    model.fit(x, y, batch_size=24, epochs=1, verbose=0)  # a window pending (58 = 24 + 24 + 10)
    before = state(model)
    profile = kf.profile_step(
        model, (x, y), modes=("eager", "function", "xla"), repeats=2, warmup=1, verbose=0
    )
    assert sorted(profile.phases) == ["eager", "xla"]
    assert "jax.jit" in profile.skipped["function"]
    for times in profile.phases.values():
        assert 0 < times.forward_ms and 0 < times.step_ms
    assert profile.traces == 1
    assert profile.tape_variables == profile.trainable_variables == 4  # 2 Dense: kernel, bias
    assert profile.batch_size == len(x)
    assert "jax.jit (XLA)" in profile.table()
    for a, b in zip(state(model), before, strict=True):
        np.testing.assert_array_equal(a, b)
    model.fit(x, y, batch_size=24, epochs=1, verbose=0)  # still trains
