"""`micro_batches` (both backends) against plain `keras.Model` on the whole batch
(same initial weights): the slices' summed, weighted gradients are the
whole batch's, and the loss and metrics logged are the whole batch's."""

import keras
import numpy as np
import pytest

import keras_fastgrad as kf
from tests.helpers import conv, fastgrad_run, masked_gru, reference
from tests.helpers import max_weight_diff as max_diff
from tests.helpers import mlp_16 as mlp
from tests.helpers import uneven_data as data

TOL = 1e-5
N = 44  # two batches of 22, split 8 + 7 + 7 by micro_batches=3


@pytest.mark.parametrize("compile_kw", [{}, {"jit_compile": False}], ids=["jit", "eager"])
def test_uneven_split_equals_the_whole_batch(compile_kw):
    x, y = data()
    x, y = x[:N], y[:N]
    epochs = 1 if compile_kw else 2  # (eager: slower)
    plain = mlp()
    plain.compile(keras.optimizers.Adam(1e-2), "mse", metrics=["mae"])
    ref = plain.fit(x, y, batch_size=22, epochs=epochs, shuffle=False, verbose=0)
    compile_kw = {"metrics": ["mae"], **compile_kw}
    model, history = fastgrad_run(
        mlp, x, y, batch_size=22, epochs=epochs, micro_batches=3, compile_kw=compile_kw
    )
    assert max_diff(plain, model) < TOL
    assert int(model.optimizer.iterations.numpy()) == 2 * epochs
    for key in ("loss", "mae"):  # the whole batch's, not the last slice's
        np.testing.assert_allclose(history.history[key], ref.history[key], rtol=1e-5)


def test_sample_weights_are_exact():
    x, y = data()
    w = np.random.default_rng(1).uniform(0, 2, size=N).astype("float32")
    ref = reference(mlp, x[:N], y[:N], batch_size=22, sample_weight=w)
    model, _ = fastgrad_run(mlp, x[:N], y[:N], batch_size=22, sample_weight=w, micro_batches=3)
    assert max_diff(ref, model) < TOL


def test_masked_gru_embedding():
    # Slices with different numbers of valid steps, each weighted by its
    # own (batches of 21 in 3 equal slices: one scan, one trace of the GRU).
    rng = np.random.default_rng(2)
    tokens = rng.integers(1, 20, size=(42, 7))
    lengths = rng.integers(1, 8, size=42)
    tokens[np.arange(7)[None, :] >= lengths[:, None]] = 0
    tokens = tokens.astype("int32")
    _, y = data()
    if keras.backend.backend() == "tensorflow":
        # On TensorFlow the Embedding's gradient is a `tf.IndexedSlices` with
        # a row per occurrence, and Keras' Adam squares those rows one by one
        # (docs/concepts/exactness.md, limit 1): the big batch's exact step
        # is Keras' own accumulation of its 3 slices, which sums them dense.
        ref = reference(
            masked_gru, tokens, y[:42], batch_size=7, epochs=1, gradient_accumulation_steps=3
        )
    else:
        ref = reference(masked_gru, tokens, y[:42], batch_size=21, epochs=1)
    model, _ = fastgrad_run(masked_gru, tokens, y[:42], batch_size=21, epochs=1, micro_batches=3)
    assert max_diff(ref, model) < TOL


@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "sum"])
def test_per_pixel_conv2d_loss(reduction):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(N, 6, 6, 2)).astype("float32")
    y = rng.normal(size=(N, 6, 6, 1)).astype("float32")
    loss = keras.losses.MeanSquaredError(reduction=reduction)
    ref = reference(conv, x, y, batch_size=22, loss=loss, epochs=1)
    model, _ = fastgrad_run(conv, x, y, batch_size=22, loss=loss, epochs=1, micro_batches=3)
    assert max_diff(ref, model) < TOL


def test_with_accumulation_equals_the_window_batch():
    # Batches of 11 (slices 6 + 5), windows of 2 batches: updates on 22 rows.
    x, y = data()
    ref = reference(mlp, x[:N], y[:N], batch_size=22)
    model, _ = fastgrad_run(mlp, x[:N], y[:N], batch_size=11, micro_batches=2, accumulation_steps=2)
    assert max_diff(ref, model) < TOL
    assert model.telemetry_counters()["updates"] == 4.0


def test_a_nan_slice_drops_the_whole_batch():
    x, y = data()
    x, y = x[:N].copy(), y[:N]
    x[30, 2] = np.nan  # batch 1 (rows 22-43), its second slice
    plain = mlp()
    plain.compile(keras.optimizers.Adam(1e-2), "mse")
    plain.train_on_batch(x[:22], y[:22])  # only the finite batch
    model, _ = fastgrad_run(
        mlp, x, y, epochs=1, batch_size=22, micro_batches=3, skip_nonfinite=True
    )
    assert max_diff(plain, model) < TOL
    counters = model.telemetry_counters()
    assert counters["nonfinite_count"] == 1.0 and counters["updates"] == 1.0


def test_batchnorm_moves_per_slice_as_keras_accumulation():
    # Each slice normalised by its own moments, the moving statistics one
    # step per slice: Keras' own accumulation of the two halves (SGD: the
    # mean of two equal slices' gradients is the batch's).
    def bn(cls=keras.Model, **options):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8,))
        h = keras.layers.BatchNormalization()(keras.layers.Dense(6)(inputs))
        return cls(inputs, keras.layers.Dense(3)(h), **options)

    x, y = data()
    x, y = x[:32], y[:32]
    plain = bn()
    plain.compile(keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), "mse")
    plain.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    model, _ = fastgrad_run(
        bn,
        x,
        y,
        epochs=1,
        optimizer=keras.optimizers.SGD(0.1),
        micro_batches=2,
        batchnorm_statistics="micro_batch",
    )
    assert max_diff(plain, model) < TOL  # ("window": tests/step/test_batchnorm_jax.py)


def test_regulariser_under_summed_slices_counts_once_per_batch():
    # Under `reduction="sum"` each slice's share is 1: the weight penalty,
    # in every slice's loss, is taken back to once per batch (both backends).
    def regularized(cls=keras.Model, **options):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8,))
        out = keras.layers.Dense(3, kernel_regularizer="l2")(inputs)
        return cls(inputs, out, **options)

    x, y = data()
    total = keras.losses.MeanSquaredError(reduction="sum")  # each slice's share 1
    ref = reference(regularized, x[:N], y[:N], batch_size=22, epochs=1, loss=total)
    model, _ = fastgrad_run(
        regularized, x[:N], y[:N], batch_size=22, epochs=1, loss=total, micro_batches=2
    )
    assert max_diff(ref, model) < TOL
    # By rows, under a mean: exact (each slice's loss holds the penalty once).
    ref = reference(regularized, x[:N], y[:N], batch_size=22, epochs=1)
    model, _ = fastgrad_run(regularized, x[:N], y[:N], batch_size=22, epochs=1, micro_batches=3)
    assert max_diff(ref, model) < TOL
    assert isinstance(model, kf.FastGradModel)


def test_multitask_regulariser_under_summed_slices_counts_once_per_batch():
    # The merged step's regularisation row, under `reduction="sum"`: taken
    # back to once per batch, as the un-split step (same backend) counts it.
    def two_heads(**options):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((4,))
        h = keras.layers.Dense(5, activation="tanh", kernel_regularizer="l2")(inputs)
        heads = {n: keras.layers.Dense(1, name=n)(h) for n in ("a", "b")}
        return kf.FastGradModel(inputs, heads, multitask="upgrad", **options)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(22, 4)).astype("float32")
    y = {n: rng.normal(size=(22, 1)).astype("float32") for n in ("a", "b")}
    models = []
    for slices in (1, 3):
        model = two_heads(micro_batches=slices)
        total = {n: keras.losses.MeanSquaredError(reduction="sum") for n in ("a", "b")}
        model.compile(keras.optimizers.SGD(0.01), total)
        model.fit(x, y, batch_size=22, epochs=2, shuffle=False, verbose=0)
        models.append(model)
    assert max_diff(*models) < TOL


@pytest.mark.jax_only(reason="`compute_loss_and_updates` is Keras' JAX trainer's")
def test_an_own_compute_loss_and_updates_is_called():
    # A subclass's own JAX forward and loss (here a per-row mean term more):
    # called, whole batch or slices, as `keras.Model`'s step calls it.
    def with_term(base):
        class Model(base):
            def compute_loss_and_updates(self, tv, ntv, mv, x, y, sw, **kwargs):
                loss, (unscaled, y_pred, ntv, mv) = super().compute_loss_and_updates(
                    tv, ntv, mv, x, y, sw, **kwargs
                )
                extra = 0.1 * keras.ops.mean(keras.ops.square(y_pred))
                return loss + extra, (unscaled + extra, y_pred, ntv, mv)

        return Model

    def build(cls=keras.Model, **options):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8,))
        return with_term(cls)(inputs, keras.layers.Dense(3)(inputs), **options)

    x, y = data()
    ref = reference(build, x[:N], y[:N], batch_size=22, epochs=1)
    for options in ({}, {"micro_batches": 2}):
        model, _ = fastgrad_run(build, x[:N], y[:N], batch_size=22, epochs=1, **options)
        assert max_diff(ref, model) < TOL


def test_mixed_float16_slices_and_a_dropped_batch():
    # Loss scaling: each slice's share is applied to its unscaled float32
    # gradient (the scaled loss times `D_i` would overflow float16).
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        x, y = data()
        x = x[:N].copy()
        x[30, 1] = np.nan  # batch 1 of 2
        ref = reference(mlp, x[:22], y[:22], batch_size=22)
        model, history = fastgrad_run(mlp, x, y[:N], batch_size=22, micro_batches=3)
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
        counters = model.telemetry_counters()
        assert counters["updates"] == 2.0 and counters["nonfinite_count"] == 2.0
        assert max_diff(ref, model) < 5e-3  # float16 forward pass
        assert all(np.isfinite(history.history["loss"]))
    finally:
        keras.mixed_precision.set_global_policy("float32")
