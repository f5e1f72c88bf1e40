"""FastGradModel against references: plain `keras.Model` on the equivalent
big batch, numpy gradients worked out by hand, training without a bad batch."""

import keras
import numpy as np
import pytest

import keras_fastgrad
from tests.helpers import data, fast, max_weight_diff, mlp, same_start


def sgd(lr=0.1):
    return keras.optimizers.SGD(lr)


# ------------------------------------------------------------ default options
def test_default_options_train_exactly_like_keras_model():
    x, y = data(n=16, outputs=3)
    y = np.argmax(y, axis=1)
    ref = mlp(outputs=3)
    model = fast(outputs=3)
    same_start(ref, model)
    for m in (ref, model):
        m.compile(
            optimizer=keras.optimizers.Adam(0.01),
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
        )
    h_ref = ref.fit(x, y, batch_size=4, epochs=3, shuffle=False, verbose=0)
    h = model.fit(x, y, batch_size=4, epochs=3, shuffle=False, verbose=0)
    assert max_weight_diff(ref, model) == 0.0
    assert h.history == h_ref.history
    assert model.evaluate(x, y, verbose=0) == ref.evaluate(x, y, verbose=0)
    np.testing.assert_array_equal(model.predict(x, verbose=0), ref.predict(x, verbose=0))


def test_subclassed_form_trains_like_keras_model():
    class Net(keras_fastgrad.FastGradModel):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.hidden = keras.layers.Dense(5, activation="tanh")
            self.out = keras.layers.Dense(1)

        def call(self, inputs):
            return self.out(self.hidden(inputs))

    class Ref(keras.Model):
        def __init__(self):
            super().__init__()
            self.hidden = keras.layers.Dense(5, activation="tanh")
            self.out = keras.layers.Dense(1)

        def call(self, inputs):
            return self.out(self.hidden(inputs))

    x, y = data(n=10)
    keras.utils.set_random_seed(3)
    model = Net(accumulation_steps=3)
    model(x[:1])
    keras.utils.set_random_seed(3)
    ref = Ref()
    ref(x[:1])
    same_start(ref, model)
    model.compile(optimizer=sgd(), loss="mse")
    ref.compile(optimizer=sgd(), loss="mse")
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    ref.fit(x, y, batch_size=10, epochs=1, shuffle=False, verbose=0)
    assert max_weight_diff(ref, model) < 1e-6


# --------------------------------------------------------------- accumulation
def test_uneven_window_equals_one_step_on_the_concatenation():
    # 10 samples in batches 4, 4, 2 with k=3: one update on all 10.
    x, y = data(n=10)
    ref, model = mlp(), fast(accumulation_steps=3)
    ref.compile(optimizer=sgd(), loss="mse")
    model.compile(optimizer=sgd(), loss="mse")
    ref.fit(x, y, batch_size=10, epochs=1, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert max_weight_diff(ref, model) < 1e-6
    assert int(model.optimizer.iterations.numpy()) == 1


def test_keras_own_accumulation_is_not_exact_on_uneven_window():
    # The comparison that motivates the model option: Keras weighs the
    # 2-sample micro-batch like the 4-sample ones.
    x, y = data(n=10)
    ref, keras_acc = mlp(), mlp()
    ref.compile(optimizer=sgd(), loss="mse")
    keras_acc.compile(
        optimizer=keras.optimizers.SGD(0.1, gradient_accumulation_steps=3),
        loss="mse",
    )
    ref.fit(x, y, batch_size=10, epochs=1, shuffle=False, verbose=0)
    keras_acc.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert max_weight_diff(ref, keras_acc) > 1e-4


def test_sample_weight_and_class_weight_are_exact():
    x, y = data(n=10)
    w = np.linspace(0.1, 2.0, 10).astype("float32")
    ref, model = mlp(), fast(accumulation_steps=3)
    ref.compile(optimizer=sgd(), loss="mse")
    model.compile(optimizer=sgd(), loss="mse")
    ref.fit(x, y, sample_weight=w, batch_size=10, shuffle=False, verbose=0)
    model.fit(x, y, sample_weight=w, batch_size=4, shuffle=False, verbose=0)
    assert max_weight_diff(ref, model) < 1e-6

    labels = (x[:, 0] > 0).astype("int32")
    cw = {0: 0.3, 1: 2.5}
    ref, model = mlp(outputs=2), fast(outputs=2, accumulation_steps=3)
    for m in (ref, model):
        m.compile(optimizer=sgd(), loss="sparse_categorical_crossentropy")
    ref.fit(x, labels, class_weight=cw, batch_size=10, shuffle=False, verbose=0)
    model.fit(x, labels, class_weight=cw, batch_size=4, shuffle=False, verbose=0)
    assert max_weight_diff(ref, model) < 1e-6


def test_partial_window_applied_at_epoch_end_with_adam():
    # 12 samples, batch 4, k=2: windows of 8 and 4 (flushed at epoch end),
    # exactly keras.Model with batch 8.
    x, y = data(n=12)
    ref, model = mlp(), fast(accumulation_steps=2)
    ref.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    h_ref = ref.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0)
    h = model.fit(x, y, batch_size=4, epochs=3, shuffle=False, verbose=0)
    assert max_weight_diff(ref, model) < 1e-5
    assert int(model.optimizer.iterations.numpy()) == 6  # updates, not batches
    np.testing.assert_allclose(h.history["loss"], h_ref.history["loss"], rtol=1e-5)


def test_learning_rate_schedule_sees_updates():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 1, 0.5)
    x, y = data(n=16)
    ref, model = mlp(), fast(accumulation_steps=2)
    ref.compile(optimizer=keras.optimizers.SGD(schedule), loss="mse")
    model.compile(optimizer=keras.optimizers.SGD(schedule), loss="mse")
    ref.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert max_weight_diff(ref, model) < 1e-6


def test_accumulators_are_float32_state():
    model = fast(accumulation_steps=2)
    model.compile(optimizer=sgd(), loss="mse")
    model.fit(*data(n=4), batch_size=2, verbose=0)
    sums = model.fastgrad_step_state.accumulator.sums
    assert len(sums) == len(model.trainable_variables)
    assert all(s.dtype == "float32" for s in sums)


# ------------------------------------------------------------------- clipping
def test_clipped_update_matches_hand_computed_gradient():
    # Linear model y = x W + b with MSE: dL/dW = 2/N x^T r, dL/db = 2/N sum r.
    rng = np.random.default_rng(3)
    x = rng.normal(size=(6, 3)).astype("float32")
    y = (rng.normal(size=(6, 1)) * 10).astype("float32")
    inputs = keras.Input((3,))
    model = keras_fastgrad.FastGradModel(
        inputs, keras.layers.Dense(1)(inputs), accumulation_steps=2, clip_norm=0.5
    )
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
    w0, b0 = [v.copy() for v in model.get_weights()]
    residual = x @ w0 + b0 - y
    grad_w = 2.0 / 6 * x.T @ residual
    grad_b = 2.0 / 6 * residual.sum(axis=0)
    norm = np.sqrt((grad_w**2).sum() + (grad_b**2).sum())
    assert norm > 0.5  # clipping must act
    model.fit(x, y, batch_size=3, epochs=1, shuffle=False, verbose=0)
    w1, b1 = model.get_weights()
    np.testing.assert_allclose(w0 - w1, grad_w * 0.5 / norm, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(b0 - b1, grad_b * 0.5 / norm, rtol=1e-4, atol=1e-6)


def test_clipping_is_a_no_op_below_the_norm():
    x, y = data(n=8)
    ref, model = mlp(), fast(clip_norm=1e6)
    ref.compile(optimizer=sgd(), loss="mse")
    model.compile(optimizer=sgd(), loss="mse")
    ref.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    assert max_weight_diff(ref, model) < 1e-7


# ------------------------------------------------------------ non-finite safety
def _with_nan_batch(x, y, position, batch_size):
    bad = x[:batch_size].copy()
    bad[0, 0] = np.nan
    xs = np.concatenate([x[: position * batch_size], bad, x[position * batch_size :]])
    ys = np.concatenate([y[: position * batch_size], y[:batch_size], y[position * batch_size :]])
    return xs, ys


def test_nan_batch_is_dropped_alone():
    x, y = data(n=12)
    xs, ys = _with_nan_batch(x, y, position=1, batch_size=4)
    ref, model = mlp(), fast(telemetry=True)
    ref.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    h_ref = ref.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    h = model.fit(xs, ys, batch_size=4, shuffle=False, verbose=0)
    assert max_weight_diff(ref, model) < 1e-7
    assert int(model.optimizer.iterations.numpy()) == 3
    assert h.history["nonfinite_count"] == [1.0]
    assert h.history["nonfinite_first_index"] == [0.0]  # hidden/kernel
    assert h.history["nonfinite_num_variables"] == [4.0]
    np.testing.assert_allclose(h.history["loss"], h_ref.history["loss"], rtol=1e-6)


def test_nan_batch_is_left_out_of_its_window():
    # Window [b0, NaN] -> one step on b0 alone; window [b1, b2] -> on both.
    x, y = data(n=12)
    xs, ys = _with_nan_batch(x, y, position=1, batch_size=4)
    ref, model = mlp(), fast(accumulation_steps=2)
    ref.compile(optimizer=sgd(), loss="mse")
    model.compile(optimizer=sgd(), loss="mse")
    ref.train_on_batch(x[:4], y[:4])
    ref.train_on_batch(x[4:], y[4:])
    model.fit(xs, ys, batch_size=4, shuffle=False, verbose=0)
    assert max_weight_diff(ref, model) < 1e-6


def test_skip_nonfinite_false_lets_nan_through_like_keras():
    x, y = data(n=8)
    xs, ys = _with_nan_batch(x, y, position=0, batch_size=4)
    model = fast(skip_nonfinite=False)
    model.compile(optimizer=sgd(), loss="mse")
    model.fit(xs, ys, batch_size=4, shuffle=False, verbose=0)
    assert np.isnan(model.get_weights()[0]).any()


# ------------------------------------------------------------ mixed precision
def test_mixed_float16_trains_with_loss_scaling_and_float32_variables():
    keras.mixed_precision.set_global_policy("mixed_float16")
    x, y = data(n=16)
    ref, model = mlp(), fast(accumulation_steps=2, telemetry=True)
    # A scale that does not overflow here, so both runs keep every batch.
    lso = keras.optimizers.LossScaleOptimizer
    ref.compile(optimizer=lso(sgd(), initial_scale=2.0**8), loss="mse")
    model.compile(optimizer=lso(sgd(), initial_scale=2.0**8), loss="mse")
    ref.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    h = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert all(v.dtype == "float32" for v in model.trainable_variables)
    assert h.history["nonfinite_count"] == [0.0, 0.0]
    assert h.history["loss_scale"] == [2.0**8, 2.0**8]
    # float16 forward: Keras' own loss-scaled big-batch training, up to
    # float16 rounding of the two half-batch forwards.
    assert max_weight_diff(ref, model) < 2e-3


def test_mixed_float16_default_scale_halves_once_per_dropped_micro_batch():
    keras.mixed_precision.set_global_policy("mixed_float16")
    x, y = data(n=16)
    model = fast(accumulation_steps=2, telemetry=True)
    model.compile(optimizer=sgd(), loss="mse")
    h = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    # Without growth (2000 finite steps), each drop halves the scale once.
    drops = h.history["nonfinite_count"][-1]
    assert h.history["loss_scale"][-1] == 2.0**15 / 2.0**drops
    assert all(np.isfinite(w).all() for w in model.get_weights())


def test_mixed_float16_overflowing_batch_is_dropped_and_scale_lowered():
    keras.mixed_precision.set_global_policy("mixed_float16")
    x, y = data(n=8)
    huge = np.full((4, 3), 1e5, "float32")  # inf once cast to float16
    xs, ys = np.concatenate([x, huge]), np.concatenate([y, y[:4]])
    ref, model = mlp(), fast(telemetry=True)
    ref.compile(optimizer=sgd(), loss="mse")
    model.compile(optimizer=sgd(), loss="mse")
    ref.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    h = model.fit(xs, ys, batch_size=4, shuffle=False, verbose=0)
    assert h.history["nonfinite_count"] == [1.0]
    assert h.history["loss_scale"] == [2.0**14]
    assert model.optimizer.dynamic_scale.numpy() == 2.0**14
    assert max_weight_diff(ref, model) == 0.0
    assert np.isfinite(h.history["loss"][0])


def test_mixed_bfloat16_trains_without_scaling():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    x, y = data(n=8)
    model = fast(accumulation_steps=2, telemetry=True)
    model.compile(optimizer=sgd(), loss="mse")
    h = model.fit(x, y, batch_size=4, epochs=2, verbose=0)
    assert not isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert h.history["loss_scale"] == [1.0, 1.0]
    assert h.history["loss"][1] < h.history["loss"][0]
    assert all(v.dtype == "float32" for v in model.trainable_variables)


# --------------------------------------------------- compiled-step variants
@pytest.mark.parametrize("options", [{}, {"accumulation_steps": 3, "clip_norm": 0.3}])
def test_jit_compile_equals_graph_mode(options):
    x, y = data(n=14)
    a, b = fast(**options), fast(**options)
    a.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", jit_compile=False)
    b.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", jit_compile=True)
    a.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    b.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert max_weight_diff(a, b) < 1e-5


def test_steps_per_execution_equals_one_step_per_call():
    x, y = data(n=18)
    xs, ys = _with_nan_batch(x, y, position=2, batch_size=4)
    a = fast(accumulation_steps=2, clip_norm=0.3, telemetry=True)
    b = fast(accumulation_steps=2, clip_norm=0.3, telemetry=True)
    a.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    b.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", steps_per_execution=3)
    ha = a.fit(xs, ys, batch_size=4, epochs=2, shuffle=False, verbose=0)
    hb = b.fit(xs, ys, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert max_weight_diff(a, b) < 1e-6
    # The NaN happened in a step that was not the last of its group.
    assert hb.history["nonfinite_count"] == ha.history["nonfinite_count"] == [1.0, 2.0]
    np.testing.assert_allclose(hb.history["loss"], ha.history["loss"], rtol=1e-6)


def test_tape_watches_exactly_the_trainable_variables():
    model = fast(telemetry=True)
    model.compile(optimizer=sgd(), loss="mse")
    h = model.fit(*data(n=4), verbose=0)
    assert model.tape_variable_count == len(model.trainable_variables) == 4
    assert h.history["tape_variables"] == [4.0]
    model.get_layer("hidden").trainable = False
    model.compile(optimizer=sgd(), loss="mse")
    model.fit(*data(n=4), verbose=0)
    assert model.tape_variable_count == 2


def test_multi_output_default_equals_keras_model():
    def build(cls):
        keras.utils.set_random_seed(5)
        inputs = keras.Input((3,))
        h = keras.layers.Dense(4, activation="relu")(inputs)
        outs = {"a": keras.layers.Dense(1, name="a")(h), "b": keras.layers.Dense(2, name="b")(h)}
        return cls(inputs, outs)

    x, _ = data(n=8)
    ys = {"a": x[:, :1] * 2, "b": x[:, 1:]}
    ref, model = build(keras.Model), build(keras_fastgrad.FastGradModel)
    for m in (ref, model):
        m.compile(optimizer=sgd(), loss={"a": "mse", "b": "mae"}, loss_weights={"a": 1.0, "b": 0.5})
    h_ref = ref.fit(x, ys, batch_size=4, epochs=2, shuffle=False, verbose=0)
    h = model.fit(x, ys, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert max_weight_diff(ref, model) == 0.0
    assert h.history == h_ref.history


# ------------------------------------------------------------- save and resume
def test_save_load_keeps_options_weights_and_training_continues(tmp_path):
    x, y = data(n=12)
    model = fast(accumulation_steps=2, clip_norm=0.7)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded, keras_fastgrad.FastGradModel)
    assert (loaded.accumulation_steps, loaded.clip_norm, loaded.skip_nonfinite) == (2, 0.7, True)
    assert max_weight_diff(model, loaded) == 0.0
    model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    loaded.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    assert max_weight_diff(model, loaded) < 1e-6


def test_checkpoint_mid_window_resumes_exactly(tmp_path):
    # Window of 3 micro-batches; save after the first, resume in a new model.
    x, y = data(n=12)
    ref = mlp()
    ref.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    ref.train_on_batch(x, y)

    model = fast(accumulation_steps=3)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.train_on_batch(x[:4], y[:4])
    path = str(tmp_path / "mid.keras")
    model.save(path)
    resumed = keras.models.load_model(path)
    assert int(resumed.fastgrad_step_state.accumulator.micro_step.numpy()) == 1
    resumed.train_on_batch(x[4:8], y[4:8])
    resumed.train_on_batch(x[8:], y[8:])
    assert int(resumed.optimizer.iterations.numpy()) == 1
    assert max_weight_diff(ref, resumed) < 1e-6


def test_weights_of_a_plain_keras_model_load_into_fastgrad_model(tmp_path):
    ref = mlp()
    path = str(tmp_path / "plain.weights.h5")
    ref.save_weights(path)
    model = fast(seed=99, accumulation_steps=2)
    model.load_weights(path)
    assert max_weight_diff(ref, model) == 0.0


def test_apply_partial_window_after_train_on_batch_loop():
    x, y = data(n=8)
    ref, model = mlp(), fast(accumulation_steps=4)
    ref.compile(optimizer=sgd(), loss="mse")
    model.compile(optimizer=sgd(), loss="mse")
    ref.train_on_batch(x, y)
    model.train_on_batch(x[:4], y[:4])
    model.train_on_batch(x[4:], y[4:])
    assert int(model.optimizer.iterations.numpy()) == 0
    model.apply_partial_window()
    assert max_weight_diff(ref, model) < 1e-6
    assert model.apply_partial_window() is None  # nothing pending


@keras.saving.register_keras_serializable(package="test_model")
class CustomFast(keras_fastgrad.FastGradModel):
    """A user subclass, used in the functional form."""


def test_functional_use_of_a_subclass_leaves_subclassing_working(tmp_path):
    x, y = data(n=8)
    inputs = keras.Input((3,))
    model = CustomFast(inputs, keras.layers.Dense(1)(inputs), accumulation_steps=2)
    assert isinstance(model, CustomFast) and type(model).__name__ == "CustomFast"
    model.compile(optimizer=sgd(), loss="mse")
    model.fit(x, y, batch_size=4, verbose=0)
    path = str(tmp_path / "custom.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded, CustomFast) and loaded.accumulation_steps == 2
    assert max_weight_diff(model, loaded) == 0.0

    # Keras would have rewritten the bases of CustomFast and FastGradModel;
    # the subclassing form of both must still work afterwards.
    class Net(CustomFast):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(1)

        def call(self, inputs):
            return self.dense(inputs)

    net = Net(accumulation_steps=2)
    net.compile(optimizer=sgd(), loss="mse")
    net.fit(x, y, batch_size=4, verbose=0)
    assert int(net.optimizer.iterations.numpy()) == 1
