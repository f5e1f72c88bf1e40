"""In-step micro-batching equals the un-split step on the whole batch.

Reference: plain `keras.Model` trained on the same batches."""

import keras
import numpy as np
import pytest

from tests.helpers import (
    data,
    fast,
    max_weight_diff,
    mlp,
    tf,  # (TensorFlow imported at first use: not on JAX)
)


def both(options=None, optimizer=lambda: keras.optimizers.SGD(0.1), **compile_kwargs):
    ref, model = mlp(), fast(**(options or {}))
    ref.compile(optimizer=optimizer(), loss="mse", metrics=["mae"])
    model.compile(optimizer=optimizer(), loss="mse", metrics=["mae"], **compile_kwargs)
    return ref, model


@pytest.mark.parametrize("slices", [2, 3, 4])
def test_uneven_split_equals_the_whole_batch(slices):
    # A batch of 10 in 3 slices: 4, 3, 3 (as `numpy.array_split`).
    x, y = data(n=20)
    ref, model = both({"micro_batches": slices})
    h_ref = ref.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
    h = model.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
    assert max_weight_diff(ref, model) < 1e-6
    np.testing.assert_allclose(h.history["loss"], h_ref.history["loss"], rtol=1e-5)
    np.testing.assert_allclose(h.history["mae"], h_ref.history["mae"], rtol=1e-5)
    assert int(model.optimizer.iterations.numpy()) == 4


def test_adam_and_sample_weights():
    x, y = data(n=14)
    w = np.linspace(0.2, 3.0, 14).astype("float32")
    ref, model = both({"micro_batches": 4}, optimizer=lambda: keras.optimizers.Adam(0.01))
    ref.fit(x, y, sample_weight=w, batch_size=7, epochs=2, shuffle=False, verbose=0)
    model.fit(x, y, sample_weight=w, batch_size=7, epochs=2, shuffle=False, verbose=0)
    assert max_weight_diff(ref, model) < 1e-6


def test_xla_equals_graph_mode():
    x, y = data(n=20)
    ref, model = both({"micro_batches": 3}, jit_compile=True)
    ref.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
    assert max_weight_diff(ref, model) < 1e-5


def test_with_accumulation_and_clipping():
    # Windows of 2 batches of 6, each batch in 4 slices; vs batches of 12.
    x, y = data(n=24)
    y = y * 10.0
    ref = mlp()
    ref.compile(optimizer=keras.optimizers.SGD(0.1, global_clipnorm=0.5), loss="mse")
    model = fast(micro_batches=4, accumulation_steps=2, clip_norm=0.5)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    ref.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0)
    assert max_weight_diff(ref, model) < 1e-6


def test_weight_regularization_counts_once():
    def build(cls, **options):
        keras.utils.set_random_seed(3)
        inputs = keras.Input((3,))
        h = keras.layers.Dense(5, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.1))(
            inputs
        )
        return cls(inputs, keras.layers.Dense(1)(h), **options)

    import keras_fastgrad

    x, y = data(n=20)
    ref, model = build(keras.Model), build(keras_fastgrad.FastGradModel, micro_batches=3)
    for m in (ref, model):
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    h_ref = ref.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
    h = model.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
    assert max_weight_diff(ref, model) < 1e-6
    np.testing.assert_allclose(h.history["loss"], h_ref.history["loss"], rtol=1e-5)


def test_nan_in_one_slice_drops_the_batch():
    x, y = data(n=20)
    xs = x.copy()
    xs[13, 0] = np.nan  # second batch, its second slice
    keep = np.r_[0:10]
    ref, model = both({"micro_batches": 3, "telemetry": True})
    ref.fit(x[keep], y[keep], batch_size=10, shuffle=False, verbose=0)
    h = model.fit(xs, y, batch_size=10, shuffle=False, verbose=0)
    assert h.history["nonfinite_count"] == [1.0]
    assert max_weight_diff(ref, model) < 1e-6


def test_mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    x, y = data(n=20)
    lso = lambda: keras.optimizers.LossScaleOptimizer(  # noqa: E731
        keras.optimizers.SGD(0.1), initial_scale=2.0**8
    )
    ref, model = both({"micro_batches": 3}, optimizer=lso)
    ref.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
    assert max_weight_diff(ref, model) < 2e-3  # float16 forward rounding


def test_save_load_keeps_micro_batches(tmp_path):
    model = fast(micro_batches=3)
    model.compile(optimizer="sgd", loss="mse")
    model.fit(*data(n=6), batch_size=6, verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    assert keras.models.load_model(path).micro_batches == 3


@pytest.mark.parametrize(
    "value, error, match",
    [
        (0, ValueError, r"`micro_batches` must be an integer >= 1.*Received: micro_batches=0"),
        (
            1.5,
            TypeError,
            r"`micro_batches` must be an integer >= 1.*micro_batches=1.5 of type float",
        ),
        ("2", TypeError, r"`micro_batches` must be an integer.*micro_batches='2' of type str"),
    ],
)
def test_bad_micro_batches(value, error, match):
    with pytest.raises(error, match=match):
        fast(micro_batches=value)


@pytest.mark.needs_tensorflow(reason="batches of a static shape from a tf.data pipeline")
def test_micro_batches_larger_than_the_batch():
    # Batches of 2 (a static shape) in `micro_batches=4`: one slice per row,
    # no empty or padded slice; the un-split step on batches of 2.
    x, y = data(n=4)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(2, drop_remainder=True)
    ref, model = both({"micro_batches": 4})
    ref.fit(dataset, verbose=0)
    model.fit(dataset, verbose=0)
    assert max_weight_diff(ref, model) < 1e-6
    assert int(model.optimizer.iterations.numpy()) == 2


def two_task_model(regularized, **options):
    """A trunk shared by two heads (targets of opposite signs: conflict)."""
    import keras_fastgrad

    keras.utils.set_random_seed(5)
    inputs = keras.Input((3,))
    trunk = keras.layers.Dense(
        6,
        activation="tanh",
        name="trunk",
        kernel_regularizer=keras.regularizers.L2(0.01) if regularized else None,
    )(inputs)
    heads = {t: keras.layers.Dense(1, name=t)(trunk) for t in ("a", "b")}
    model = keras_fastgrad.FastGradModel(inputs, heads, **options)
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss={"a": "mse", "b": "mae"},
        loss_weights={"a": 1.0, "b": 0.5},
    )
    return model


@pytest.mark.parametrize("method", ["pcgrad", "mgda", "upgrad"])
@pytest.mark.parametrize("regularized", [False, True])
def test_micro_batches_with_multitask_equal_the_unsplit_merge(method, regularized):
    # Reference: the un-split multi-task step (itself checked against
    # numpy in test_merger.py) on the same batches of 7 (3 slices:
    # 3, 2, 2). The merge is nonlinear: merging per slice
    # would differ; the task gradients must be summed first.
    x, _ = data(n=14)
    rng = np.random.default_rng(3)
    y = {
        "a": rng.normal(size=(14, 1)).astype("float32"),
        "b": -3.0 + rng.normal(size=(14, 1)).astype("float32"),
    }
    w = np.linspace(0.5, 2.0, 14).astype("float32")
    ref = two_task_model(regularized, multitask=method)
    model = two_task_model(regularized, multitask=method, micro_batches=3)
    h_ref = ref.fit(x, y, sample_weight=w, batch_size=7, epochs=2, shuffle=False, verbose=0)
    h = model.fit(x, y, sample_weight=w, batch_size=7, epochs=2, shuffle=False, verbose=0)
    assert max_weight_diff(ref, model) < 1e-5
    np.testing.assert_allclose(h.history["loss"], h_ref.history["loss"], rtol=1e-5)
    # Merging per slice would not match (the test can tell them apart).
    per_slice = two_task_model(regularized, multitask=method)
    per_slice.fit(x, y, sample_weight=w, batch_size=3, epochs=2, shuffle=False, verbose=0)
    assert max_weight_diff(ref, per_slice) > 1e-4


@pytest.mark.parametrize("n", [0, 1, 2, 5, 7, 22, 24])
@pytest.mark.parametrize("slices", [2, 3, 4])
def test_slice_sizes_are_numpy_array_split_without_empty_slices(n, slices):
    from keras_fastgrad.step.splitting import slice_sizes

    expected = [len(p) for p in np.array_split(np.arange(n), slices) if len(p)] or [0]
    assert slice_sizes(n, slices) == expected
