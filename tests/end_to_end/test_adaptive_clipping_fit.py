"""`FastGradModel(clip_adaptive=...)`: adaptive gradient clipping in the step.

Reference for every update: the gradient of a plain `keras.Model` with the
same initial weights on the whole (big) batch, taken with
`helpers.reference_gradients` (a `tf.GradientTape`, or `jax.value_and_grad`),
clipped by `np_agc` (tests/helpers.py: a numpy transcription of the
NFNets paper's equation, unit by unit with a loop),
then one SGD step `w - lr * g` in numpy. Lambda is the median ratio
`||G_i|| / ||W_i||` of the reference gradient, so some units are clipped
and some are not: with clipping off, or per micro-batch, or on scaled
gradients, the weights differ (each test checks that the reference
clipped something).
"""

import keras
import numpy as np
import pytest

import keras_fastgrad
from tests.helpers import between_middle, data, mlp, np_agc, reference_gradients

FG = keras_fastgrad.FastGradModel
LR = 0.1


# ------------------------------------------------------------ the reference
def unit_axis(layer, weight):
    """The paper's unit for a Keras weight: a row of an embedding table,
    an output unit (last axis) of a kernel, the whole of a vector."""
    if weight.ndim <= 1:
        return None
    return 0 if isinstance(layer, keras.layers.Embedding) else -1


def weights_and_units(model):
    """`(variable, unit_axis)` per trainable weight, in the model's order."""
    owner = {id(w): layer for layer in model.layers for w in layer.trainable_weights}
    return [(v, unit_axis(owner[id(v)], np.asarray(v.numpy()))) for v in model.trainable_variables]


def keras_gradient(model, x, y, loss):
    """The plain model's gradient of its loss on the whole batch."""

    def value():
        return keras.ops.mean(keras.losses.get(loss)(y, model(x, training=True)))

    return reference_gradients(model, value)[1]


def median_lambda(model, grads):
    """A lambda between the units' ratios (some clipped, some not)."""
    ratios = []
    for (v, axis), g in zip(weights_and_units(model), grads):
        w = np.asarray(v.numpy(), np.float64)
        g_units = [g] if axis is None else list(np.moveaxis(g, axis, 0))
        w_units = [w] if axis is None else list(np.moveaxis(w, axis, 0))
        ratios += [
            np.linalg.norm(a) / max(np.linalg.norm(b), 1e-3)
            for a, b in zip(g_units, w_units)
            if np.linalg.norm(a) > 0
        ]
    return between_middle(ratios)


def reference_step(model, grads, lam, eps=1e-3, clip_norm=None):
    """Weights after one SGD step on the AGC-clipped (then, if given,
    globally clipped) gradient; also the count of clipped units."""
    clipped, n_clipped = [], 0
    for (v, axis), g in zip(weights_and_units(model), grads):
        c, n = np_agc(g, v.numpy(), lam, eps, unit_axis=axis)
        clipped.append(c)
        n_clipped += n
    if clip_norm is not None:
        norm = np.sqrt(sum(np.sum(c**2) for c in clipped))
        clipped = [c * min(1.0, clip_norm / norm) for c in clipped]
    new = [
        np.asarray(v.numpy(), np.float64) - LR * c
        for (v, _), c in zip(weights_and_units(model), clipped)
    ]
    return new, n_clipped


def assert_weights(model, expected, rtol=1e-5, atol=1e-6):
    for v, e in zip(model.trainable_variables, expected):
        np.testing.assert_allclose(v.numpy(), e, rtol=rtol, atol=atol, err_msg=v.path)


def train_and_compare(build, x, y, loss="mse", batch_size=None, clip_norm=None, **options):
    """One update of `build(FG, clip_adaptive=lam, ...)` on (x, y) against
    the reference; returns the model and the reference's clipped units."""
    ref = build(keras.Model)
    grads = keras_gradient(ref, x, y, loss)
    lam = median_lambda(ref, grads)
    expected, n_clipped = reference_step(ref, grads, lam, clip_norm=clip_norm)
    assert n_clipped > 0
    model = build(FG, clip_adaptive=lam, clip_norm=clip_norm, **options)
    model.compile(optimizer=keras.optimizers.SGD(LR), loss=loss)
    model.fit(x, y, batch_size=batch_size or len(x), shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 1
    assert_weights(model, expected)
    return model, lam, n_clipped


# ------------------------------------------------------------ models
def dense(cls, **options):
    return mlp(cls, features=3, outputs=2, **options)


def conv(cls, **options):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((6, 6, 2))
    h = keras.layers.Conv2D(4, 3, activation="tanh")(inputs)
    h = keras.layers.Flatten()(h)
    return cls(inputs, keras.layers.Dense(2)(h), **options)


def embedding(cls, **options):
    keras.utils.set_random_seed(5)
    inputs = keras.Input((4,), dtype="int32")
    h = keras.layers.Embedding(12, 3)(inputs)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return cls(inputs, keras.layers.Dense(1)(h), **options)


def sequential(cls, **options):
    keras.utils.set_random_seed(9)
    layers = [keras.Input((3,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(2)]
    if cls is keras.Model:
        return keras.Sequential(layers)
    return keras_fastgrad.FastGradSequential(layers, **options)


def tokens(n=8, seed=0):
    """Token ids with repeats (rows summed) and rows 10, 11 never used."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 10, size=(n, 4)).astype("int32")
    x[:, 0] = 2  # a row in every sample
    return x, rng.normal(size=(n, 1)).astype("float32")


def images(n=8):
    rng = np.random.default_rng(1)
    return rng.normal(size=(n, 6, 6, 2)).astype("float32"), rng.normal(size=(n, 2)).astype(
        "float32"
    )


# ------------------------------------------------------------ one update
def test_dense_update_is_the_keras_gradient_clipped_unit_wise():
    x, y = data(n=8, outputs=2)
    train_and_compare(dense, x, y)


def test_conv2d_kernel_units_are_output_channels():
    x, y = images()
    train_and_compare(conv, x, y)


def test_embedding_rows_are_units_and_the_sparse_gradient_works():
    x, y = tokens()
    train_and_compare(embedding, x, y)


def test_embedding_rows_are_units_in_the_dense_window_gradient_too():
    # With accumulation the table's gradient reaches the update dense.
    x, y = tokens()
    train_and_compare(embedding, x, y, batch_size=4, accumulation_steps=2)


def test_under_xla():
    # `jit_compile=True` (Keras' default on one GPU) compiles the step.
    x, y = tokens()
    ref = embedding(keras.Model)
    grads = keras_gradient(ref, x, y, "mse")
    lam = median_lambda(ref, grads)
    expected, _ = reference_step(ref, grads, lam)
    model = embedding(FG, clip_adaptive=lam)
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse", jit_compile=True)
    model.fit(x, y, batch_size=8, verbose=0)
    assert_weights(model, expected)


def test_fastgrad_sequential():
    x, y = data(n=8, outputs=2)
    train_and_compare(sequential, x, y)


def test_fastgrad_adapter_on_a_keras_sequential():
    x, y = data(n=8, outputs=2)

    def build(cls, **options):
        model = sequential(keras.Model)
        return model if cls is keras.Model else keras_fastgrad.fastgrad(model, **options)

    train_and_compare(build, x, y)


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_accumulation_clips_the_window_gradient_once(micro_batches):
    # Two batches of 4 (each split in `micro_batches` slices) are one
    # update: AGC of the big batch's gradient, not of each batch's.
    x, y = data(n=8, outputs=2)
    train_and_compare(dense, x, y, batch_size=4, accumulation_steps=2, micro_batches=micro_batches)


def test_clip_norm_applies_after_adaptive_clipping():
    x, y = data(n=8, outputs=2)
    ref = dense(keras.Model)
    grads = keras_gradient(ref, x, y, "mse")
    lam = median_lambda(ref, grads)
    after_agc = [
        np_agc(g, v.numpy(), lam, unit_axis=a)[0]
        for (v, a), g in zip(weights_and_units(ref), grads)
    ]
    # A clip norm below the clipped gradient's norm: both clippings act.
    clip_norm = 0.5 * float(np.sqrt(sum(np.sum(c**2) for c in after_agc)))
    model, _, _ = train_and_compare(dense, x, y, clip_norm=clip_norm)
    # The other order (global clip first, then AGC) gives other weights:
    # the test tells the orders apart.
    norm = np.sqrt(sum(np.sum(g**2) for g in grads))
    other = [
        np_agc(g * clip_norm / norm, v.numpy(), lam, unit_axis=a)[0]
        for (v, a), g in zip(weights_and_units(ref), grads)
    ]
    other_weights = [v.numpy() - LR * c for (v, _), c in zip(weights_and_units(ref), other)]
    assert (
        max(np.max(np.abs(v.numpy() - w)) for v, w in zip(model.trainable_variables, other_weights))
        > 1e-4
    )


def test_optimizer_clipnorm_is_allowed_and_applies_after():
    # Keras' `clipnorm` (per weight) runs inside the optimizer's `apply`:
    # after AGC. Two clippings of different kinds, so not refused.
    x, y = data(n=8, outputs=2)
    ref = dense(keras.Model)
    grads = keras_gradient(ref, x, y, "mse")
    lam = median_lambda(ref, grads)
    clipped = [
        np_agc(g, v.numpy(), lam, unit_axis=a)[0]
        for (v, a), g in zip(weights_and_units(ref), grads)
    ]
    clipnorm = 0.5 * max(float(np.linalg.norm(c)) for c in clipped)  # clips one weight
    clipped = [c * min(1.0, clipnorm / np.linalg.norm(c)) for c in clipped]
    without_agc = [g * min(1.0, clipnorm / np.linalg.norm(g)) for g in grads]
    assert max(np.max(np.abs(c - g)) for c, g in zip(clipped, without_agc)) * LR > 1e-3
    model = dense(FG, clip_adaptive=lam)
    model.compile(optimizer=keras.optimizers.SGD(LR, clipnorm=clipnorm), loss="mse")
    model.fit(x, y, batch_size=8, verbose=0)
    assert_weights(
        model, [v.numpy() - LR * c for (v, _), c in zip(weights_and_units(ref), clipped)]
    )


def test_mixed_float16_clips_the_unscaled_gradient():
    # Under loss scaling (2**15) the step unscales before AGC: clipping the
    # scaled gradient would clip every unit. Reference: float32.
    x, y = data(n=8, outputs=2)
    ref = dense(keras.Model)
    grads = keras_gradient(ref, x, y, "mse")
    lam = median_lambda(ref, grads)
    expected, n_clipped = reference_step(ref, grads, lam)
    n_units = sum(1 if a is None else v.shape[a] for v, a in weights_and_units(ref))
    assert 0 < n_clipped < n_units
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = dense(FG, clip_adaptive=lam, telemetry=True)
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    history = model.fit(x, y, batch_size=8, verbose=0)
    assert history.history["loss_scale"][0] > 1.0
    assert history.history["agc_clipped_fraction"][0] == pytest.approx(n_clipped / n_units)
    assert_weights(model, expected, rtol=2e-3, atol=2e-3)  # float16 forward


# ------------------------------------------------------------ telemetry
def test_clipped_fraction_is_the_papers_count_over_all_units():
    x, y = tokens()
    ref = embedding(keras.Model)
    grads = keras_gradient(ref, x, y, "mse")
    lam = median_lambda(ref, grads)
    _, n_clipped = reference_step(ref, grads, lam)
    # Units: 12 table rows (2 untouched), 1 bias, 1 output unit of the
    # Dense kernel (3, 1), and the Dense bias: 12 + 1 + 1 = 14.
    model = embedding(FG, clip_adaptive=lam)
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    model.enable_telemetry(["agc_clipped_fraction"])
    history = model.fit(x, y, batch_size=8, verbose=0)
    assert history.history["agc_clipped_fraction"][0] == pytest.approx(n_clipped / 14)


def test_gradient_norm_logger_logs_the_clipped_fraction():
    x, y = data(n=8, outputs=2)
    ref = dense(keras.Model)
    grads = keras_gradient(ref, x, y, "mse")
    lam = median_lambda(ref, grads)
    _, n_clipped = reference_step(ref, grads, lam)
    # Units: hidden kernel (3, 5): 5, its bias: 1, out kernel (5, 2): 2,
    # its bias: 1.
    model = dense(FG, clip_adaptive=lam)
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    logger = keras_fastgrad.callbacks.GradientNormLogger(adaptive_fraction=True)
    history = model.fit(x, y, batch_size=8, verbose=0, callbacks=[logger])
    assert history.history["agc_clipped_fraction"][0] == pytest.approx(n_clipped / 9)


def test_clipped_fraction_is_only_computed_when_asked():
    model = dense(FG, clip_adaptive=0.01)
    model.compile(optimizer="sgd", loss="mse")
    x, y = data(n=8, outputs=2)
    history = model.fit(x, y, verbose=0)
    assert "agc_clipped_fraction" not in history.history
    assert model.fastgrad_step_state.telemetry.agc_clipped_fraction is None
    # telemetry=True includes it only where the model clips adaptively.
    assert (
        "agc_clipped_fraction"
        in dense(FG, clip_adaptive=0.01, telemetry=True).fastgrad_step_state.log_keys
    )
    assert "agc_clipped_fraction" not in dense(FG, telemetry=True).fastgrad_step_state.log_keys


def test_clipped_fraction_without_adaptive_clipping_is_refused():
    model = dense(FG)
    with pytest.raises(ValueError, match=r"`agc_clipped_fraction`.*clip_adaptive=None.*Fix: build"):
        model.enable_telemetry(["agc_clipped_fraction"])


# ------------------------------------------------------------ non-finite
def nan_batch():
    x, y = data(n=8, outputs=2)
    x[3, 1] = np.nan
    return x, y


@pytest.mark.parametrize("accumulation_steps", [1, 2])
@pytest.mark.parametrize("skip_nonfinite", [True, False])
def test_nan_gradient_never_reaches_the_weights(accumulation_steps, skip_nonfinite):
    x, y = nan_batch()
    model = dense(
        FG, clip_adaptive=0.01, accumulation_steps=accumulation_steps, skip_nonfinite=skip_nonfinite
    )
    before = [v.numpy().copy() for v in model.trainable_variables]
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    model.fit(x, y, batch_size=8 // accumulation_steps, shuffle=False, verbose=0)
    for v, b in zip(model.trainable_variables, before):
        if accumulation_steps == 1 or skip_nonfinite is False:
            np.testing.assert_array_equal(v.numpy(), b)  # the update dropped
        assert np.isfinite(v.numpy()).all()
    assert model.telemetry_counters()["nonfinite_count"] >= 1.0


@pytest.mark.parametrize("accumulation_steps", [1, 2])
def test_unit_norm_beyond_float32_drops_the_update_loudly(accumulation_steps):
    # A finite gradient of ~1e21 per unit: its squared norm overflows, the
    # factor `max_norm / inf` would zero the unit silently. The update is
    # dropped and counted; without AGC it is applied (finite).
    def huge(y_true, y_pred):
        return 1e22 * keras.ops.mean(y_pred, axis=-1)

    x, y = data(n=8, outputs=2)
    for options, applied in (({}, True), ({"clip_adaptive": 0.01}, False)):
        model = dense(FG, accumulation_steps=accumulation_steps, **options)
        before = [v.numpy().copy() for v in model.trainable_variables]
        model.compile(optimizer=keras.optimizers.SGD(1e-22), loss=huge)
        model.fit(x, y, batch_size=8 // accumulation_steps, shuffle=False, verbose=0)
        changed = any(np.any(v.numpy() != b) for v, b in zip(model.trainable_variables, before))
        assert changed is applied, options
        assert model.telemetry_counters()["nonfinite_count"] == (0.0 if applied else 1.0)


# ------------------------------------------------------------ replicas
# Under MirroredStrategy: mirrored_adaptive_clipping.py, run with every
# MirroredStrategy case in one process by end_to_end/test_distributed.py.


# ------------------------------------------------------------ saving
def test_options_round_trip_through_a_keras_file(tmp_path):
    x, y = data(n=8, outputs=2)
    for model in (
        dense(FG, clip_adaptive=0.02, clip_adaptive_eps=1e-2),
        keras_fastgrad.fastgrad(
            sequential(keras.Model), clip_adaptive=0.02, clip_adaptive_eps=1e-2
        ),
    ):
        model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
        model.fit(x, y, verbose=0)
        path = str(tmp_path / "agc.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
        assert (loaded.clip_adaptive, loaded.clip_adaptive_eps) == (0.02, 1e-2)
        config = loaded.get_config()
        assert (config.get("clip_adaptive"), config.get("clip_adaptive_eps")) in (
            (0.02, 1e-2),
            (None, None),  # the adapter keeps the options in its own entry
        )
        model.fit(x, y, verbose=0)
        loaded.fit(x, y, verbose=0)
        for a, b in zip(model.get_weights(), loaded.get_weights()):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
