"""BatchNorm window statistics on JAX (`batchnorm_statistics="window"`,
`keras_fastgrad.backend.jax.batchnorm`).

References: a plain `keras.Model` trained on the concatenated batches
(with a learning rate of 0 where several windows run, so that its weights,
and so each batch's moments, stay those the split model sees: ghost batch
norm normalises each micro-batch by its own moments, so trained weights
differ from the big batch's by design); for the weights, Keras' own
`gradient_accumulation_steps` on equal micro-batches (the same per
micro-batch forward); a file written by the TensorFlow step.
"""

import keras
import numpy as np
import pytest

from keras_fastgrad import FastGradModel
from tests.helpers import ROOT, run_on_tensorflow


def conv_bn(cls=keras.Model, **options):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((6, 6, 2))
    h = keras.layers.Conv2D(4, 3, name="conv")(inputs)
    h = keras.layers.BatchNormalization(momentum=0.9, name="bn")(h)
    return cls(inputs, keras.layers.Dense(1)(keras.layers.Flatten()(h)), **options)


def dense_bn(cls=keras.Model, **options):
    keras.utils.set_random_seed(4)
    inputs = keras.Input((5,))
    h = keras.layers.Dense(3, name="hidden")(inputs)
    h = keras.layers.BatchNormalization(momentum=0.8, name="bn")(h)
    return cls(inputs, keras.layers.Dense(1)(h), **options)


def image_data(n, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(n, 6, 6, 2)) * 2.0 + 1.0).astype("float32")
    return x, rng.normal(size=(n, 1)).astype("float32")


def vector_data(n, seed=1):
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(n, 5)) * 3.0 - 2.0).astype("float32")
    return x, rng.normal(size=(n, 1)).astype("float32")


MODELS = {"conv": (conv_bn, image_data), "dense": (dense_bn, vector_data)}


def moving(model):
    bn = model.get_layer("bn")
    return [np.asarray(bn.moving_mean), np.asarray(bn.moving_variance)]


def assert_moving_equal(model, reference):
    for got, want in zip(moving(model), moving(reference), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def trainable_diff(a, b):
    return max(
        float(np.max(np.abs(np.asarray(u) - np.asarray(v))))
        for u, v in zip(a.trainable_weights, b.trainable_weights, strict=True)
    )


def keras_fit(build, x, y, batch_size, lr=0.0):
    ref = build()
    ref.compile(keras.optimizers.SGD(lr), "mse")
    ref.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    return ref


def fastgrad_fit(build, x, y, batch_size, lr=0.0, **options):
    model = build(FastGradModel, **options)
    model.compile(keras.optimizers.SGD(lr), "mse")
    model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    return model


# (options, batch size, rows): the windows and keras.Model's batch size.
# accumulation 2: 4+4 | 4+4 | 4+3 (an uneven last batch); accumulation 3:
# 4+4+4 | 4+4+2 plus a partial window at the epoch's end is below;
# micro_batches 2: slices of 4+3 (uneven) per batch of 7.
SPLITS = {
    "accumulation_2": ({"accumulation_steps": 2}, 4, 23, 8),
    "accumulation_3": ({"accumulation_steps": 3}, 4, 22, 12),
    "micro_batches_2": ({"micro_batches": 2}, 7, 20, 7),
}


@pytest.mark.parametrize("split", sorted(SPLITS))
@pytest.mark.parametrize("name", sorted(MODELS))
def test_moving_statistics_equal_keras_on_the_windows_batches(name, split):
    build, make_data = MODELS[name]
    options, batch_size, rows, big = SPLITS[split]
    x, y = make_data(rows)
    model = fastgrad_fit(build, x, y, batch_size, **options)
    reference = keras_fit(build, x, y, big)
    assert_moving_equal(model, reference)
    if split != "accumulation_2":
        return
    # Not the per-micro-batch steps (what "micro_batch" does): the test can fail.
    per_micro = fastgrad_fit(build, x, y, batch_size, batchnorm_statistics="micro_batch", **options)
    assert np.max(np.abs(moving(per_micro)[0] - moving(reference)[0])) > 1e-4


@pytest.mark.parametrize("name", sorted(MODELS))
def test_one_window_trained_equals_keras_on_the_big_batch(name):
    # One update (accumulation 3, uneven: 5 + 5 + 3 rows): the moving
    # statistics are the big batch's, moved once, with a real learning rate.
    build, make_data = MODELS[name]
    x, y = make_data(13)
    model = fastgrad_fit(build, x, y, 5, lr=0.1, accumulation_steps=3)
    assert_moving_equal(model, keras_fit(build, x, y, 13, lr=0.1))
    assert model.telemetry_counters()["updates"] == 1.0


def test_weights_equal_keras_accumulation_on_equal_micro_batches():
    # The forward is per micro-batch (ghost batch norm): the weights are
    # those of Keras' own accumulation on equal micro-batches, whatever the
    # moving statistics do; the moving statistics are the window's.
    x, y = image_data(24)
    plain = conv_bn()
    plain.compile(keras.optimizers.SGD(0.05, gradient_accumulation_steps=2), "mse")
    plain.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    model = fastgrad_fit(conv_bn, x, y, 4, lr=0.05, accumulation_steps=2)
    assert trainable_diff(plain, model) < 1e-5
    sliced = fastgrad_fit(conv_bn, x, y, 8, lr=0.05, micro_batches=2)
    assert trainable_diff(plain, sliced) < 1e-5
    assert np.allclose(moving(model)[0], moving(sliced)[0], rtol=1e-5, atol=1e-6)


def test_a_dropped_micro_batch_is_not_pooled():
    # accumulation 2, batches of 4: the second micro-batch has a NaN row and
    # is dropped; the window's statistics are those of the first alone.
    x, y = vector_data(16)
    x[5, 1] = np.nan
    model = fastgrad_fit(dense_bn, x, y, 4, accumulation_steps=2)
    assert model.telemetry_counters()["nonfinite_count"] == 1.0
    assert all(np.all(np.isfinite(m)) for m in moving(model))
    reference = dense_bn()
    reference.compile(keras.optimizers.SGD(0.0), "mse")
    reference.train_on_batch(x[0:4], y[0:4])
    reference.train_on_batch(x[8:16], y[8:16])
    assert_moving_equal(model, reference)  # keras.Model on batches 0:4 and 8:16


def test_a_micro_batch_dropped_by_loss_scaling_is_not_pooled():
    # mixed_float16: the window's second micro-batch overflows the initial
    # loss scale and is dropped; the statistics are the first one's (the
    # same on TensorFlow).
    x, y = vector_data(8)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = dense_bn(FastGradModel, accumulation_steps=2)
        model.compile(keras.optimizers.SGD(0.0), "mse")
        model.train_on_batch(x[:5], y[:5])
        model.train_on_batch(x[5:], y[5:])
        reference = dense_bn()
        reference.compile(keras.optimizers.SGD(0.0), "mse")
        reference.train_on_batch(x[:5], y[:5])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert model.telemetry_counters()["nonfinite_count"] == 1.0
    assert_moving_equal(model, reference)


def test_the_partial_window_moves_the_statistics_at_the_epochs_end():
    # accumulation 3, batches of 4 over 20 rows: a window of 12, then a
    # partial window of 4 + 4 applied at the epoch's end.
    x, y = vector_data(20)
    model = fastgrad_fit(dense_bn, x, y, 4, accumulation_steps=3)
    assert_moving_equal(model, keras_fit(dense_bn, x, y, 12))
    pending = dense_bn(FastGradModel, accumulation_steps=3)
    pending.compile(keras.optimizers.SGD(0.0), "mse")
    for start in range(0, 20, 4):
        pending.train_on_batch(x[start : start + 4], y[start : start + 4])
    window = np.asarray(pending.fastgrad_step_state.batchnorm.window)
    np.testing.assert_allclose(window[0], 8.0)  # two micro-batches of 4 pooled
    h = np.asarray(pending.get_layer("hidden")(x[12:20]))  # what the BatchNorm saw (lr 0)
    np.testing.assert_allclose(window[1], h.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(window[2] / 8.0, h.var(0), rtol=1e-5, atol=1e-6)
    pending.apply_partial_window()
    assert_moving_equal(pending, keras_fit(dense_bn, x, y, 12))
    assert not np.any(np.asarray(pending.fastgrad_step_state.batchnorm.window))


_WRITE_ON_TF = """
import sys, numpy as np, keras
sys.path.insert(0, {tests!r})
from tests.step.test_batchnorm_jax import dense_bn, vector_data
from keras_fastgrad import FastGradModel
x, y = vector_data(12)
model = dense_bn(FastGradModel, accumulation_steps=3)
model.compile(keras.optimizers.SGD(0.1), "mse")
for start in (0, 4):
    model.train_on_batch(x[start : start + 4], y[start : start + 4])
model.save({path!r})
model.apply_partial_window()
bn = model.get_layer("bn")
np.save({path!r} + ".npy", np.stack([bn.moving_mean.numpy(), bn.moving_variance.numpy()]))
"""


# Not `slow`: the JAX stage of CI runs the fast tier only, where a slow
# (full-tier) test of a JAX-only file would never run.
@pytest.mark.needs_tensorflow(reason="the file is saved by a TensorFlow process")
def test_a_window_pending_on_tensorflow_resumes_on_jax(tmp_path):
    path = str(tmp_path / "tf.keras")
    run_on_tensorflow(
        _WRITE_ON_TF.format(
            tests=ROOT,
            path=path,
        )
    )
    loaded = keras.saving.load_model(path)
    window = np.asarray(loaded.fastgrad_step_state.batchnorm.window)
    np.testing.assert_allclose(window[0], 8.0)  # TF's pending pool, loaded
    loaded.apply_partial_window()
    np.testing.assert_allclose(np.stack(moving(loaded)), np.load(path + ".npy"), rtol=1e-5)
