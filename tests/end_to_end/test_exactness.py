"""Exact on the models people train: masked sequences, per-timestep and
per-pixel losses, every reduction, under accumulation, `micro_batches`,
XLA and `steps_per_execution`.

Reference: a plain `keras.Model` with the same initial weights, trained on
the concatenated (un-split) batch, so every window / slice combination must
reproduce Keras' own loss normalisation (masked entries, elements, weights).
"""

import warnings

import keras
import numpy as np
import pytest

import keras_fastgrad
from tests.helpers import FGTrainingBranch, TrainingBranch

FG = keras_fastgrad.FastGradModel


def relative_error(ref, model, start):
    """max |w_model - w_ref| / max |w_ref - w_start|: 0 when exact, about 1
    when the update is as wrong as it is large."""
    moved = max(float(np.abs(a - s).max()) for a, s in zip(ref.get_weights(), start))
    diff = max(float(np.abs(a - b).max()) for a, b in zip(ref.get_weights(), model.get_weights()))
    return diff / moved


# ------------------------------------------------------------ masked RNN
def masked_rnn(cls, **options):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(12, 4, mask_zero=True)(inputs)
    h = keras.layers.SimpleRNN(5, return_sequences=True)(h)
    return cls(inputs, keras.layers.Dense(1)(h), **options)


def masked_data():
    """Rows of the first half have 1 valid step, of the second half 6: a
    window weighted by samples (not by valid steps) is far off."""
    rng = np.random.default_rng(0)
    short = np.zeros((4, 6), "int32")
    short[:, 0] = rng.integers(1, 12, 4)
    full = rng.integers(1, 12, (4, 6)).astype("int32")
    x = np.concatenate([short, full])
    y = rng.normal(size=(8, 6, 1)).astype("float32")
    return x, y


REDUCTIONS = ["sum_over_batch_size", "mean_with_sample_weight", "sum"]


def train_pair(
    build,
    x,
    y,
    options,
    batch_size,
    reduction="sum_over_batch_size",
    sample_weight=None,
    metrics=None,
    **compile_kwargs,
):
    ref = build(keras.Model)
    start = ref.get_weights()
    model = build(FG, **options)
    for m in (ref, model):
        m.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.MeanSquaredError(reduction=reduction),
            metrics=metrics,
            **(compile_kwargs if m is model else {}),
        )
    h_ref = ref.fit(
        x, y, sample_weight=sample_weight, batch_size=len(x), epochs=1, shuffle=False, verbose=0
    )
    h = model.fit(
        x, y, sample_weight=sample_weight, batch_size=batch_size, epochs=1, shuffle=False, verbose=0
    )
    return ref, model, start, h_ref, h


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_masked_rnn_accumulation_equals_the_big_batch(reduction):
    x, y = masked_data()
    ref, model, start, _, _ = train_pair(masked_rnn, x, y, {"accumulation_steps": 2}, 4, reduction)
    assert relative_error(ref, model, start) < 1e-5


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_masked_rnn_with_sample_weights(reduction):
    x, y = masked_data()
    # Per-timestep weights ([B] weights do not broadcast against a [B, T]
    # mask in Keras itself).
    w = np.linspace(0.5, 2.0, 48).reshape(8, 6).astype("float32")
    ref, model, start, _, _ = train_pair(
        masked_rnn, x, y, {"accumulation_steps": 2}, 4, reduction, sample_weight=w
    )
    assert relative_error(ref, model, start) < 1e-5


@pytest.mark.parametrize("slices", [2, 3])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_masked_rnn_micro_batches_equal_the_unsplit_step(reduction, slices):
    # 8 rows in 3 slices: 3 + 3 + 2 (+1 padded row).
    x, y = masked_data()
    ref, model, start, h_ref, h = train_pair(
        masked_rnn, x, y, {"micro_batches": slices}, 8, reduction, metrics=["mae"]
    )
    assert relative_error(ref, model, start) < 1e-5
    # The masks reach the metrics and the loss as on the whole batch.
    np.testing.assert_allclose(h.history["mae"], h_ref.history["mae"], rtol=1e-5)
    np.testing.assert_allclose(h.history["loss"], h_ref.history["loss"], rtol=1e-5)


def test_masked_rnn_under_xla_and_steps_per_execution():
    x, y = masked_data()
    x, y = np.concatenate([x, x[::-1]]), np.concatenate([y, y[::-1]])
    ref = masked_rnn(keras.Model)
    start = ref.get_weights()
    ref.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    ref.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    model = masked_rnn(FG, accumulation_steps=2, micro_batches=2)
    model.compile(
        optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=True, steps_per_execution=2
    )
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 2
    assert relative_error(ref, model, start) < 1e-5


# -------------------------------------------- per-timestep (sequence) loss
def sequence_model(cls, **options):
    keras.utils.set_random_seed(4)
    inputs = keras.Input((5, 3))
    h = keras.layers.Conv1D(4, 2, padding="same", activation="tanh")(inputs)
    return cls(inputs, keras.layers.Dense(1)(h), **options)


@pytest.mark.parametrize(
    "options, batch",
    [
        ({"micro_batches": 2}, 7),
        ({"micro_batches": 3}, 7),
        ({"accumulation_steps": 2, "micro_batches": 2}, 4),
    ],
)
def test_sequence_outputs_micro_batches(options, batch):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(7 if batch == 7 else 8, 5, 3)).astype("float32")
    y = rng.normal(size=(len(x), 5, 1)).astype("float32")
    ref, model, start, _, _ = train_pair(sequence_model, x, y, options, batch)
    assert relative_error(ref, model, start) < 1e-5


# ------------------------------------------------ per-pixel segmentation
def segmenter(cls, size, **options):
    keras.utils.set_random_seed(5)
    inputs = keras.Input((size, size, 2))
    h = keras.layers.Conv2D(4, 3, padding="same", activation="relu")(inputs)
    return cls(inputs, keras.layers.Conv2D(3, 1)(h), **options)


@pytest.mark.parametrize("size, n", [(6, 16), (8, 15)])
def test_per_pixel_loss_micro_batches(size, n):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(n, size, size, 2)).astype("float32")
    y = rng.integers(0, 3, size=(n, size, size)).astype("int32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    ref = segmenter(keras.Model, size)
    start = ref.get_weights()
    model = segmenter(FG, size, micro_batches=2)
    for m in (ref, model):
        m.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss, metrics=["accuracy"])
    h_ref = ref.fit(x, y, batch_size=n, epochs=2, shuffle=False, verbose=0)
    h = model.fit(x, y, batch_size=n, epochs=2, shuffle=False, verbose=0)
    assert relative_error(ref, model, start) < 1e-5
    np.testing.assert_allclose(h.history["loss"], h_ref.history["loss"], rtol=1e-5)
    np.testing.assert_allclose(h.history["accuracy"], h_ref.history["accuracy"], rtol=1e-6)


def test_per_pixel_loss_with_pixel_weights_and_accumulation():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(10, 6, 6, 2)).astype("float32")
    y = rng.integers(0, 3, size=(10, 6, 6)).astype("int32")
    w = rng.uniform(0.0, 2.0, size=(10, 6, 6)).astype("float32")
    loss = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="mean_with_sample_weight"
    )
    ref = segmenter(keras.Model, 6)
    start = ref.get_weights()
    model = segmenter(FG, 6, accumulation_steps=2, micro_batches=2)
    for m in (ref, model):
        m.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss)
    ref.fit(x, y, sample_weight=w, batch_size=10, epochs=1, shuffle=False, verbose=0)
    # Uneven window: 6 + 4 images, each split in 2 slices.
    model.fit(x, y, sample_weight=w, batch_size=6, epochs=1, verbose=0, shuffle=False)
    assert int(model.optimizer.iterations.numpy()) == 1
    assert relative_error(ref, model, start) < 1e-5


# --------------------------------------------------- several outputs
def two_outputs(cls, **options):
    keras.utils.set_random_seed(6)
    inputs = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(12, 4, mask_zero=True)(inputs)
    seq = keras.layers.Dense(1, name="seq")(keras.layers.SimpleRNN(3, return_sequences=True)(h))
    pooled = keras.layers.Dense(1, name="pooled")(keras.layers.GlobalAveragePooling1D()(h))
    return cls(inputs, [seq, pooled], **options)


def test_outputs_with_the_same_rows_normaliser_are_exact_without_warning():
    rng = np.random.default_rng(4)
    inputs = keras.Input((3,))
    a = keras.layers.Dense(2, name="a")(inputs)
    b = keras.layers.Dense(1, name="b")(inputs)
    x = rng.normal(size=(10, 3)).astype("float32")
    ys = [rng.normal(size=(10, 2)).astype("float32"), rng.normal(size=(10, 1)).astype("float32")]
    keras.utils.set_random_seed(0)
    ref = keras.Model(inputs, [a, b])
    start = ref.get_weights()
    model = FG(inputs, [a, b], accumulation_steps=2)
    model.set_weights(start)
    ref.compile(optimizer=keras.optimizers.SGD(0.1), loss=["mse", "mae"])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=["mse", "mae"])
    ref.fit(x, ys, batch_size=10, epochs=1, shuffle=False, verbose=0)
    w_ref = ref.get_weights()
    ref.set_weights(start)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.fit(x, ys, batch_size=6, epochs=1, shuffle=False, verbose=0)  # 6 + 4
    diff = max(float(np.abs(p - q).max()) for p, q in zip(w_ref, model.get_weights()))
    moved = max(float(np.abs(p - q).max()) for p, q in zip(w_ref, start))
    assert diff / moved < 1e-5


def test_outputs_with_different_normalisers_warn():
    x, y = masked_data()
    ys = [y, y[:, :1, 0]]
    model = two_outputs(FG, accumulation_steps=2)
    model.compile(optimizer="sgd", loss=["mse", "mse"])
    with pytest.warns(UserWarning, match="different normalisers"):
        model.fit(x, ys, batch_size=4, epochs=1, verbose=0)


# ------------------------------------------------------ sparse gradients
def embedding_model(cls, one_hot=False, **options):
    """`Embedding(50, 4)`; with `one_hot`, the same maths as a dense
    matmul (a dense gradient): the reference for the sparse path."""
    keras.utils.set_random_seed(8)
    inputs = keras.Input((5,), dtype="int32")
    if one_hot:
        table = keras.layers.Dense(4, use_bias=False, name="table")
        h = table(keras.ops.one_hot(inputs, 50))
    else:
        h = keras.layers.Embedding(50, 4, name="table")(inputs)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return cls(inputs, keras.layers.Dense(1)(h), **options)


@pytest.mark.parametrize(
    "options",
    [
        {"clip_norm": 0.05},
        {"accumulation_steps": 2},
        {"accumulation_steps": 2, "clip_norm": 0.05},
    ],
)
def test_embedding_sparse_path_equals_the_dense_gradient(options):
    # Ids repeat within and across rows: a norm of the IndexedSlices'
    # values (duplicates not summed) would be wrong.
    rng = np.random.default_rng(9)
    x = rng.integers(0, 8, size=(12, 5)).astype("int32")
    y = rng.normal(size=(12, 1)).astype("float32") * 5.0
    ref = embedding_model(keras.Model, one_hot=True)
    model = embedding_model(FG, **options)
    model.set_weights(ref.get_weights())
    start = ref.get_weights()
    clip = options.get("clip_norm")
    ref.compile(optimizer=keras.optimizers.SGD(0.5, global_clipnorm=clip), loss="mse")
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    # Windows of two batches of 6 equal one batch of 12.
    ref_batch = 12 if "accumulation_steps" in options else 6
    ref.fit(x, y, batch_size=ref_batch, epochs=2, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0)
    assert relative_error(ref, model, start) < 1e-5


@pytest.mark.parametrize("clip_norm", [1e3, 0.05], ids=["never_clips", "clips"])
@pytest.mark.parametrize("optimizer", ["adam", "rmsprop", "adagrad"])
def test_clipped_sparse_gradient_under_an_adaptive_optimizer_is_the_dense_step(
    optimizer, clip_norm
):
    # One batch, no accumulation: the clipped gradient of an Embedding
    # whose ids repeat reaches the optimizer with each row once. Keras'
    # adaptive optimizers square an IndexedSlices' values row by row (a
    # repeated id adds its parts' squares); the update must be the dense
    # gradient's, as Keras' own `global_clipnorm` gives it (its clipping
    # makes the gradient dense) and as accumulation gives it.
    rng = np.random.default_rng(9)
    x = rng.integers(0, 8, size=(12, 5)).astype("int32")
    y = rng.normal(size=(12, 1)).astype("float32") * 5.0
    ref = embedding_model(keras.Model, one_hot=True)
    model = embedding_model(FG, clip_norm=clip_norm)
    model.set_weights(ref.get_weights())
    start = ref.get_weights()
    optimizer = type(keras.optimizers.get(optimizer))
    # (the reference's gradient is dense: its norm is the dense gradient's)
    ref.compile(optimizer=optimizer(0.05, global_clipnorm=clip_norm), loss="mse")
    model.compile(optimizer=optimizer(0.05), loss="mse")
    ref.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0)
    assert relative_error(ref, model, start) < 1e-5


# ------------------------------------------------------------ BatchNorm
def bn_segmenter(cls, **options):
    keras.utils.set_random_seed(10)
    inputs = keras.Input((6, 6, 2))
    h = keras.layers.Conv2D(4, 3, padding="same")(inputs)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Activation("relu")(h)
    return cls(inputs, keras.layers.Conv2D(3, 1)(h), **options)


class _ConvBN:
    """An unbuilt subclass body: FastGradModel builds it with a symbolic
    training call before the first step, which must not move the
    statistics."""

    def _make_layers(self):
        self.conv = keras.layers.Conv2D(4, 3, padding="same")
        self.norm = keras.layers.BatchNormalization()
        self.head = keras.layers.Conv2D(3, 1)

    def call(self, x, training=False):
        return self.head(keras.ops.relu(self.norm(self.conv(x), training=training)))


class BNSubclass(_ConvBN, keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._make_layers()


class FGBNSubclass(_ConvBN, FG):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._make_layers()


@pytest.mark.parametrize("build", ["functional", "subclass"])
def test_batchnorm_model_default_options_train_exactly_like_keras(build):
    # Weights and moving statistics, per-pixel loss, Adam, 2 epochs.
    rng = np.random.default_rng(11)
    x = rng.normal(size=(12, 6, 6, 2)).astype("float32")
    y = rng.integers(0, 3, size=(12, 6, 6)).astype("int32")
    if build == "functional":
        ref, model = bn_segmenter(keras.Model), bn_segmenter(FG)
    else:
        keras.utils.set_random_seed(10)
        ref = BNSubclass()
        keras.utils.set_random_seed(10)
        model = FGBNSubclass()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    for m in (ref, model):
        m.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss, metrics=["accuracy"])
    h_ref = ref.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    h = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert len(ref.get_weights()) == len(model.get_weights()) == 8  # + moving stats
    for a, b in zip(ref.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(h.history["loss"], h_ref.history["loss"], rtol=1e-5)


# ------------------------------------------- clip_norm beyond an MLP
def _clip_case(name):
    """`(keras.Model, FastGradModel builder, x, y, loss)` for one model."""
    rng = np.random.default_rng(12)
    if name == "masked_rnn":
        x, y = masked_data()
        return masked_rnn, x, y * 5.0, "mse"
    if name in ("per_pixel_conv", "batchnorm"):
        x = rng.normal(size=(8, 6, 6, 2)).astype("float32")
        y = rng.integers(0, 3, size=(8, 6, 6)).astype("int32")
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        build = bn_segmenter if name == "batchnorm" else lambda cls, **o: segmenter(cls, 6, **o)
        return build, x, y, loss
    x = rng.normal(size=(8, 4)).astype("float32")
    y = rng.normal(size=(8, 1)).astype("float32") * 5.0
    if name == "sequential":

        def build(cls, **options):
            keras.utils.set_random_seed(13)
            layers = [keras.Input((4,)), keras.layers.Dense(6, activation="tanh")]
            seq = keras_fastgrad.FastGradSequential if cls is FG else keras.Sequential
            return seq(layers + [keras.layers.Dense(1)], **options)

        return build, x, y, "mse"

    def build(cls, **options):  # a subclass with a training-only branch
        keras.utils.set_random_seed(14)
        model = (FGTrainingBranch if cls is FG else TrainingBranch)(**options)
        model(x[:1])
        return model

    return build, x, y, "mse"


def _fit_with_dense_clipping(model, x, y, clip_norm, batch, epochs):
    """keras.Model's loss and SGD, the gradient made dense and clipped by
    `tf.clip_by_global_norm` (a plain training loop)."""
    import tensorflow as tf

    for _ in range(epochs):
        for i in range(0, len(x), batch):
            xb, yb = x[i : i + batch], y[i : i + batch]
            with tf.GradientTape() as tape:
                y_pred = model(xb, training=True)
                loss = model.compute_loss(x=xb, y=yb, y_pred=y_pred)
            grads = tape.gradient(loss, model.trainable_variables)
            dense = [tf.convert_to_tensor(g) for g in grads]
            clipped, _ = tf.clip_by_global_norm(dense, clip_norm)
            model.optimizer.apply(clipped, model.trainable_variables)


@pytest.mark.parametrize("telemetry", [False, True])  # True: `grad_norm` requested
@pytest.mark.parametrize(
    "name",
    [
        "masked_rnn",
        "per_pixel_conv",
        "batchnorm",
        "sequential",
        pytest.param(
            "training_branch",
            marks=pytest.mark.tensorflow_only(
                reason="JAX refuses a layer built inside the step, by name "
                "(tests/models/test_refusals_jax.py)"
            ),
        ),
    ],
)
def test_clip_norm_trains_like_keras_global_clipnorm(name, telemetry):
    # One replica, no accumulation: the step's finite check is the
    # gradient's norm, computed once for the check and the clipping
    # (issue 21). Reference: keras.Model with `global_clipnorm`, on every
    # kind of model, the norm small enough that every step clips.
    build, x, y, loss = _clip_case(name)
    ref, model = build(keras.Model), build(FG, clip_norm=0.05, telemetry=telemetry)
    model.set_weights(ref.get_weights())
    start = ref.get_weights()
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss)
    h = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    if name == "masked_rnn" and keras.backend.backend() == "tensorflow":
        # Keras' `global_clipnorm` measures an embedding's `IndexedSlices`
        # with repeated ids counted apart (not the dense gradient's norm):
        # the reference clips the dense gradient by hand. (JAX's gradient
        # is dense: Keras' own clipping is the reference there.)
        ref.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss)
        _fit_with_dense_clipping(ref, x, y, clip_norm=0.05, batch=4, epochs=2)
    else:
        ref.compile(optimizer=keras.optimizers.SGD(0.5, global_clipnorm=0.05), loss=loss)
        h_ref = ref.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
        np.testing.assert_allclose(h.history["loss"], h_ref.history["loss"], rtol=1e-5)
    assert relative_error(ref, model, start) < 1e-5
    assert int(model.optimizer.iterations.numpy()) == 4
    if telemetry:
        assert h.history["clipped_updates"][-1] == 4.0  # cumulative: every update clipped
