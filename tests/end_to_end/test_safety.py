"""Safe to the last sample: evaluation inside `fit`, diverged runs and
best checkpoints, overflow after the finite check, models without weights.

References: a plain `keras.Model` (trained on the equivalent big batch, or
under the same learning-rate spike), and values worked out by hand."""

import contextlib
import math
import os
import warnings

import keras
import numpy as np
import pytest

import keras_fastgrad
from tests.helpers import data, fast, max_weight_diff, mlp

FG = keras_fastgrad.FastGradModel


def sgd(lr=0.05):
    return keras.optimizers.SGD(lr)


# ------------------------------------------------------- evaluate in fit
class EvaluateEvery(keras.callbacks.Callback):
    def __init__(self, every, x, y):
        super().__init__()
        self.every, self.x, self.y, self.calls = every, x, y, 0

    def on_train_batch_end(self, batch, logs=None):
        if (batch + 1) % self.every == 0:
            self.calls += 1
            self.model.evaluate(self.x, self.y, verbose=0)


def test_evaluate_inside_fit_does_not_change_training():
    # 12 batches of 2, windows of 3 batches: 4 updates, each equal to one
    # step of keras.Model on a batch of 6, evaluated or not.
    x, y = data(n=24)
    ref = mlp()
    ref.compile(optimizer=sgd(), loss="mse")
    ref.fit(x, y, batch_size=6, epochs=1, shuffle=False, verbose=0)
    model = fast(accumulation_steps=3)
    model.compile(optimizer=sgd(), loss="mse")
    probe = EvaluateEvery(4, x, y)
    model.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=0, callbacks=[probe])
    assert probe.calls == 3
    assert int(model.optimizer.iterations.numpy()) == 4
    assert max_weight_diff(ref, model) < 1e-6


def test_validation_data_still_sees_the_flushed_window():
    # 5 batches, windows of 2: the epoch's partial window (1 batch) is
    # applied before validation, as before.
    x, y = data(n=10)
    model = fast(accumulation_steps=2)
    model.compile(optimizer=sgd(), loss="mse")
    model.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=0, validation_data=(x, y))
    assert int(model.optimizer.iterations.numpy()) == 3


# ------------------------------------------------------------ divergence
def spike_schedule(spike_epoch):
    return keras.callbacks.LearningRateScheduler(
        lambda epoch, lr: 1e30 if epoch == spike_epoch else 0.05
    )


def spiked_run(cls, tmp_path, name, epochs=5, **options):
    """8 batches per epoch; the learning rate is 1e30 in epoch 1 (finite
    gradients, then weights of ~1e30 and non-finite losses)."""
    x, y = data(n=64)
    model = mlp(cls, **options)
    model.compile(optimizer=sgd(), loss="mse")
    path = os.path.join(tmp_path, f"{name}.weights.h5")
    checkpoint = keras.callbacks.ModelCheckpoint(
        path, monitor="loss", save_best_only=True, save_weights_only=True
    )
    stopper = keras.callbacks.EarlyStopping(monitor="loss", patience=10, restore_best_weights=True)
    history = model.fit(
        x,
        y,
        batch_size=8,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=[spike_schedule(1), checkpoint, stopper],
    )
    saved = mlp(cls, **options)
    saved.load_weights(path)
    return model, history.history["loss"], saved, (x, y)


def test_diverged_run_stops_and_keeps_the_best_checkpoint(tmp_path):
    ref, ref_losses, ref_saved, (x, y) = spiked_run(keras.Model, tmp_path, "ref")
    with pytest.warns(RuntimeWarning, match="consecutive non-finite micro-batches"):
        model, losses, saved, _ = spiked_run(FG, tmp_path, "fast")
    # keras.Model: the spike epoch and everything after are NaN/inf.
    assert not any(np.isfinite(ref_losses[1:]))
    # Ours: epoch 0 trained as keras.Model; the spike epoch ends dropping
    # and the next applies nothing: neither logs a finite loss.
    assert losses[0] == pytest.approx(ref_losses[0], rel=1e-6)
    assert len(losses) == 3 and not any(np.isfinite(losses[1:]))
    assert losses[2] != 0.0
    # Stopped in epoch 2, after 10 dropped micro-batches in a row (7 + 3).
    assert model.telemetry_counters()["nonfinite_count"] == 10
    # The best checkpoint is epoch 0's weights, as keras.Model's is.
    assert max_weight_diff(saved, ref_saved) == 0.0
    assert all(np.isfinite(w).all() for w in saved.get_weights())
    # EarlyStopping restored epoch 0's weights at the stop.
    assert max_weight_diff(model, saved) == 0.0


def test_max_consecutive_nonfinite_none_never_stops(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        model, losses, saved, _ = spiked_run(
            FG, tmp_path, "fast", epochs=4, max_consecutive_nonfinite=None
        )
    assert len(losses) == 4 and not any(np.isfinite(losses[1:]))
    assert all(np.isfinite(w).all() for w in saved.get_weights())


def test_period_with_nothing_kept_logs_nan_not_zero():
    x, y = data(n=8)
    x = np.full_like(x, np.nan)
    model = fast(max_consecutive_nonfinite=None)
    model.compile(optimizer=sgd(), loss="mse")
    h = model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert math.isnan(h.history["loss"][0])
    # evaluate measures the (finite, untouched) weights on finite data.
    assert np.isfinite(model.evaluate(np.zeros_like(x), y, verbose=0))


def test_isolated_bad_batches_train_on_without_alarm():
    # 3 epochs of 6 batches; batches 1 and 3 of every epoch hold a NaN.
    x, y = data(n=24)
    bad = x.copy()
    bad[4] = np.nan
    bad[12] = np.nan
    model = fast(accumulation_steps=2)
    model.compile(optimizer=sgd(), loss="mse")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        h = model.fit(bad, y, batch_size=4, epochs=3, shuffle=False, verbose=0)
    assert len(h.history["loss"]) == 3
    assert all(np.isfinite(h.history["loss"]))
    assert model.telemetry_counters()["nonfinite_count"] == 6
    assert int(model.optimizer.iterations.numpy()) == 9
    # The same as keras.Model on what each window kept: batch 0, batch 2,
    # batches 4 + 5.
    ref = mlp()
    ref.compile(optimizer=sgd(), loss="mse")
    for _ in range(3):
        for rows in (np.r_[0:4], np.r_[8:12], np.r_[16:24]):
            ref.train_on_batch(x[rows], y[rows])
    assert max_weight_diff(ref, model) < 1e-6


def test_mixed_float16_overflows_at_the_start_do_not_alarm():
    keras.mixed_precision.set_global_policy("mixed_float16")
    x, y = data(n=64)
    y = y * 300.0  # gradients * 2**15 overflow float16 for a few steps
    model = fast(telemetry=True)
    model.compile(optimizer=sgd(1e-4), loss="mse")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        h = model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0)
    assert len(h.history["loss"]) == 3
    assert h.history["nonfinite_count"][-1] >= 3  # the scale searched down
    assert h.history["loss_scale"][-1] > 1.0
    assert all(np.isfinite(h.history["loss"]))


# ------------------------------------------------ overflow after the check
def linear(cls, **options):
    inputs = keras.Input((1,))
    layer = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")
    return cls(inputs, layer(inputs), **options)


def test_window_sum_that_overflows_never_reaches_the_weights():
    # loss = (w a)^2 with w = 1, a = 1e19: loss 1e38 and gradient
    # 2 w a^2 = 2e38 are finite; two of them sum to inf in float32.
    x = np.array([[1e19], [1e19], [1.0], [1.0]], "float32")
    y = np.zeros((4, 1), "float32")
    model = linear(FG, accumulation_steps=2, telemetry=True)
    model.compile(optimizer=keras.optimizers.SGD(1e-40), loss="mse")
    h = model.fit(x, y, batch_size=1, epochs=1, shuffle=False, verbose=0)
    w = float(model.get_weights()[0][0, 0])
    # First window dropped, second applied: w = 1 - 1e-40 * 2 = 1 (float32).
    assert np.isfinite(w) and w == 1.0
    assert h.history["nonfinite_count"] == [1.0]
    assert h.history["updates"] == [1.0]


def test_clipping_a_finite_gradient_whose_square_overflows():
    # grad = 2 w a^2 = 2e20 for a = 1e10: clipped to norm 1, SGD(0.1):
    # w = 1 - 0.1 = 0.9; the logged norm is 2e20 (not inf).
    x = np.array([[1e10]], "float32")
    y = np.zeros((1, 1), "float32")
    model = linear(FG, clip_norm=1.0, telemetry=True)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    h = model.fit(x, y, batch_size=1, epochs=1, verbose=0)
    assert float(model.get_weights()[0][0, 0]) == pytest.approx(0.9, rel=1e-6)
    assert h.history["grad_norm"][0] == pytest.approx(2e20, rel=1e-6)


@pytest.mark.parametrize("a", [1e19, 5e18])
def test_clipping_never_makes_a_silently_zero_update(a):
    # Inputs (a, -a), kernel (0.7, -0.7): gradient (2.8e38, -2.8e38) or
    # (7e37, -7e37), finite (its elements sum to 0, so the micro-batch
    # check passes), norm 3.96e38 (beyond float32) or 9.9e37 (finite). Its
    # clip factor 1 / norm is below float32's smallest normal, which the
    # CPU flushes to 0: the update would silently be 0. It is dropped and
    # counted instead (the weights stay, `iterations` does not move).
    inputs = keras.Input((2,))
    kernel = keras.initializers.Constant([[0.7], [-0.7]])
    layer = keras.layers.Dense(1, use_bias=False, kernel_initializer=kernel)
    model = FG(inputs, layer(inputs), clip_norm=1.0, telemetry=True)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x = np.array([[a, -a]], "float32")
    h = model.fit(x, np.zeros((1, 1), "float32"), verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 0
    np.testing.assert_array_equal(model.get_weights()[0].ravel(), np.float32([0.7, -0.7]))
    assert h.history["updates"] == [0.0]


def _mse_inf_above_100(y_true, y_pred):
    # Infinite for a row whose target is above 100, with a finite gradient:
    # the infinite term does not depend on the prediction.
    mse = keras.ops.mean(keras.ops.square(y_true - y_pred), axis=-1)
    return mse + keras.ops.where(y_true[:, 0] > 100.0, np.inf, 0.0)


@pytest.mark.parametrize(
    "options",
    [{}, {"telemetry": True}, {"clip_norm": 1e6}, {"clip_norm": 1e6, "telemetry": True}],
)
def test_a_nonfinite_loss_with_finite_gradients_is_dropped(options):
    # Batch 1 of 3 has a target of 1000: its loss is inf, its gradient
    # finite. It is dropped (the check reads the loss as well as the
    # gradient's sums or, with clipping or `grad_norm`, its norm), so the
    # model trains as keras.Model on batches 0 and 2.
    x, y = data(n=12)
    y_bad = y.copy()
    y_bad[4:8] = 1000.0
    keep = np.r_[0:4, 8:12]
    ref, model = mlp(), fast(**options)
    ref.compile(optimizer=sgd(), loss=_mse_inf_above_100)
    model.compile(optimizer=sgd(), loss=_mse_inf_above_100)
    ref.fit(x[keep], y[keep], batch_size=4, shuffle=False, verbose=0)
    h = model.fit(x, y_bad, batch_size=4, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 2
    assert max_weight_diff(ref, model) < 1e-6
    if options.get("telemetry"):
        assert h.history["nonfinite_count"] == [1.0]
        assert h.history["nonfinite_first_index"] == [-1.0]  # the loss alone
        assert h.history["nonfinite_num_variables"] == [0.0]


@pytest.mark.parametrize("logging", ["telemetry", "GradientNormLogger", None])
@pytest.mark.parametrize("accumulation_steps", [1, 2])
def test_a_gradient_whose_sum_overflows_is_dropped_and_located_alike_on_every_backend(
    accumulation_steps, logging
):
    # A zero-initialised linear model (kernel, then bias) on one row x =
    # [1e19, 1e19], target 1e19: the loss is (0 - 1e19)^2 = 1e38 (finite),
    # the kernel's gradient 2 * (0 - 1e19) * x = [-2e38, -2e38], each
    # element finite but their sum -4e38 beyond float32 (~3.4e38): the
    # check drops the micro-batch (documented: no update could use it) and
    # locates it at the kernel, variable 0, one variable; the bias's
    # gradient (-2e19) is finite. The same on TensorFlow and JAX, and
    # whatever is logged: `grad_norm` (the logger's, telemetry's) once made
    # the TensorFlow step check the norm instead, which applied it.
    inputs = keras.Input((2,))
    outputs = keras.layers.Dense(1, kernel_initializer="zeros")(inputs)
    options = {"telemetry": True} if logging == "telemetry" else {}
    model = FG(inputs, outputs, accumulation_steps=accumulation_steps, **options)
    model.compile(optimizer="sgd", loss="mse")
    logger = [keras_fastgrad.callbacks.GradientNormLogger()] if logging else []
    x, y = np.full((1, 2), 1e19, "float32"), np.full((1, 1), 1e19, "float32")
    h = model.fit(x, y, epochs=accumulation_steps, verbose=0, callbacks=logger)
    assert int(model.optimizer.iterations.numpy()) == 0
    assert not np.any(model.get_weights()[0]) and not np.any(model.get_weights()[1])
    if logging == "telemetry":
        assert h.history["nonfinite_count"][-1] == accumulation_steps
        assert h.history["nonfinite_first_index"][-1] == 0.0
        assert h.history["nonfinite_num_variables"][-1] == 1.0
        assert h.history["updates"][-1] == 0.0


def test_with_clip_norm_such_a_gradient_is_clipped_alike_on_every_backend():
    # With `clip_norm`, one replica and no accumulation, the check is the
    # norm (exact; `step.verdict.checks_norm`, both backends): the gradient
    # above (norm sqrt(2 * (2e38)^2 + (2e19)^2) = 2.828e38, finite) is
    # clipped to 1e38 and applied, kernel = -0.01 * -2e38 * 1e38 / 2.828e38
    # = 7.07e35 each.
    inputs = keras.Input((2,))
    outputs = keras.layers.Dense(1, kernel_initializer="zeros")(inputs)
    model = FG(inputs, outputs, clip_norm=1e38)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    x, y = np.full((1, 2), 1e19, "float32"), np.full((1, 1), 1e19, "float32")
    model.fit(x, y, verbose=0)
    kernel = model.get_weights()[0].ravel()
    assert int(model.optimizer.iterations.numpy()) == 1
    np.testing.assert_allclose(kernel, [0.01 * 2e38 / (2.0**0.5 * 2e38) * 1e38] * 2, rtol=1e-5)


# ------------------------------------------------ no trainable weights
def warns_on_tensorflow(*args, **kwargs):
    if keras.backend.backend() == "tensorflow":
        return pytest.warns(*args, **kwargs)
    return contextlib.nullcontext()


def test_model_without_trainable_weights_warns_and_runs_like_keras():
    x, y = data(n=8)
    models = []
    for cls in (keras.Model, FG):
        inputs = keras.Input((3,))
        layer = keras.layers.Dense(1, trainable=False)
        models.append(cls(inputs, layer(inputs)))
    models[1].set_weights(models[0].get_weights())
    losses = []
    for m in models:
        m.compile(optimizer=sgd(), loss="mse")
        # Keras warns on TensorFlow (its JAX trainer does not; nor do we there).
        with warns_on_tensorflow(UserWarning, match="does not have any trainable weights"):
            losses.append(m.fit(x, y, batch_size=4, verbose=0).history["loss"])
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)


# ------------------------------------------------------------ validation
@pytest.mark.parametrize("value", [0, -1, 1.5, "10", True])
def test_max_consecutive_nonfinite_is_validated(value):
    with pytest.raises((TypeError, ValueError), match="max_consecutive_nonfinite"):
        fast(max_consecutive_nonfinite=value)


def test_max_consecutive_nonfinite_survives_save_and_load(tmp_path):
    model = fast(max_consecutive_nonfinite=3)
    model.compile(optimizer=sgd(), loss="mse")
    path = os.path.join(tmp_path, "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert loaded.max_consecutive_nonfinite == 3


# ----------------------------------------------------------- small ones
def test_many_models_do_not_warn_about_retracing_the_flush(caplog):
    # Every model flushes a partial window at each epoch end (5 batches,
    # windows of 2). TF warns when one Python function retraces often; a
    # lambda per model shares its code object, so it used to.
    x, y = data(n=10)
    with caplog.at_level("WARNING", logger="tensorflow"):
        for _ in range(7):
            model = fast(accumulation_steps=2)
            model.compile(optimizer=sgd(), loss="mse")
            model.fit(x, y, batch_size=2, epochs=1, verbose=0)
    assert not [r for r in caplog.records if "apply_partial_window" in r.getMessage()]


# ------------------------------------------------------- nothing is lost
def test_weights_trained_with_fastgrad_load_into_a_plain_keras_model(tmp_path):
    # Train with FastGradModel, deploy with keras.Model.
    x, y = data(n=10)
    model = fast(accumulation_steps=2, telemetry=True)
    model.compile(optimizer=sgd(), loss="mse")
    model.fit(x, y, batch_size=2, epochs=1, verbose=0)
    path = os.path.join(tmp_path, "trained.weights.h5")
    model.save_weights(path)
    plain = mlp()
    plain.load_weights(path)
    assert max_weight_diff(plain, model) == 0.0
    np.testing.assert_allclose(plain.predict(x, verbose=0), model.predict(x, verbose=0))


def train_batches(model, x, y, batches):
    """`train_on_batch` on the first `batches` pairs of rows."""
    for i in range(batches):
        model.train_on_batch(x[2 * i : 2 * i + 2], y[2 * i : 2 * i + 2])


def test_mid_window_checkpoint_still_resumes_exactly(tmp_path):
    # 3 batches then a checkpoint (window of 2 half full), reload, 1 more
    # batch: the same as 4 batches in one go.
    x, y = data(n=8)
    whole = fast(accumulation_steps=2)
    whole.compile(optimizer=sgd(), loss="mse")
    train_batches(whole, x, y, 4)
    part = fast(accumulation_steps=2)
    part.compile(optimizer=sgd(), loss="mse")
    train_batches(part, x, y, 3)
    path = os.path.join(tmp_path, "mid.keras")
    part.save(path)
    resumed = keras.saving.load_model(path)
    resumed.train_on_batch(x[6:8], y[6:8])
    assert int(resumed.optimizer.iterations.numpy()) == 2
    assert max_weight_diff(resumed, whole) < 1e-7


def test_state_saved_in_the_earlier_layout_still_resumes():
    # Files written before this release kept the step state in the model's
    # own entry as `fastgrad_<i>`, without the divergence streak (the 10th
    # variable). Loading one mid-window must resume the window.
    x, y = data(n=8)
    source = fast(accumulation_steps=2)
    source.compile(optimizer=sgd(), loss="mse")
    train_batches(source, x, y, 3)
    store = {}
    source.fastgrad_step_state.save_own_variables(store)
    values = [store[str(i)] for i in range(sum(k.isdigit() for k in store))]
    del values[9]  # the streak, which that layout did not have
    legacy = {f"fastgrad_{i}": v for i, v in enumerate(values)}
    resumed = fast(accumulation_steps=2)
    resumed.compile(optimizer=sgd(), loss="mse")
    resumed.set_weights(source.get_weights())
    resumed.load_own_variables(legacy)
    for m in (source, resumed):
        m.train_on_batch(x[6:8], y[6:8])
    # The 4th batch completed the window in both (same weights after it).
    assert int(resumed.optimizer.iterations.numpy()) == 1
    assert max_weight_diff(resumed, source) < 1e-7


# ------------------------------------------- per-output loss metrics
def two_outputs(cls):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((4,))
    trunk = keras.layers.Dense(8, activation="tanh")(inputs)
    outputs = {
        "a": keras.layers.Dense(1, name="a")(trunk),
        "b": keras.layers.Dense(2, name="b")(trunk),
    }
    return cls(inputs, outputs)


@pytest.mark.parametrize(
    "options",
    [{}, {"accumulation_steps": 2}, {"micro_batches": 2}, {"clip_norm": 1.0}],
    ids=["default", "accumulation", "micro_batches", "clip_norm"],
)
def test_a_dropped_batch_leaves_the_per_output_losses_as_they_were(options):
    # Keras' per-output `a_loss` / `b_loss` are updated while the loss is
    # computed, before the step knows the batch is finite: a dropped batch
    # must add nothing to them, as to `loss`. Reference: keras.Model's own
    # logs on the kept batches alone (learning rate 0: no update moves the
    # weights, so dropping a batch changes only what is averaged).
    rng = np.random.default_rng(0)
    x = rng.normal(size=(18, 4)).astype("float32")
    y = {
        "a": rng.normal(size=(18, 1)).astype("float32"),
        "b": rng.normal(size=(18, 2)).astype("float32"),
    }
    y["b"][5, 1] = np.nan  # batch 1 of 4 rows (the last batch has 2)
    model = two_outputs(lambda i, o: keras_fastgrad.FastGradModel(i, o, **options))
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss={"a": "mse", "b": "mse"})
    history = model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    kept = np.r_[0:4, 8:18]  # the same batches, without batch 1
    reference = two_outputs(keras.Model)
    reference.compile(optimizer=keras.optimizers.SGD(0.0), loss={"a": "mse", "b": "mse"})
    expected = reference.fit(
        x[kept], {k: v[kept] for k, v in y.items()}, batch_size=4, shuffle=False, verbose=0
    ).history
    for key in ("a_loss", "b_loss", "loss"):
        np.testing.assert_allclose(history.history[key], expected[key], rtol=1e-5, err_msg=key)
    assert model.telemetry_counters()["nonfinite_count"] == 1
