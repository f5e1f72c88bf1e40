"""FastGradModel against plain `keras.Model` runs (same initial weights), on
either backend: the equivalent big batch, `Adam(global_clipnorm=)`, the
data without its NaN samples. (A subclass's own JAX `train_step(state,
data)`: tests/end_to_end/test_own_step_jax.py.)"""

import keras
import numpy as np
import pytest

import keras_fastgrad as kf
from tests.helpers import ROWS, conv, embedding, fastgrad_run, masked_gru, reference
from tests.helpers import max_weight_diff as max_diff
from tests.helpers import mlp_16 as mlp
from tests.helpers import uneven_data as data

TOL = 1e-5


class DenseAdam(keras.optimizers.Adam):
    """Keras' Adam on the dense gradient. On TensorFlow an `Embedding`'s
    gradient is an `IndexedSlices`, whose values Keras' Adam squares row by
    row (a repeated id adds its parts' squares, not the square of their
    sum); FastGradModel applies the dense gradient, the big batch's step.
    On JAX gradients are dense already: Keras' own Adam."""

    def apply(self, grads, trainable_variables=None):
        if keras.backend.backend() == "tensorflow":
            import tensorflow as tf

            grads = [tf.convert_to_tensor(g) if g is not None else g for g in grads]
        return super().apply(grads, trainable_variables)


def dense_reference(build, x, y, epochs=2, batch_size=ROWS, **adam):
    """`reference` (a plain `keras.Model` on the big batch), with Adam on
    the dense gradient (`DenseAdam`)."""
    model = build(keras.Model)
    model.compile(DenseAdam(1e-2, **adam), "mse")
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    return model


@pytest.mark.parametrize(
    "compile_kw",
    [{}, {"jit_compile": False}, {"steps_per_execution": 3}],
    ids=["jit", "eager", "spe3"],
)
def test_accumulation_equals_the_big_batch(compile_kw):
    x, y = data()
    ref = reference(mlp, x, y)
    model, _ = fastgrad_run(mlp, x, y, accumulation_steps=4, compile_kw=compile_kw)
    assert max_diff(ref, model) < TOL
    assert int(model.optimizer.iterations.numpy()) == 2
    assert model.telemetry_counters()["updates"] == 2.0


def test_partial_window_is_applied_at_the_epoch_end():
    # 4 batches, windows of 3: [16, 16, 16] then [10] at the epoch's end.
    x, y = data()
    plain = mlp()
    plain.compile(keras.optimizers.Adam(1e-2), "mse")
    for _ in range(2):
        plain.train_on_batch(x[:48], y[:48])
        plain.train_on_batch(x[48:], y[48:])
    model, _ = fastgrad_run(mlp, x, y, accumulation_steps=3)
    assert max_diff(plain, model) < TOL
    assert int(model.optimizer.iterations.numpy()) == 4


def test_sample_weights_are_exact():
    x, y = data()
    w = np.random.default_rng(1).uniform(0, 2, size=ROWS).astype("float32")
    ref = reference(mlp, x, y, sample_weight=w)
    model, _ = fastgrad_run(mlp, x, y, sample_weight=w, accumulation_steps=4)
    assert max_diff(ref, model) < TOL


def test_masked_gru_with_clipping():
    rng = np.random.default_rng(2)
    tokens = rng.integers(1, 20, size=(ROWS, 7))
    lengths = rng.integers(1, 8, size=ROWS)
    tokens[np.arange(7)[None, :] >= lengths[:, None]] = 0  # right padding
    tokens = tokens.astype("int32")
    _, y = data()
    ref = dense_reference(masked_gru, tokens, y, global_clipnorm=0.05)
    model, _ = fastgrad_run(masked_gru, tokens, y, accumulation_steps=4, clip_norm=0.05)
    assert max_diff(ref, model) < TOL


def test_per_pixel_loss_and_sum_reduction():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(ROWS, 6, 6, 2)).astype("float32")
    y = rng.normal(size=(ROWS, 6, 6, 1)).astype("float32")
    ref = reference(conv, x, y)
    model, _ = fastgrad_run(conv, x, y, accumulation_steps=4)
    assert max_diff(ref, model) < TOL
    # `reduction="sum"`: the window's gradient is the sum, not a mean.
    total = keras.losses.MeanSquaredError(reduction="sum")
    ref = reference(conv, x, y, loss=total, epochs=1)
    model, _ = fastgrad_run(conv, x, y, loss=total, epochs=1, accumulation_steps=4)
    assert max_diff(ref, model) < TOL


def test_embedding_sequential_and_fastgrad_adapter():
    rng = np.random.default_rng(4)
    tokens = rng.integers(0, 30, size=(ROWS, 5)).astype("int32")
    _, y = data()
    ref = dense_reference(embedding, tokens, y)
    model, _ = fastgrad_run(embedding, tokens, y, accumulation_steps=4)
    assert max_diff(ref, model) < TOL
    # `fastgrad(model)` and `FastGradSequential` on the MLP.
    x, y = data()
    ref = reference(mlp, x, y, global_clipnorm=0.1)
    adapted = kf.fastgrad(mlp(), accumulation_steps=4, clip_norm=0.1)
    adapted.compile(keras.optimizers.Adam(1e-2), "mse")
    adapted.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert max_diff(ref, adapted) < TOL

    def sequential(cls=keras.Sequential, **options):
        keras.utils.set_random_seed(0)
        layers = [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="tanh"),
            keras.layers.Dense(3),
        ]
        cls = kf.FastGradSequential if cls is not keras.Model else keras.Sequential
        return cls(layers, **options)

    ref = reference(sequential, x, y)
    seq, _ = fastgrad_run(sequential, x, y, accumulation_steps=4)
    assert isinstance(seq, keras.Sequential)
    assert max_diff(ref, seq) < TOL


class BranchingModel(keras.Model):
    """A subclass whose call differs in training (a deterministic branch)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(16, activation="tanh")
        self.out = keras.layers.Dense(3)

    def call(self, x, training=False):
        h = self.hidden(x)
        if training:
            h = h * 0.5
        return self.out(h)


class FastGradBranchingModel(kf.FastGradModel, BranchingModel):
    pass


def subclassed(cls=keras.Model, **options):
    keras.utils.set_random_seed(0)
    model = (FastGradBranchingModel if cls is not keras.Model else BranchingModel)(**options)
    model(np.zeros((1, 8), "float32"))
    return model


def test_subclass_with_a_training_branch():
    x, y = data()
    ref = reference(subclassed, x, y)
    model, _ = fastgrad_run(subclassed, x, y, accumulation_steps=4, clip_norm=0.1)
    ref_clipped = reference(subclassed, x, y, global_clipnorm=0.1)
    assert max_diff(ref_clipped, model) < TOL
    assert max_diff(ref, model) > 10 * TOL  # the clip acted
    assert model.telemetry_counters()["clipped_updates"] > 0


@pytest.mark.parametrize("accumulation_steps", [1, 4])
def test_clip_norm_equals_adam_global_clipnorm(accumulation_steps):
    x, y = data()
    batch = 16 if accumulation_steps == 1 else ROWS
    ref = reference(mlp, x, y, batch_size=batch, global_clipnorm=0.05)
    model, _ = fastgrad_run(mlp, x, y, accumulation_steps=accumulation_steps, clip_norm=0.05)
    assert max_diff(ref, model) < TOL
    assert model.telemetry_counters()["clipped_updates"] > 0


def _poisoned():
    x, y = data()
    x = x.copy()
    x[20, 3] = np.nan  # micro-batch 2 (rows 16..31)
    return x, y, np.r_[0:16, 32:ROWS]


@pytest.mark.parametrize("accumulation_steps", [1, 4])
def test_nonfinite_micro_batch_is_dropped_and_counted(accumulation_steps):
    x, y, kept = _poisoned()
    batch = 16 if accumulation_steps == 1 else len(kept)
    ref = reference(mlp, x[kept], y[kept], batch_size=batch, global_clipnorm=0.05)
    model, history = fastgrad_run(mlp, x, y, accumulation_steps=accumulation_steps, clip_norm=0.05)
    assert max_diff(ref, model) < TOL
    assert model.telemetry_counters()["nonfinite_count"] == 2.0
    assert all(np.isfinite(history.history["loss"]))  # the dropped batch is not in the mean


@pytest.mark.parametrize("accumulation_steps", [1, 4])
def test_loss_scale_optimizer_drops_and_halves(accumulation_steps):
    x, y, kept = _poisoned()
    batch = 16 if accumulation_steps == 1 else len(kept)
    ref = reference(mlp, x[kept], y[kept], batch_size=batch)
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-2))
    model, _ = fastgrad_run(mlp, x, y, optimizer=optimizer, accumulation_steps=accumulation_steps)
    assert max_diff(ref, model) < TOL
    assert float(optimizer.dynamic_scale.numpy()) == 2.0**15 / 4  # halved twice
    assert model.telemetry_counters()["nonfinite_count"] == 2.0


def test_mixed_float16_trains_with_dropped_micro_batches():
    keras.mixed_precision.set_global_policy("mixed_float16")
    x, y, kept = _poisoned()
    ref = reference(mlp, x[kept], y[kept], batch_size=len(kept))
    model, history = fastgrad_run(mlp, x, y, accumulation_steps=4)
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert model.telemetry_counters()["nonfinite_count"] == 2.0
    assert max_diff(ref, model) < 5e-3  # float16 forward pass
    assert all(np.isfinite(history.history["loss"]))


@pytest.mark.parametrize(
    "options",
    [{}, {"clip_norm": 0.05}, {"accumulation_steps": 2}],
    ids=["plain", "clip", "acc2"],
)
def test_skip_nonfinite_false_applies_like_keras(options):
    x, y, _ = _poisoned()
    batch = 32 if "accumulation_steps" in options else 16
    clip = {"global_clipnorm": options["clip_norm"]} if "clip_norm" in options else {}
    ref = reference(mlp, x, y, batch_size=batch, epochs=1, **clip)
    model, _ = fastgrad_run(mlp, x, y, epochs=1, skip_nonfinite=False, **options)
    for got, want in zip(model.get_weights(), ref.get_weights(), strict=True):
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert np.isnan(model.get_weights()[0]).all()  # Keras applies the NaN gradient
    # Nothing is dropped, nothing checked or counted (as on TensorFlow).
    counters = model.telemetry_counters()
    assert counters["nonfinite_count"] == 0.0
    assert counters["updates"] == (2.0 if "accumulation_steps" in options else 4.0)


def test_train_on_batch_apply_partial_window_and_evaluate():
    x, y = data()
    plain = mlp()
    plain.compile(keras.optimizers.Adam(1e-2), "mse")
    plain.train_on_batch(x[:32], y[:32])
    plain.train_on_batch(x[32:48], y[32:48])
    model = mlp(kf.FastGradModel, accumulation_steps=2)
    model.compile(keras.optimizers.Adam(1e-2), "mse")
    for start in (0, 16, 32):
        model.train_on_batch(x[start : start + 16], y[start : start + 16])
    assert model.apply_partial_window() is not None
    assert model.apply_partial_window() is None  # nothing pending now
    assert max_diff(plain, model) < TOL
    assert model.evaluate(x, y, verbose=0) == pytest.approx(
        plain.evaluate(x, y, verbose=0), rel=1e-5
    )


def test_divergence_stop():
    x, y = data()
    x = np.full_like(x, np.nan)
    model = mlp(kf.FastGradModel, max_consecutive_nonfinite=3)
    model.compile(keras.optimizers.Adam(1e-2), "mse")
    with pytest.warns(RuntimeWarning, match="consecutive non-finite"):
        history = model.fit(x, y, batch_size=4, epochs=3, verbose=0)
    assert len(history.history["loss"]) == 1 and np.isnan(history.history["loss"][0])
    assert model.telemetry_counters()["nonfinite_count"] == 3.0


def _batchnorm(cls=keras.Model, **options):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    h = keras.layers.BatchNormalization()(keras.layers.Dense(16)(inputs))
    return cls(inputs, keras.layers.Dense(3)(h), **options)


def test_batchnorm_without_split_is_keras_and_micro_batch_statistics_train():
    x, y = data()
    ref = reference(_batchnorm, x, y, batch_size=16)
    model, _ = fastgrad_run(_batchnorm, x, y)
    assert max_diff(ref, model) < TOL  # moving statistics included
    model, _ = fastgrad_run(
        _batchnorm, x, y, accumulation_steps=4, batchnorm_statistics="micro_batch"
    )
    assert all(np.isfinite(w).all() for w in model.get_weights())


@pytest.mark.parametrize("accumulation_steps, doublings", [(1, 4), (2, 2)])
def test_loss_scale_grows_per_applied_update(accumulation_steps, doublings):
    # 8 batches over 2 epochs: 8 updates, or 4 windows of 2; growth every 2.
    x, y = data()
    optimizer = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.Adam(1e-2), dynamic_growth_steps=2
    )
    fastgrad_run(mlp, x, y, optimizer=optimizer, accumulation_steps=accumulation_steps)
    assert float(optimizer.dynamic_scale.numpy()) == 2.0 ** (15 + doublings)


def test_class_weights_are_exact():
    x, _ = data()
    labels = np.random.default_rng(5).integers(0, 3, size=ROWS)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    weights = {0: 1.0, 1: 3.0, 2: 0.5}
    ref = mlp()
    ref.compile(keras.optimizers.Adam(1e-2), loss)
    ref.fit(x, labels, class_weight=weights, batch_size=ROWS, epochs=2, shuffle=False, verbose=0)
    model = mlp(kf.FastGradModel, accumulation_steps=4)
    model.compile(keras.optimizers.Adam(1e-2), loss)
    model.fit(x, labels, class_weight=weights, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert max_diff(ref, model) < TOL


def test_batchnorm_micro_batch_statistics_equal_keras_own_accumulation():
    # Equal micro-batches (64 rows, 16 each) and SGD: Keras' own
    # `gradient_accumulation_steps` is then the same step, BatchNorm's
    # moving statistics moved by every micro-batch in both.
    rng = np.random.default_rng(6)
    x = rng.normal(size=(64, 8)).astype("float32")
    y = rng.normal(size=(64, 3)).astype("float32")
    ref = _batchnorm()
    ref.compile(keras.optimizers.SGD(0.1, gradient_accumulation_steps=4), "mse")
    ref.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    model = _batchnorm(kf.FastGradModel, accumulation_steps=4, batchnorm_statistics="micro_batch")
    model.compile(keras.optimizers.SGD(0.1), "mse")
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert max_diff(ref, model) < TOL
