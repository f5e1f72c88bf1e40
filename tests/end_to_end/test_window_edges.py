"""The accumulation window and the step's state at their edges (issue 27:
1, 4, 6, 7, 9c).

Reference: a plain `keras.Model` with the same initial weights, trained
on the big batches a window stands for (the concatenation of its
micro-batches; a window left partial at an epoch's end is one smaller big
batch), or on the same data where nothing is combined. Keras reduces a
loss with `divide_no_nan`: a batch of no rows has loss 0 and gradient 0,
and Keras still steps with it (momentum moves, `iterations` counts it).
"""

import warnings

import keras
import numpy as np
import pytest

import keras_fastgrad
from tests.helpers import (
    reference_gradients,
    tf,  # (TensorFlow imported at first use: not on JAX)
)

# Data of unknown size: tf.data pipelines, on both backends.
pytestmark = pytest.mark.needs_tensorflow(reason="tf.data pipelines of unknown size")

FG = keras_fastgrad.FastGradModel


def mlp(cls, **options):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((3,))
    h = keras.layers.Dense(4, activation="tanh")(inputs)
    return cls(inputs, keras.layers.Dense(1)(h), **options)


def conv(cls, **options):
    """Conv2D with a per-pixel loss: the loss normaliser is pixels."""
    keras.utils.set_random_seed(2)
    inputs = keras.Input((5, 5, 2))
    h = keras.layers.Conv2D(3, 3, padding="same", activation="tanh")(inputs)
    return cls(inputs, keras.layers.Conv2D(1, 1)(h), **options)


def rnn(cls, **options):
    """Embedding(mask_zero) -> SimpleRNN -> a per-timestep loss."""
    keras.utils.set_random_seed(3)
    inputs = keras.Input((5,), dtype="int32")
    h = keras.layers.Embedding(9, 3, mask_zero=True)(inputs)
    h = keras.layers.SimpleRNN(4, return_sequences=True)(h)
    return cls(inputs, keras.layers.Dense(1)(h), **options)


def data_for(build, n, seed=0):
    rng = np.random.default_rng(seed)
    if build is conv:
        return (
            rng.normal(size=(n, 5, 5, 2)).astype("float32"),
            rng.normal(size=(n, 5, 5, 1)).astype("float32"),
        )
    if build is rnn:
        x = rng.integers(1, 9, (n, 5)).astype("int32")
        x[:, 3:] *= rng.integers(0, 2, (n, 2)).astype("int32")  # masked tails
        return x, rng.normal(size=(n, 5, 1)).astype("float32")
    return rng.normal(size=(n, 3)).astype("float32"), rng.normal(size=(n, 1)).astype("float32")


def sgd():
    return keras.optimizers.SGD(0.1, momentum=0.9)


def compiled(build, cls, optimizer=None, loss="mse", **options):
    model = build(cls, **options)
    model.compile(optimizer=optimizer or sgd(), loss=loss)
    return model


def assert_same_training(ref, model, atol=1e-6):
    assert int(model.optimizer.iterations.numpy()) == int(ref.optimizer.iterations.numpy())
    for a, b in zip(ref.get_weights(), model.get_weights()):
        np.testing.assert_allclose(b, a, atol=atol, rtol=1e-5)


def fit_big_batches(ref, x, y, sizes, epochs=1):
    """`keras.Model` stepping once per big batch, `sizes` rows each, in
    order. Returns the last epoch's loss as Keras logs it (the batches'
    losses weighted by their rows)."""
    for _ in range(epochs):
        start, losses = 0, []
        for size in sizes:
            losses.append(ref.train_on_batch(x[start : start + size], y[start : start + size]))
            start += size
    return float(np.dot(losses, sizes) / np.sum(sizes))


# ---------------------------------------- 1: data of unknown size
def unknown_size(x, y, batch, kind):
    """A `tf.data` pipeline whose cardinality Keras cannot know."""
    if kind == "generator":
        spec = (
            tf.TensorSpec((None,) + x.shape[1:], tf.as_dtype(x.dtype)),
            tf.TensorSpec((None,) + y.shape[1:], tf.as_dtype(y.dtype)),
        )

        def batches():
            for i in range(0, len(x), batch):
                yield x[i : i + batch], y[i : i + batch]

        return tf.data.Dataset.from_generator(batches, output_signature=spec)
    data = tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda *_: True)
    return data.batch(batch)


@pytest.mark.parametrize("kind", ["generator", "filter"])
@pytest.mark.parametrize("epochs, steps_per_execution", [(1, 1), (3, 1), (2, 3)])
def test_unknown_size_data_applies_the_epochs_partial_window(kind, epochs, steps_per_execution):
    # 3 batches of 4, windows of 2: per epoch one window of 8 rows and a
    # partial one of 4, applied at the epoch's end (2 updates an epoch).
    x, y = data_for(mlp, 12)
    ref = compiled(mlp, keras.Model)
    fit_big_batches(ref, x, y, [8, 4], epochs)
    model = mlp(FG, accumulation_steps=2)
    model.compile(optimizer=sgd(), loss="mse", steps_per_execution=steps_per_execution)
    model.fit(unknown_size(x, y, 4, kind), epochs=epochs, verbose=0)
    assert_same_training(ref, model)
    assert int(model.fastgrad_step_state.accumulator.micro_step.numpy()) == 0
    assert model.telemetry_counters()["updates"] == 2 * epochs


@pytest.mark.parametrize("build", [conv, rnn])
def test_unknown_size_data_partial_window_beyond_an_mlp(build):
    # 5 batches of 3, windows of 3: big batches of 9 and 6 rows per epoch.
    x, y = data_for(build, 15)
    ref = compiled(build, keras.Model)
    fit_big_batches(ref, x, y, [9, 6], epochs=2)
    model = compiled(build, FG, accumulation_steps=3)
    model.fit(unknown_size(x, y, 3, "generator"), epochs=2, verbose=0)
    assert_same_training(ref, model)


@pytest.mark.parametrize("build, steps_per_execution", [(rnn, 1), (mlp, 3)])
def test_unknown_size_data_without_the_gate_counts_only_real_micro_batches(
    build, steps_per_execution
):
    # `skip_nonfinite=False`: every micro-batch kept, the window in Keras'
    # form (`backend.tensorflow.accumulation.add_or_apply`, its update in the
    # window's `cond`). 5 batches of 3, windows of 3: big batches of 9 and
    # 6 rows an epoch; the batch Keras asks for past the end never counts.
    x, y = data_for(build, 15)
    ref = compiled(build, keras.Model)
    fit_big_batches(ref, x, y, [9, 6], epochs=2)
    model = build(FG, accumulation_steps=3, skip_nonfinite=False)
    model.compile(optimizer=sgd(), loss="mse", steps_per_execution=steps_per_execution)
    model.fit(unknown_size(x, y, 3, "generator"), epochs=2, verbose=0)
    assert_same_training(ref, model)
    assert int(model.fastgrad_step_state.accumulator.micro_step.numpy()) == 0
    assert model.telemetry_counters()["updates"] == 4


# ---------------------------------------- 6: batches of no rows
def with_empty_batches(x, y, batch, empty):
    """`tf.data` batches of `batch` rows, those numbered in `empty` filtered
    down to 0 rows (shapes unknown to the step, as a `filter` leaves them)."""
    flags = tf.constant([i not in empty for i in range(len(x) // batch)])

    def keep(i, b):
        rows = tf.fill([tf.shape(b[0])[0]], flags[i])
        return tuple(tf.boolean_mask(t, rows) for t in b)

    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).enumerate().map(keep)


def fit_as_keras(ref, x, y, batch, empty, epochs=1):
    """`keras.Model.fit` on `with_empty_batches(x, y, batch, empty)`; the
    loss it logs per epoch. Keras' JAX trainer raises on a batch of no rows
    (Keras leaves the loss of no rows unreduced, shape `(0,)`, and
    `jax.grad` needs a scalar): there its TensorFlow step is replayed, one
    `train_on_batch` per batch with rows and a zero gradient applied per
    batch without (the momentum still moves the weights)."""
    if keras.backend.backend() != "jax":
        data = with_empty_batches(x, y, batch, empty)
        return ref.fit(data, epochs=epochs, verbose=0).history["loss"]
    variables = ref.trainable_variables
    history = []
    for _ in range(epochs):
        losses = []  # (all batches with rows have `batch` rows)
        for i in range(len(x) // batch):
            if i in empty:
                ref.optimizer.apply([keras.ops.zeros(v.shape) for v in variables], variables)
            else:
                rows = slice(i * batch, (i + 1) * batch)
                losses.append(ref.train_on_batch(x[rows], y[rows]))
        history.append(float(np.mean(losses)) if losses else 0.0)
    return history


# (Not Conv2D: TensorFlow's CPU convolution fails on a batch of no rows,
# `keras.Model`'s step too.)
@pytest.mark.parametrize("build", [mlp, rnn])
@pytest.mark.parametrize(
    "options", [{"micro_batches": 2}, {}, {"micro_batches": 2, "telemetry": True}]
)
def test_empty_batches_step_as_keras_does(build, options):
    x, y = data_for(build, 24)
    empty = {1, 2, 4}  # of 6 batches of 4
    ref = compiled(build, keras.Model)
    ref_loss = fit_as_keras(ref, x, y, 4, empty, epochs=2)
    model = compiled(build, FG, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no "diverged" stop
        h = model.fit(with_empty_batches(x, y, 4, empty), epochs=2, verbose=0)
    assert int(ref.optimizer.iterations.numpy()) == 12
    assert_same_training(ref, model)
    np.testing.assert_allclose(h.history["loss"], ref_loss, rtol=1e-5)
    assert model.telemetry_counters()["nonfinite_count"] == 0


@pytest.mark.parametrize("options", [{"micro_batches": 2}, {}, {"accumulation_steps": 2}])
def test_only_empty_batches_step_and_log_zero_as_keras_does(options):
    # Keras makes 13 zero steps and logs loss 0.0; these are no divergence.
    x, y = data_for(mlp, 52)
    empty = set(range(13))
    ref = compiled(mlp, keras.Model)
    ref_loss = fit_as_keras(ref, x, y, 4, empty)
    model = compiled(mlp, FG, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        h = model.fit(with_empty_batches(x, y, 4, empty), verbose=0)
    assert ref_loss == [0.0]
    assert h.history["loss"] == [0.0]
    windows = 13 if "accumulation_steps" not in options else 7  # 6 full, 1 partial
    assert int(model.optimizer.iterations.numpy()) == windows
    np.testing.assert_allclose(
        np.concatenate([w.ravel() for w in model.get_weights()]),
        np.concatenate([w.ravel() for w in ref.get_weights()]),
    )
    assert model.telemetry_counters()["nonfinite_count"] == 0


@pytest.mark.parametrize("build", [mlp, rnn])
def test_empty_micro_batches_in_windows_match_the_big_batches(build):
    # Windows of 2 batches of 4; batches 1 and 4 are empty: the big
    # batches are 4, 8 and 4 rows.
    x, y = data_for(build, 24)
    ref = compiled(build, keras.Model)
    rows = [b for i, b in enumerate(np.split(np.arange(24), 6)) if i not in (1, 4)]
    order = np.concatenate(rows)
    ref_loss = fit_big_batches(ref, x[order], y[order], [4, 8, 4], epochs=1)
    model = compiled(build, FG, accumulation_steps=2)
    h = model.fit(with_empty_batches(x, y, 4, {1, 4}), verbose=0)
    assert_same_training(ref, model)
    if build is mlp:  # (masked: Keras weighs a big batch's loss by rows)
        np.testing.assert_allclose(h.history["loss"], [ref_loss], rtol=1e-5)
    assert model.telemetry_counters()["nonfinite_count"] == 0


# ---------------------------------------- 7: a saved pending window
def no_gradient_model(cls, **options):
    """A subclass with a layer the loss never reaches (no gradient): its
    weight decay would move it if the window gave it a zero gradient."""

    class TwoHeads(cls):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.hidden = keras.layers.Dense(4, activation="tanh")
            self.out = keras.layers.Dense(1)
            self.unused = keras.layers.Dense(1)

        def call(self, x):
            self.unused(x)
            return self.out(self.hidden(x))

    keras.utils.set_random_seed(4)
    model = TwoHeads(**options)
    model(np.zeros((1, 3), "float32"))
    return model


@pytest.mark.parametrize(
    "build, optimizer, loss",
    [
        (mlp, lambda: keras.optimizers.Adam(0.05), "mse"),
        (conv, lambda: keras.optimizers.Adam(0.05), "mse"),
        (mlp, sgd, keras.losses.MeanSquaredError(reduction="sum")),
        (no_gradient_model, lambda: keras.optimizers.AdamW(0.05, weight_decay=0.5), "mse"),
    ],
)
def test_saved_pending_window_applies_after_loading(tmp_path, build, optimizer, loss):
    x, y = data_for(mlp if build is no_gradient_model else build, 8)
    ref = build(keras.Model)
    ref.compile(optimizer=optimizer(), loss=loss)
    ref.train_on_batch(x, y)  # the two micro-batches' big batch
    model = build(FG, accumulation_steps=4)
    model.compile(optimizer=optimizer(), loss=loss)
    model.train_on_batch(x[:4], y[:4])
    model.train_on_batch(x[4:], y[4:])
    path = str(tmp_path / "pending.keras")
    model.save(path)
    loaded = keras.saving.load_model(path, custom_objects={"TwoHeads": type(model)})
    logs = loaded.apply_partial_window()
    assert logs is not None and logs["updates"] == 1.0
    assert_same_training(ref, loaded)
    assert loaded.apply_partial_window() is None  # nothing left pending


def test_pending_window_of_an_uncompiled_loaded_model_is_refused(tmp_path):
    x, y = data_for(mlp, 8)
    model = compiled(mlp, FG, accumulation_steps=4)
    model.train_on_batch(x[:4], y[:4])
    path = str(tmp_path / "pending.keras")
    model.save(path)
    loaded = keras.saving.load_model(path, compile=False)
    with pytest.raises(ValueError, match="`apply_partial_window`.*not compiled.*Fix: `compile`"):
        loaded.apply_partial_window()


# ---------------------------------------- 9c: loss-scale growth per update
def test_loss_scale_grows_per_update_as_keras_on_the_big_batch():
    def lso():
        return keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(0.1), initial_scale=2.0**10, dynamic_growth_steps=2
        )

    x, y = data_for(conv, 24)
    ref = compiled(conv, keras.Model, optimizer=lso())
    ref.fit(x, y, batch_size=8, shuffle=False, verbose=0)  # 3 updates
    model = compiled(conv, FG, optimizer=lso(), accumulation_steps=2)
    model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    assert float(ref.optimizer.dynamic_scale.numpy()) == 2.0**11
    assert float(model.optimizer.dynamic_scale.numpy()) == 2.0**11
    assert int(model.optimizer.step_counter.numpy()) == int(ref.optimizer.step_counter.numpy())
    assert_same_training(ref, model)


# ---------------------------------------- 4: the trainable set changes mid-window
def sequential(cls, **options):
    keras.utils.set_random_seed(5)
    layers = [
        keras.Input((3,)),
        keras.layers.Dense(4, activation="tanh"),
        keras.layers.Dense(1),
    ]
    if cls is keras.Model:
        return keras.Sequential(layers)
    return keras_fastgrad.FastGradSequential(layers, **options)


def first_layer(model):
    """The layer to freeze: the first with weights (rnn: the Embedding)."""
    return next(layer for layer in model.layers if layer.weights)


@pytest.mark.parametrize("build", [mlp, rnn, sequential])
def test_freezing_a_layer_mid_window_keeps_the_window_and_the_counters(build):
    # Windows of 3 batches of 4. One full window, then 2 micro-batches
    # pending when the first layer is frozen (and the model recompiled):
    # the window completes as the big batch of its 3 micro-batches would
    # with that layer frozen (its weights did not move within the window).
    x, y = data_for(mlp if build is sequential else build, 24)
    ref = build(keras.Model)
    ref.compile(optimizer=sgd(), loss="mse")
    ref.train_on_batch(x[:12], y[:12])
    first_layer(ref).trainable = False
    ref.compile(optimizer=sgd(), loss="mse")
    ref.train_on_batch(x[12:], y[12:])

    model = build(FG, accumulation_steps=3)
    model.compile(optimizer=sgd(), loss="mse")
    for i in range(5):
        model.train_on_batch(x[4 * i : 4 * i + 4], y[4 * i : 4 * i + 4])
    first_layer(model).trainable = False
    model.compile(optimizer=sgd(), loss="mse")
    model.train_on_batch(x[20:], y[20:])
    assert_same_training(ref, model)
    assert model.telemetry_counters()["updates"] == 2.0  # lifetime, not restarted
    assert model.apply_partial_window() is None


def test_unfreezing_a_layer_mid_window_gives_it_the_micro_batches_since():
    # The layer trains again for the window's last micro-batch only: its
    # window gradient is that micro-batch's, weighted by its share of the
    # window (4 of 12 rows); the other layers get the big batch's. By hand
    # with the gradients of a plain Keras model (`reference_gradients`),
    # SGD without momentum.
    x, y = data_for(mlp, 12)
    lr = 0.1
    ref = mlp(keras.Model)
    mse = keras.losses.MeanSquaredError()
    kernel, bias = first_layer(ref).trainable_weights
    _, big = reference_gradients(ref, lambda: mse(y, ref(x)))
    _, last = reference_gradients(ref, lambda: mse(y[8:], ref(x[8:])))
    expected = []
    for v, g_big, g_last in zip(ref.trainable_weights, big, last):
        own = v is kernel or v is bias
        g = g_last * (4 / 12) if own else g_big
        expected.append(v.numpy() - lr * g)

    model = mlp(FG, accumulation_steps=3)
    first_layer(model).trainable = False
    model.compile(optimizer=keras.optimizers.SGD(lr), loss="mse")
    model.train_on_batch(x[:4], y[:4])
    model.train_on_batch(x[4:8], y[4:8])
    first_layer(model).trainable = True
    model.compile(optimizer=keras.optimizers.SGD(lr), loss="mse")
    model.train_on_batch(x[8:], y[8:])
    assert int(model.optimizer.iterations.numpy()) == 1
    for want, got in zip(expected, [v.numpy() for v in model.trainable_weights]):
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-5)
