"""`clip_adaptive` (AGC), on both backends, against a numpy implementation of the
paper's equation (Brock et al. 2021, section 4.1), applied to the gradient
a plain `keras.Model` takes of the same batch (one SGD step of rate 1 on
a copy: `w - w'`)."""

import keras
import numpy as np
import pytest

import keras_fastgrad as kf

LAMBDA, EPS, LR, SCALE = 0.2, 1e-3, 0.5, 1.0


def np_agc(g, w, rows=False):
    """`G_i * min(1, lambda * max(||W_i||, eps) / ||G_i||)` per unit: a
    kernel's output unit (last axis), a table's row, a vector whole."""
    g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
    if w.ndim <= 1:
        axes = None
    else:
        axes = tuple(range(1, w.ndim)) if rows else tuple(range(w.ndim - 1))
    w_norm = np.sqrt(np.sum(w * w, axis=axes, keepdims=axes is not None))
    g_norm = np.sqrt(np.sum(g * g, axis=axes, keepdims=axes is not None))
    bound = LAMBDA * np.maximum(w_norm, EPS)
    with np.errstate(divide="ignore"):
        factor = np.minimum(1.0, bound / g_norm)
    return g * factor, float(np.mean(g_norm > bound))


def model_of(cls=keras.Model, **options):
    """Embedding (rows), Conv2D and Dense (output units), BatchNorm and
    biases (whole vectors)."""
    keras.utils.set_random_seed(0)
    image, tokens = keras.Input((5, 5, 2)), keras.Input((4,), dtype="int32")
    h = keras.layers.Conv2D(3, 3, activation="relu")(image)
    h = keras.layers.BatchNormalization()(keras.layers.Flatten()(h))
    e = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(12, 3)(tokens))
    h = keras.layers.Concatenate()([h, e])
    return cls([image, tokens], keras.layers.Dense(2)(h), **options)


def batch(rows, seed=0):
    rng = np.random.default_rng(seed)
    x = [
        rng.normal(size=(rows, 5, 5, 2)).astype("float32"),
        rng.integers(0, 12, size=(rows, 4)).astype("int32"),
    ]
    return x, rng.normal(size=(rows, 2)).astype("float32") * SCALE


def expected(plain, before):
    """The weights after one SGD(LR) step of numpy AGC on the gradient the
    plain model's SGD(1) steps took from `before` (a list, in
    `trainable_variables`' order); and the fractions of units clipped."""
    out, fractions = [], []
    for v, w in zip(plain.trainable_variables, before):
        clipped, fraction = np_agc(w - v.numpy(), w, rows=v.path.endswith("embeddings"))
        out.append(w - LR * clipped)
        fractions.append(fraction)
    return out, fractions


def plain_from(model, accumulation=None):
    """A plain model with `model`'s weights, SGD(1) (over `accumulation`
    batches); returns it and its trainable weights before."""
    plain = model_of()
    plain.compile(keras.optimizers.SGD(1.0, gradient_accumulation_steps=accumulation), "mse")
    plain.set_weights(model.get_weights())
    return plain, [v.numpy() for v in plain.trainable_variables]


def assert_close(want, model):
    got = [v.numpy() for v in model.trainable_variables]
    assert len(got) == len(want) == 7
    for g, w, v in zip(got, want, model.trainable_variables, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=v.path)


def halves(x, y):
    return [([t[:4] for t in x], y[:4]), ([t[4:] for t in x], y[4:])]


def fastgrad(**options):
    model = model_of(kf.FastGradModel, clip_adaptive=LAMBDA, **options)
    model.compile(keras.optimizers.SGD(LR), "mse")
    return model


def test_matches_the_paper_unit_by_unit():
    model = fastgrad()
    for step in range(2):
        x, y = batch(8, seed=step)
        plain, before = plain_from(model)
        plain.train_on_batch(x, y)
        want, fractions = expected(plain, before)
        model.train_on_batch(x, y)
        assert_close(want, model)
        # Kernels and zero biases clipped, BatchNorm's gamma not, the
        # table's rows in part: a wrong unit (or a clip of everything, or
        # of nothing) would differ.
        assert 0.0 in fractions and any(0.0 < f < 1.0 for f in fractions), fractions


@pytest.mark.parametrize(
    "options",
    [{"accumulation_steps": 2}, {"micro_batches": 2}],
    ids=["accumulation", "micro_batches"],
)
def test_the_combined_gradient_is_clipped_once(options):
    # BatchNorm normalises each half by its own moments: the reference
    # gradient is Keras' own accumulation of the two halves (their mean).
    model = fastgrad(batchnorm_statistics="micro_batch", **options)
    x, y = batch(8)
    plain, before = plain_from(model, accumulation=2)
    for xs, ys in halves(x, y):
        plain.train_on_batch(xs, ys)
    want, _ = expected(plain, before)
    if "micro_batches" in options:
        model.train_on_batch(x, y)
    else:
        for xs, ys in halves(x, y):
            model.train_on_batch(xs, ys)
    assert_close(want, model)
    assert model.telemetry_counters()["updates"] == 1.0


@pytest.mark.parametrize(
    "skip_nonfinite, telemetry",
    [(True, False), (False, False), (False, True)],
    ids=["skip", "unchecked", "unchecked-counted"],
)
def test_a_nan_batch_never_reaches_the_weights(skip_nonfinite, telemetry):
    # As on TensorFlow: with either `skip_nonfinite`, counted once.
    model = fastgrad(skip_nonfinite=skip_nonfinite, telemetry=telemetry)
    x, y = batch(8)
    x[0][3, 0, 0, 0] = np.nan
    start = [v.numpy() for v in model.trainable_variables]
    model.train_on_batch(x, y)
    for value, before in zip(model.trainable_variables, start):
        np.testing.assert_array_equal(value.numpy(), before)
    counters = model.telemetry_counters()
    assert counters["nonfinite_count"] == 1.0 and counters["updates"] == 0.0
    x, y = batch(8, seed=1)  # a finite batch after it is applied
    plain, before = plain_from(model)
    plain.train_on_batch(x, y)
    want, _ = expected(plain, before)
    model.train_on_batch(x, y)
    assert_close(want, model)


def test_agc_clipped_fraction_is_the_papers_count():
    """(Refused on JAX before.) The fraction of all units clipped: each
    weight's fraction (numpy) times its units, over all units."""
    model = fastgrad()
    model.enable_telemetry(["agc_clipped_fraction"])
    x, y = batch(8)
    plain, before = plain_from(model)
    plain.train_on_batch(x, y)
    _, fractions = expected(plain, before)
    units = [
        1 if w.ndim <= 1 else w.shape[0] if v.path.endswith("embeddings") else w.shape[-1]
        for v, w in zip(plain.trainable_variables, before, strict=True)
    ]
    want = sum(f * u for f, u in zip(fractions, units)) / sum(units)
    logs = model.train_on_batch(x, y, return_dict=True)
    np.testing.assert_allclose(logs["agc_clipped_fraction"], want, rtol=1e-6)
    assert 0.0 < want < 1.0


@pytest.mark.parametrize("accumulation_steps", [1, 2])
def test_grad_norm_is_the_adaptively_clipped_gradients(accumulation_steps):
    # As on TensorFlow: the `grad_norm` key measures the update's gradient
    # after AGC (with SGD, `(w_before - w_after) / LR`).
    model = fastgrad(
        telemetry=True, accumulation_steps=accumulation_steps, batchnorm_statistics="micro_batch"
    )
    x, y = batch(8)
    before = [v.numpy() for v in model.trainable_variables]
    parts = halves(x, y) if accumulation_steps == 2 else [(x, y)]
    for xs, ys in parts:
        logs = model.train_on_batch(xs, ys, return_dict=True)
    applied = [(b - v.numpy()) / LR for b, v in zip(before, model.trainable_variables)]
    want = np.sqrt(sum(np.sum(np.square(a, dtype=np.float64)) for a in applied))
    np.testing.assert_allclose(logs["grad_norm"], want, rtol=1e-4)
