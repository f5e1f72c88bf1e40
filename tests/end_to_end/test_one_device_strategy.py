"""A strategy of one replica trains as no strategy at all.

`MirroredStrategy()` on one GPU, or on a machine without one, has a single
replica, yet an optimizer update inside a `cond` in its replica context is
still a `merge_call`, which TensorFlow refuses. Each case trains the same
model on the same batches without a strategy (the reference) and under
`MirroredStrategy(["/cpu:0"])` (in this process: one device needs no
logical-device setup), and compares the weights, `optimizer.iterations`
and the logs.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_fastgrad
from keras_fastgrad.callbacks import GradientNormLogger
from tests.helpers import data, fast, max_weight_diff, mlp, needs_multi_replica_keras
from tests.multitask_helpers import build as multitask_model
from tests.multitask_helpers import make_data as multitask_data

# Keras < 3.10 updates metrics with a `merge_call` (mirrored metric
# variables), which the step's `cond`s cannot hold under any strategy.
pytestmark = needs_multi_replica_keras

ONE_DEVICE = tf.distribute.MirroredStrategy(["/cpu:0"])


def _train(make, compile_kwargs, x, y, strategy=None, **fit_kwargs):
    scope = strategy.scope() if strategy is not None else _no_scope()
    with scope:
        model = make()
        model.compile(**compile_kwargs())  # the optimizer too, in the scope
    fit_kwargs = {k: v() if callable(v) else v for k, v in fit_kwargs.items()}  # fresh callbacks
    history = model.fit(x, y, shuffle=False, verbose=0, **fit_kwargs)
    return model, history.history


class _no_scope:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _assert_same_training(make, compile_kwargs, x, y, tolerance=1e-7, **fit_kwargs):
    assert ONE_DEVICE.num_replicas_in_sync == 1
    ref, h_ref = _train(make, compile_kwargs, x, y, **fit_kwargs)
    one, h_one = _train(make, compile_kwargs, x, y, strategy=ONE_DEVICE, **fit_kwargs)
    assert max_weight_diff(ref, one) <= tolerance
    assert int(one.optimizer.iterations.numpy()) == int(ref.optimizer.iterations.numpy())
    assert sorted(h_one) == sorted(h_ref)
    for key in h_ref:
        np.testing.assert_allclose(h_one[key], h_ref[key], rtol=1e-6, atol=1e-7, err_msg=key)
    return ref, one, h_ref, h_one


def _sgd(**kwargs):
    return lambda: dict(optimizer=keras.optimizers.SGD(0.1), loss="mse", **kwargs)


def test_default_options():
    x, y = data(n=12)
    ref, _, _, h = _assert_same_training(fast, _sgd(metrics=["mae"]), x, y, batch_size=4, epochs=2)
    assert int(ref.optimizer.iterations.numpy()) == 6
    assert np.all(np.isfinite(h["loss"]))


def _embedding_model(**options):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((4,), dtype="int32")
    pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(10, 3)(inputs))
    return keras_fastgrad.FastGradModel(inputs, keras.layers.Dense(1)(pooled), **options)


def test_accumulation_with_an_uneven_last_batch_and_sparse_gradients():
    # 11 rows in batches of 2: the last batch holds 1; windows of 3 batches.
    # The Embedding's gradient is sparse: added by rows without a strategy,
    # densely under one (per-replica sums).
    rng = np.random.default_rng(1)
    x = rng.integers(0, 10, size=(11, 4)).astype("int32")
    y = rng.normal(size=(11, 1)).astype("float32")
    ref, *_ = _assert_same_training(
        lambda: _embedding_model(accumulation_steps=3),
        _sgd(),
        x,
        y,
        batch_size=2,
        epochs=2,
    )
    assert int(ref.optimizer.iterations.numpy()) == 4  # 2 windows an epoch


def _conv_model(**options):
    keras.utils.set_random_seed(5)
    inputs = keras.Input((4, 4, 1))
    hidden = keras.layers.Conv2D(2, 3, padding="same", activation="tanh")(inputs)
    outputs = keras.layers.Conv2D(1, 1)(hidden)  # a loss per pixel
    return keras_fastgrad.FastGradModel(inputs, outputs, **options)


def test_micro_batches_on_a_per_pixel_loss():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(10, 4, 4, 1)).astype("float32")
    y = rng.normal(size=(10, 4, 4, 1)).astype("float32")
    _assert_same_training(
        lambda: _conv_model(micro_batches=2), _sgd(), x, y, batch_size=5, epochs=2
    )


def test_clip_norm_clips_alike():
    x, y = data(n=12)
    _, _, _, h = _assert_same_training(
        lambda: fast(clip_norm=0.05, telemetry=True), _sgd(), x, y, batch_size=4, epochs=2
    )
    assert h["clipped_updates"][-1] == 6  # clipping acted on every update


@pytest.mark.parametrize("accumulation_steps", [1, 2])
def test_a_nonfinite_micro_batch_is_dropped(accumulation_steps):
    x, y = data(n=12)
    x[5, 1] = np.nan  # the second batch of 4
    ref, one, _, h = _assert_same_training(
        lambda: fast(accumulation_steps=accumulation_steps, telemetry=True),
        _sgd(),
        x,
        y,
        batch_size=4,
        epochs=1,
    )
    assert h["nonfinite_count"] == [1.0]
    assert all(np.all(np.isfinite(w)) for w in one.get_weights())


def test_mixed_float16_loss_scaling():
    keras.mixed_precision.set_global_policy("mixed_float16")
    x, y = data(n=32)
    y = y * 300.0  # gradients times 2**15 overflow float16 at first

    def compile_kwargs():
        return dict(optimizer=keras.optimizers.SGD(1e-4), loss="mse")

    ref, one, _, h = _assert_same_training(
        lambda: fast(telemetry=True), compile_kwargs, x, y, tolerance=1e-6, batch_size=8, epochs=2
    )
    assert isinstance(one.optimizer, keras.optimizers.LossScaleOptimizer)
    assert h["nonfinite_count"][-1] >= 1  # the scale searched down
    assert float(one.optimizer.dynamic_scale.numpy()) == float(ref.optimizer.dynamic_scale.numpy())


def _batchnorm_model(synchronized=False, **options):
    keras.utils.set_random_seed(9)
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(4)(inputs)
    hidden = keras.layers.BatchNormalization(synchronized=synchronized)(hidden)
    return keras_fastgrad.FastGradModel(inputs, keras.layers.Dense(1)(hidden), **options)


@pytest.mark.parametrize("synchronized", [False, True])
def test_batchnorm_window_statistics(synchronized):
    x, y = data(n=16)
    x = x * 3.0 + 1.0  # statistics far from the initial (0, 1)
    ref, *_ = _assert_same_training(
        lambda: _batchnorm_model(synchronized, accumulation_steps=2),
        _sgd(),
        x,
        y,
        tolerance=1e-6,
        batch_size=4,
        epochs=1,
    )
    moving_mean = ref.layers[2].moving_mean.numpy()
    assert np.max(np.abs(moving_mean)) > 0.01  # the statistics moved


def test_synchronized_batchnorm_with_micro_batches_is_refused():
    with ONE_DEVICE.scope():
        model = _batchnorm_model(True, micro_batches=2)
        model.compile(optimizer="sgd", loss="mse")
    x, y = data(n=8)
    with pytest.raises(ValueError, match="synchronized=True"):
        model.fit(x, y, batch_size=4, verbose=0)


def test_multitask_pcgrad():
    x, y = multitask_data(n=12)

    def compile_kwargs():
        return dict(optimizer=keras.optimizers.SGD(0.1), loss={"a": "mse", "b": "mse"})

    _assert_same_training(
        lambda: multitask_model(multitask="pcgrad", telemetry=True),
        compile_kwargs,
        x,
        y,
        batch_size=4,
        epochs=2,
    )


def test_callback_on_a_plain_keras_model():
    x, y = data(n=12)
    ref, _, _, h = _assert_same_training(
        mlp, _sgd(), x, y, batch_size=4, epochs=2, callbacks=lambda: [GradientNormLogger()]
    )
    assert len(h["grad_norm"]) == 2 and h["grad_norm"][-1] > 0.0
    assert not isinstance(ref, keras_fastgrad.FastGradModel)
