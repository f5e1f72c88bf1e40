"""On JAX, what the JAX step does not implement yet is refused by name."""

import keras
import numpy as np
import pytest

import keras_fastgrad as kf
from tests.helpers import FGTrainingBranch
from tests.helpers import mlp_16 as mlp
from tests.helpers import uneven_data as data

NOT_YET = r"not yet supported on Keras' JAX backend.*KERAS_BACKEND=tensorflow"


# (No option is refused at construction any more: `micro_batches` with
# `multitask` trains on JAX, tests/multitask/test_multitask_jax.py.)


def test_batchnorm_window_statistics_train_no_longer_refused():
    # (Their values: tests/step/test_batchnorm_jax.py.)
    inputs = keras.Input((8,))
    h = keras.layers.BatchNormalization()(keras.layers.Dense(4)(inputs))
    model = kf.FastGradModel(inputs, keras.layers.Dense(3)(h), accumulation_steps=2)
    model.compile("adam", "mse")
    x, y = data()
    model.fit(x, y, batch_size=16, verbose=0)  # windows of 16 + 16 and 16 + 10
    assert model.telemetry_counters()["updates"] == 2.0
    assert model.fastgrad_step_state.batchnorm is not None  # pooled, not per micro-batch


def test_fixed_loss_scale_factor_refused():
    model = mlp(kf.FastGradModel)
    model.compile(keras.optimizers.SGD(loss_scale_factor=8.0), "mse")
    with pytest.raises(NotImplementedError, match="loss_scale_factor"):
        model.fit(np.ones((4, 8)), np.ones((4, 3)), verbose=0)


def test_model_parallel_trains_its_window_sums_laid_out_as_their_variables():
    # (Equal to one device on a 2 x 4 mesh: tests/end_to_end/test_model_parallel_jax.py.)
    import jax

    mesh = keras.distribution.DeviceMesh((1, 1), ["batch", "model"], devices=jax.devices()[:1])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*dense.*kernel"] = (None, "model")
    distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    x, y = data()
    with distribution.scope():
        model = mlp(kf.FastGradModel, accumulation_steps=2)
        model.compile("adam", "mse")
        model.fit(x, y, batch_size=16, verbose=0)
    assert model.telemetry_counters()["updates"] == 2.0
    sums = model.fastgrad_step_state.accumulator.sums
    axes = [tuple(s._layout.axes) for s in sums]  # (one device: the arrays' shardings say less)
    assert axes == [tuple(v._layout.axes) for v in model.trainable_variables]
    assert axes[0] == (None, "model")  # (a kernel's)


def test_a_refusal_while_the_first_step_is_traced_leaves_the_model_its_weights():
    # Keras' JAX fit detaches the arrays from the variables before the first
    # step; a refusal raised while that step is traced (here TF's rule for a
    # weight regulariser under reduction="sum" with accumulation) used to
    # leave the model without values: `get_weights` raised a TypeError.
    inputs = keras.Input((3,))
    layer = keras.layers.Dense(1, kernel_regularizer="l2")
    model = kf.FastGradModel(inputs, layer(inputs), accumulation_steps=3)
    model.compile("adam", keras.losses.MeanSquaredError(reduction="sum"))
    x, y = np.ones((12, 3), "float32"), np.ones((12, 1), "float32")
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match=r"`accumulation_steps=3` cannot weight.*Fix:"):
        model.fit(x, y, batch_size=2, verbose=0)
    after = model.get_weights()
    assert len(after) == len(before)
    assert all(np.array_equal(a, b) for a, b in zip(before, after))
    np.testing.assert_allclose(
        np.asarray(model.predict(x, verbose=0)), x @ before[0] + before[1], rtol=1e-6
    )


@pytest.mark.parametrize("telemetry", [False, True])
def test_variables_made_inside_the_step_refused_by_name(telemetry):
    # Keras' stateless call failed first, with a shape mismatch of the
    # state's values ("Invalid variable value in StatelessScope"): the step
    # checked the variables' count before the forward pass made the layer.
    x, y = data()
    model = FGTrainingBranch(telemetry=telemetry)  # its `extra` layer: training only
    model(x[:1])  # built without the training-only layer
    model.compile(keras.optimizers.SGD(0.1), "mse")
    before = [w.copy() for w in model.body.get_weights() + model.head.get_weights()]
    with pytest.raises(ValueError, match=r"made variables inside the train step.*Fix: make every"):
        model.fit(x, y, batch_size=16, verbose=0)
    # The layers built before `fit` keep their weights (the refused layer's
    # own variables are left as the failed trace made them).
    after = model.body.get_weights() + model.head.get_weights()
    for got, want in zip(after, before, strict=True):
        np.testing.assert_array_equal(got, want)
