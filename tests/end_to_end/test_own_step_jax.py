"""A `FastGradModel` subclass with a `train_step` of its own in Keras' JAX
signature, `train_step(self, state, data)`: one that calls the base step
trains exactly, one that never does is refused. (TensorFlow's
`train_step(self, data)`: tests/models/test_refusals.py.)"""

import keras
import pytest

import keras_fastgrad as kf
from tests.helpers import fastgrad_run, reference
from tests.helpers import max_weight_diff as max_diff
from tests.helpers import mlp_16 as mlp
from tests.helpers import uneven_data as data

pytestmark = pytest.mark.jax_only(reason="Keras' JAX `train_step(state, data)` signature")

TOL = 1e-5


class _OwnStep(kf.FastGradModel):
    def train_step(self, state, data):  # Keras' JAX signature
        return super().train_step(state, data)


class _IgnoresTheOptions(kf.FastGradModel):
    def train_step(self, state, data):
        return keras.Model.train_step(self, state, data)


def test_a_subclass_step_calling_the_base_step_and_one_that_does_not():
    x, y = data()
    ref = reference(mlp, x, y)
    model, _ = fastgrad_run(lambda cls=None, **o: mlp(_OwnStep, **o), x, y, accumulation_steps=4)
    assert max_diff(ref, model) < TOL
    model = mlp(_IgnoresTheOptions, accumulation_steps=4)
    model.compile(keras.optimizers.Adam(1e-2), "mse")
    with pytest.raises(ValueError, match="did not call `FastGradModel.train_step`"):
        model.fit(x, y, batch_size=16, verbose=0)
