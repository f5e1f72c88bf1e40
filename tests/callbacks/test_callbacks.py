"""The callbacks of `keras_fastgrad.callbacks` against references: gradients
worked out by hand in numpy, counts of clipped updates chosen by
construction, TensorBoard event files read back, NaN placed in known
batches and variables."""

import csv
import glob
import os
import re
import warnings

import keras
import numpy as np
import pytest

import keras_fastgrad
from keras_fastgrad.callbacks import (
    GradientNormLogger,
    NonFiniteError,
    NonFiniteGuard,
    RetraceWatch,
    TapeVariableCounter,
)
from tests.helpers import tf  # (TensorFlow imported at first use: not on JAX)

ON_JAX = keras.backend.backend() == "jax"


@pytest.fixture(autouse=True)
def fresh_session():
    # After the root conftest's fixture: also clears its Keras global seed.
    # Without `gc.collect()`: the root fixture's reset at the end collects.
    keras.backend.clear_session(free_memory=False)
    yield
    keras.backend.clear_session(free_memory=False)


class Recorder(keras.callbacks.Callback):
    """Keeps the batch logs that callbacks listed before it produced."""

    def __init__(self):
        super().__init__()
        self.batches = []

    def on_train_batch_end(self, batch, logs=None):
        self.batches.append((batch, dict(logs)))


def mlp(cls=keras_fastgrad.FastGradModel, seed=1, **options):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(4, activation="tanh", name="hidden")(inputs)
    return cls(inputs, keras.layers.Dense(1, name="out")(hidden), **options)


def data(n=16, seed=0):
    rng = np.random.default_rng(seed)
    return (
        rng.normal(size=(n, 3)).astype("float32"),
        rng.normal(size=(n, 1)).astype("float32"),
    )


class NaNGradient(keras.layers.Layer):
    """Adds `sqrt(w - w)` = 0: finite forward, NaN gradient for `w`."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=(), initializer="zeros", name="w")

    def call(self, x):
        return x + keras.ops.sqrt(self.w - self.w)


def model_with_bad_layer(jit_compile=False):
    keras.utils.set_random_seed(2)
    inputs = keras.Input((3,))
    h = keras.layers.Dense(4, name="first")(inputs)
    h = NaNGradient(name="bad_layer")(h)
    model = keras_fastgrad.FastGradModel(inputs, keras.layers.Dense(1, name="last")(h))
    model.compile(optimizer="sgd", loss="mse", jit_compile=jit_compile)
    return model


# ---------------------------------------------------------- GradientNormLogger
def test_grad_norm_per_layer_and_update_ratio_match_numpy():
    inputs = keras.Input((3,))
    h = keras.layers.Dense(2, name="first")(inputs)
    model = keras_fastgrad.FastGradModel(inputs, keras.layers.Dense(1, name="second")(h))
    rng = np.random.default_rng(5)
    w1, b1 = rng.normal(size=(3, 2)), rng.normal(size=2)
    w2, b2 = rng.normal(size=(2, 1)), rng.normal(size=1)
    model.set_weights([w1, b1, w2, b2])
    x, y = rng.normal(size=(4, 3)), rng.normal(size=(4, 1))
    lr = 0.1
    model.compile(optimizer=keras.optimizers.SGD(lr), loss="mse")
    logger = GradientNormLogger(per_layer=True, update_ratio=True)
    history = model.fit(x, y, batch_size=4, verbose=0, callbacks=[logger])

    # Hand-derived gradients of mean((x w1 + b1) w2 + b2 - y)^2.
    h = x @ w1 + b1
    g_out = 2 * (h @ w2 + b2 - y) / len(x)
    g_w2, g_b2 = h.T @ g_out, g_out.sum(0)
    g_h = g_out @ w2.T
    g_w1, g_b1 = x.T @ g_h, g_h.sum(0)
    first = np.sqrt(np.sum(g_w1**2) + np.sum(g_b1**2))
    second = np.sqrt(np.sum(g_w2**2) + np.sum(g_b2**2))
    weights = np.sqrt(sum(np.sum(w**2) for w in (w1, b1, w2, b2)))
    logs = history.history
    np.testing.assert_allclose(logs["grad_norm"], [np.hypot(first, second)], rtol=1e-5)
    np.testing.assert_allclose(logs["grad_norm/first"], [first], rtol=1e-5)
    np.testing.assert_allclose(logs["grad_norm/second"], [second], rtol=1e-5)
    # SGD moves the weights by lr * g.
    np.testing.assert_allclose(
        logs["update_ratio"], [lr * np.hypot(first, second) / weights], rtol=1e-5
    )


def clip_model():
    """Zero weights and lr 0: batches with y = 0 have gradient 0 (never
    clipped), batches with y = 10 have a large one (always clipped)."""
    inputs = keras.Input((2,))
    layer = keras.layers.Dense(1, kernel_initializer="zeros", name="head")
    model = keras_fastgrad.FastGradModel(inputs, layer(inputs), clip_norm=1.0)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    return model


def test_clipped_fraction_is_per_epoch_and_running_within_the_epoch():
    model = clip_model()
    x = np.ones((8, 2))
    y = np.repeat([[0.0], [10.0], [10.0], [10.0]], 2, axis=0)  # batches A B B B
    recorder = Recorder()
    history = model.fit(
        x,
        y,
        batch_size=2,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[GradientNormLogger(clip_fraction=True), recorder],
    )
    assert history.history["clipped_fraction"] == [0.75, 0.75]
    assert history.history["clipped_updates"] == [3.0, 6.0]
    running = [logs["clipped_fraction"] for _, logs in recorder.batches[:4]]
    np.testing.assert_allclose(running, [0.0, 1 / 2, 2 / 3, 3 / 4])
    # A later fit with only unclipped batches: per epoch 0 (cumulative: 6/12).
    history = model.fit(
        x,
        np.zeros((8, 1)),
        batch_size=2,
        verbose=0,
        callbacks=[GradientNormLogger(clip_fraction=True)],
    )
    assert history.history["clipped_fraction"] == [0.0]


def read_events(directory):
    """{tag: {step: value}} of every scalar and the tags of histograms."""
    scalars, histograms = {}, set()
    for path in glob.glob(os.path.join(directory, "**", "events.out.*"), recursive=True):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                plugin = value.metadata.plugin_data.plugin_name
                if plugin == "scalars":
                    scalars.setdefault(value.tag, {})[event.step] = float(
                        tf.make_ndarray(value.tensor)
                    )
                elif plugin == "histograms":
                    histograms.add((value.tag, event.step))
    return scalars, histograms


@pytest.mark.needs_tensorflow(reason="TensorBoard's event writer")
def test_tensorboard_event_files_hold_scalars_and_histograms(tmp_path):
    model = mlp(clip_norm=0.5)
    model.compile(optimizer="sgd", loss="mse")
    x, y = data(n=16)
    logger = GradientNormLogger(
        per_layer=True,
        clip_fraction=True,
        tensorboard_dir=str(tmp_path),
        histogram_freq=2,
        update_freq="batch",
    )
    recorder = Recorder()
    history = model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[logger, recorder])
    scalars, histograms = read_events(tmp_path / "train")
    for key in ("grad_norm", "grad_norm/hidden", "grad_norm/out", "clipped_fraction"):
        np.testing.assert_allclose(
            [scalars["epoch_" + key][e] for e in (0, 1)],
            history.history[key],
            rtol=1e-6,
        )
    batch_norms = [logs["grad_norm"] for _, logs in recorder.batches]
    assert sorted(scalars["batch_grad_norm"]) == list(range(1, 9))
    np.testing.assert_allclose(
        [scalars["batch_grad_norm"][s] for s in range(1, 9)], batch_norms, rtol=1e-6
    )
    # histogram_freq=2: weights only after the second epoch (index 1).
    assert histograms == {(v.path, 1) for v in model.trainable_variables}


@pytest.mark.needs_tensorflow(reason="TensorBoard's event writer")
def test_tensorboard_update_freq_in_batches(tmp_path):
    model = mlp()
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
    x, y = data(n=32)
    logger = GradientNormLogger(tensorboard_dir=str(tmp_path), update_freq=3)
    model.fit(x, y, batch_size=4, verbose=0, callbacks=[logger])
    scalars, histograms = read_events(tmp_path)
    # Calls end after batches 2, 4, 6, 8: written when >= 3 since the last.
    assert sorted(scalars["batch_grad_norm"]) == [4, 8]
    assert sorted(scalars["epoch_grad_norm"]) == [0]
    assert not histograms


def test_csv_logger_gets_the_columns(tmp_path):
    model = mlp(clip_norm=1.0)
    model.compile(optimizer="sgd", loss="mse")
    x, y = data()
    path = str(tmp_path / "log.csv")
    model.fit(
        x,
        y,
        batch_size=4,
        epochs=2,
        verbose=0,
        callbacks=[
            GradientNormLogger(per_layer=True, clip_fraction=True, update_ratio=True),
            keras.callbacks.CSVLogger(path),
        ],
    )
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2
    for column in (
        "grad_norm",
        "grad_norm/hidden",
        "grad_norm/out",
        "clipped_fraction",
        "update_ratio",
        "loss",
    ):
        assert column in rows[0]
        assert np.isfinite(float(rows[1][column]))


def test_expensive_keys_only_on_request():
    model = mlp()
    model.compile(optimizer="sgd", loss="mse")
    x, y = data()
    history = model.fit(x, y, batch_size=4, verbose=0, callbacks=[GradientNormLogger()])
    assert "grad_norm" in history.history
    assert not [k for k in history.history if k.startswith("grad_norm/")]
    assert "update_ratio" not in history.history
    assert "clipped_fraction" not in history.history


# ------------------------------------------------------------- NonFiniteGuard
@pytest.mark.parametrize("jit_compile", [False, True])
def test_raise_names_the_bad_layer(jit_compile):
    model = model_with_bad_layer(jit_compile)
    x, y = data()
    with pytest.raises(NonFiniteError, match=r"`bad_layer/w` \(1 of 5 gradients") as info:
        model.fit(x, y, batch_size=4, verbose=0, callbacks=[NonFiniteGuard("raise")])
    assert "epoch 0, batch 0" in str(info.value)


def test_stop_ends_fit_after_the_first_epoch():
    model = model_with_bad_layer()
    x, y = data()
    with pytest.warns(RuntimeWarning, match="bad_layer"):
        history = model.fit(
            x, y, batch_size=4, epochs=3, verbose=0, callbacks=[NonFiniteGuard("stop")]
        )
    assert len(history.history["loss"]) == 1


def test_warn_continues_and_weights_stay_finite():
    model = mlp()
    model.compile(optimizer="sgd", loss="mse")
    x, y = data()
    x[5, 0] = np.nan  # batch 1 of 4
    with pytest.warns(RuntimeWarning, match="epoch 1, batch 1") as caught:
        history = model.fit(
            x,
            y,
            batch_size=4,
            epochs=2,
            shuffle=False,
            verbose=0,
            callbacks=[NonFiniteGuard("warn")],
        )
    assert len([w for w in caught if "Non-finite" in str(w.message)]) == 2
    assert len(history.history["loss"]) == 2
    assert all(np.isfinite(w).all() for w in model.get_weights())


def test_warn_summarises_each_epoch_in_one_warning():
    model = mlp()
    model.compile(optimizer="sgd", loss="mse")
    x, y = data(n=32)
    nan_rows = [1, 6, 7, 18, 25]  # batches of 4: 0, 1, 1, 4, 6
    x[nan_rows, 2] = np.nan
    bad_batches = sorted({row // 4 for row in nan_rows})  # by hand: [0, 1, 4, 6]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(
            x,
            y,
            batch_size=4,
            epochs=2,
            shuffle=False,
            verbose=0,
            callbacks=[NonFiniteGuard("warn")],
        )
    messages = [
        str(w.message)
        for w in caught
        if issubclass(w.category, RuntimeWarning) and "non-finite" in str(w.message).lower()
    ]
    assert len(messages) == 2, messages  # one per epoch, not one per bad batch
    for epoch, message in enumerate(messages):
        assert message.startswith(
            f"Epoch {epoch}: {len(bad_batches)} non-finite micro-batch(es) dropped in this epoch."
        ), message
        # Where the latest went bad, worded as action="raise" words it.
        assert f"Non-finite gradient in epoch {epoch}, batch {bad_batches[-1]} (0-based)" in message
        assert f"`{model.trainable_variables[0].path}`" in message
    assert len(history.history["loss"]) == 2
    assert model.telemetry_counters()["nonfinite_count"] == 2 * len(bad_batches)
    assert all(np.isfinite(w).all() for w in model.get_weights())


def test_warn_is_silent_for_a_clean_epoch():
    model = mlp()
    model.compile(optimizer="sgd", loss="mse")
    x, y = data(n=16)
    x[2, 0] = np.nan  # epoch 0 only: the second fit gets clean data
    guard = NonFiniteGuard("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[guard])
        model.fit(
            np.nan_to_num(x), y, batch_size=4, epochs=2, shuffle=False, verbose=0, callbacks=[guard]
        )
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and messages[0].startswith("Epoch 0: 1 non-finite"), messages


def test_nan_in_second_batch_of_a_steps_per_execution_group():
    model = mlp()
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=4)
    x, y = data()
    x[5, 0] = np.nan  # batch 1; the 4 batches run in one call, last one clean
    # NaN input makes every gradient NaN: the first is the first variable.
    expected = re.escape("batches 0-3 (0-based): 1 micro-batch(es) dropped")
    with pytest.raises(NonFiniteError, match=expected) as info:
        model.fit(x, y, batch_size=4, shuffle=False, verbose=0, callbacks=[NonFiniteGuard()])
    assert f"`{model.trainable_variables[0].path}` (4 of 4" in str(info.value)


def test_a_nonfinite_loss_with_finite_gradients_is_reported_as_loss():
    def loss(y_true, y_pred):  # NaN constant: the gradient stays finite
        mse = keras.ops.mean(keras.ops.square(y_true - y_pred))
        return mse + keras.ops.stop_gradient(keras.ops.log(-keras.ops.ones(())))

    model = mlp()
    model.compile(optimizer="sgd", loss=loss)
    x, y = data()
    with pytest.raises(NonFiniteError, match="Non-finite loss .*the loss was NaN/Inf"):
        model.fit(x, y, batch_size=4, verbose=0, callbacks=[NonFiniteGuard()])


def test_guard_ignores_nonfinite_batches_counted_before_its_fit():
    model = mlp()
    model.compile(optimizer="sgd", loss="mse")
    x, y = data()
    bad = x.copy()
    bad[0, 0] = np.nan
    model.fit(bad, y, batch_size=4, verbose=0)  # counted: nonfinite_count 1
    model.fit(x, y, batch_size=4, verbose=0, callbacks=[NonFiniteGuard()])
    with pytest.raises(NonFiniteError):
        model.fit(bad, y, batch_size=4, verbose=0, callbacks=[NonFiniteGuard()])


# -------------------------------------------------------- TapeVariableCounter
def test_tape_variables_count_drops_when_a_layer_is_frozen():
    model = mlp()
    model.compile(optimizer="sgd", loss="mse")
    x, y = data()
    counter = TapeVariableCounter()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about
        history = model.fit(x, y, batch_size=4, verbose=0, callbacks=[counter])
    assert history.history["tape_variables"] == [4.0]
    assert history.history["trainable_variables"] == [4.0]
    model.get_layer("hidden").trainable = False
    model.compile(optimizer="sgd", loss="mse")
    history = model.fit(x, y, batch_size=4, verbose=0, callbacks=[counter])
    assert history.history["tape_variables"] == [2.0]
    assert history.history["trainable_variables"] == [2.0]


@pytest.mark.skipif(ON_JAX, reason="an error on JAX (the next test), as for keras.Model")
def test_warns_once_when_trainable_changed_without_recompile():
    model = mlp()
    model.compile(optimizer="sgd", loss="mse")
    x, y = data()
    counter = TapeVariableCounter()
    model.fit(x, y, batch_size=4, verbose=0, callbacks=[counter])
    model.get_layer("hidden").trainable = False
    with pytest.warns(UserWarning, match=r"watched 4 variables .* 2 trainable.*'hidden'"):
        history = model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[counter])
    assert history.history["tape_variables"] == [4.0, 4.0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once already
        model.fit(x, y, batch_size=4, verbose=0, callbacks=[counter])


@pytest.mark.skipif(not ON_JAX, reason="a warning on TensorFlow (the test above)")
def test_trainable_changed_without_recompile_is_refused_on_jax():
    # Keras' JAX step takes the trainable values anew each call: the
    # optimizer, built for 4, cannot take 2. keras.Model fails too.
    x, y = data()
    for cls, error in (
        (keras.Model, r"built with 4 variables"),
        (
            keras_fastgrad.FastGradModel,
            r"built for 4.*now has 2.*\['hidden'\].*Fix: call `model.compile",
        ),
    ):
        model = mlp(cls)
        model.compile(optimizer="sgd", loss="mse")
        model.fit(x, y, batch_size=4, verbose=0)
        model.get_layer("hidden").trainable = False
        start = model.get_weights()
        with pytest.raises(ValueError, match=error):
            model.fit(x, y, batch_size=4, verbose=0)
    # Refused while tracing: the weights are the model's still (Keras' JAX
    # `fit` had detached them; keras.Model is left without them).
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), start))
    model.compile(optimizer="sgd", loss="mse")  # the fix
    history = model.fit(x, y, batch_size=4, verbose=0, callbacks=[TapeVariableCounter()])
    assert history.history["tape_variables"] == [2.0]


class WithSpareWeight(keras.layers.Layer):
    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], 1), name="kernel")
        self.spare = self.add_weight(shape=(), name="spare")  # never used

    def call(self, x):
        return x @ self.kernel


def test_warns_once_by_name_about_variables_without_gradient():
    inputs = keras.Input((3,))
    model = keras_fastgrad.FastGradModel(inputs, WithSpareWeight(name="odd")(inputs))
    model.compile(optimizer="sgd", loss="mse")
    x, y = data()
    counter = TapeVariableCounter()
    with pytest.warns(
        UserWarning, match=re.escape("no gradient and are never updated: ['odd/spare']")
    ):
        history = model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[counter])
    assert history.history["tape_variables"] == [2.0, 2.0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.fit(x, y, batch_size=4, verbose=0, callbacks=[counter])


class Unreached(keras.layers.Layer):
    """`kernel` reaches the loss; `spare` is unused, `cut` reaches it only
    behind `stop_gradient`, `index` only through an argmax (an integer)."""

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], 1), name="kernel")
        self.spare = self.add_weight(shape=(), name="spare")
        self.cut = self.add_weight(shape=(), name="cut")
        self.index = self.add_weight(shape=(3,), name="index")

    def call(self, x):
        picked = keras.ops.cast(keras.ops.argmax(self.index), x.dtype)
        return x @ self.kernel + keras.ops.stop_gradient(self.cut) + picked


@pytest.mark.parametrize("run_eagerly", [False, True], ids=["traced", "eager"])
def test_variables_the_loss_does_not_reach_are_named(run_eagerly):
    # (On JAX their gradient is zeros, not None: found from the program.)
    inputs = keras.Input((3,))
    model = keras_fastgrad.FastGradModel(inputs, Unreached(name="odd")(inputs))
    model.compile(optimizer="sgd", loss="mse", run_eagerly=run_eagerly)
    assert model.variables_without_gradient is None  # nothing traced yet
    unreached = [model.get_layer("odd").spare, model.get_layer("odd").cut]
    unreached.append(model.get_layer("odd").index)
    before = [np.array(v) for v in unreached]
    x, y = data()
    with pytest.warns(UserWarning, match=re.escape("['odd/spare', 'odd/cut', 'odd/index']")):
        model.fit(x, y, batch_size=4, verbose=0, callbacks=[TapeVariableCounter()])
    assert model.variables_without_gradient == ["odd/spare", "odd/cut", "odd/index"]
    for variable, value in zip(unreached, before):  # never updated, as the warning says
        np.testing.assert_array_equal(np.array(variable), value)


# --------------------------------------------------------------- RetraceWatch
def test_retrace_watch_counts_traces_per_fit():
    model = mlp()
    model.compile(optimizer="sgd", loss="mse")
    x, y = data(n=14)  # a short last batch (2 rows)
    if ON_JAX:  # `jax.jit` traces the step again for the short batch's shape
        with pytest.warns(
            UserWarning, match=r"traced the train step 2 times.*last batch of epoch 0"
        ):
            history = model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[RetraceWatch()])
        assert history.history["train_traces"] == [2.0, 2.0]
    else:  # no retrace under Keras 3 `fit` on TensorFlow (a dynamic batch dimension)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            history = model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[RetraceWatch()])
        assert history.history["train_traces"] == [1.0, 1.0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        history = model.fit(x, y, batch_size=4, verbose=0, callbacks=[RetraceWatch()])
        assert history.history["train_traces"] == [0.0]  # step reused
    model.compile(optimizer="sgd", loss="mse", run_eagerly=True)
    history = model.fit(x, y, batch_size=4, verbose=0, callbacks=[RetraceWatch()])
    assert history.history["train_traces"] == [0.0]  # nothing traced


class Rebuild(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 1:
            self.model.make_train_function(force=True)


def test_retrace_watch_warns_once_when_the_step_is_rebuilt_during_fit():
    model = mlp()
    model.compile(optimizer="sgd", loss="mse")
    x, y = data()
    watch = RetraceWatch(max_traces=1)
    with pytest.warns(UserWarning, match=r"traced the train step 2 times.*replaced") as caught:
        history = model.fit(x, y, batch_size=4, epochs=3, verbose=0, callbacks=[Rebuild(), watch])
    assert len([w for w in caught if "RetraceWatch" in str(w.message)]) == 1
    assert history.history["train_traces"] == [1.0, 2.0, 2.0]
    model.compile(optimizer="sgd", loss="mse")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.fit(
            x,
            y,
            batch_size=4,
            epochs=2,
            verbose=0,
            callbacks=[Rebuild(), RetraceWatch(max_traces=2)],
        )


class AskGradNorm(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 1:  # a new key: the train function is rebuilt
            self.model.enable_telemetry(["grad_norm"])
            self.model.make_train_function()


def test_retrace_watch_keeps_no_train_function_alive():
    # On JAX a rebuilt `jax.jit` of the same step reuses the trace of a
    # train function still alive: a watch holding the old one made the
    # rebuilt step run stale (without the key asked for since).
    model = mlp()
    model.compile(optimizer="sgd", loss="mse")
    x, y = data()
    watch = RetraceWatch(max_traces=2)
    history = model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[AskGradNorm(), watch])
    assert history.history["train_traces"] == [1.0, 2.0]
    assert len(history.history["grad_norm"]) == 1  # epoch 1's


class ScriptedTraces(keras_fastgrad.FastGradModel):
    """Adds fake traces at chosen (epoch, batch): Keras 3 `fit` does not
    retrace on shapes (see above), but other loops and backends can."""

    extra, at = 0, ()

    @property
    def train_step_trace_count(self):
        return super().train_step_trace_count + self.extra


class AddTrace(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) in self.model.at:
            self.model.extra += 1


@pytest.mark.parametrize(
    "at, cause",
    [
        ((0, 3), "short last batch.*drop_remainder=True"),
        ((0, 1), "batch 1 of epoch 0 .*mid-epoch.*fixed shapes"),
    ],
)
def test_retrace_watch_tells_the_likely_cause(at, cause):
    inputs = keras.Input((3,))
    model = ScriptedTraces(inputs, keras.layers.Dense(1)(inputs))
    model.at = (at, (1, 2))  # a second retrace: still one warning
    model.compile(optimizer="sgd", loss="mse")
    x, y = data()
    with pytest.warns(UserWarning, match=cause) as caught:
        model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[AddTrace(), RetraceWatch()])
    assert len([w for w in caught if "RetraceWatch" in str(w.message)]) == 1


# ------------------------------------------------------------------ together
@pytest.mark.needs_tensorflow(reason="TensorBoard's event writer")
def test_all_callbacks_under_xla_steps_per_execution_accumulation_clipping(tmp_path):
    model = mlp(accumulation_steps=2, clip_norm=1.0)
    model.compile(optimizer="sgd", loss="mse", jit_compile=True, steps_per_execution=4)
    x, y = data(n=32)
    y = 10 * y  # large gradients: every update is clipped
    callbacks = [
        GradientNormLogger(
            per_layer=True,
            clip_fraction=True,
            update_ratio=True,
            tensorboard_dir=str(tmp_path),
            histogram_freq=1,
            update_freq="batch",
        ),
        NonFiniteGuard("raise"),
        TapeVariableCounter(),
        RetraceWatch(),
        keras.callbacks.CSVLogger(str(tmp_path / "log.csv")),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        history = model.fit(
            x, y, batch_size=4, epochs=2, shuffle=False, verbose=0, callbacks=callbacks
        )
    logs = history.history
    assert logs["updates"] == [4.0, 8.0]  # 8 batches, 2 per update
    assert logs["clipped_fraction"] == [1.0, 1.0]
    assert logs["tape_variables"] == [4.0, 4.0]
    assert logs["train_traces"] == [1.0, 1.0]
    for key in ("grad_norm", "grad_norm/hidden", "grad_norm/out", "update_ratio"):
        assert all(np.isfinite(v) and v > 0 for v in logs[key])
    assert np.hypot(logs["grad_norm/hidden"][-1], logs["grad_norm/out"][-1]) == (
        pytest.approx(logs["grad_norm"][-1], rel=1e-5)
    )
    scalars, _ = read_events(tmp_path / "train")
    assert {"epoch_grad_norm", "batch_clipped_fraction"} <= set(scalars)
    x[9, 1] = np.nan  # batch 2, inside the first group of 4
    with pytest.raises(NonFiniteError, match=r"epoch 0, batches 0-3.*`hidden/kernel`"):
        model.fit(x, y, batch_size=4, shuffle=False, verbose=0, callbacks=callbacks)


# ----------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "make, error, message",
    [
        (
            lambda: NonFiniteGuard(action="x"),
            ValueError,
            "`action` must be one of ['raise', 'stop', 'warn']. Received: action='x'",
        ),
        (
            lambda: NonFiniteGuard(action=None),
            TypeError,
            "`action` must be one of ['raise', 'stop', 'warn']. Received: action=None",
        ),
        (
            lambda: GradientNormLogger(per_layer=1),
            TypeError,
            "`per_layer` must be a boolean (True or False). Received: per_layer=1",
        ),
        (
            lambda: GradientNormLogger(clip_fraction="yes"),
            TypeError,
            "`clip_fraction` must be a boolean",
        ),
        (
            lambda: GradientNormLogger(update_ratio=None),
            TypeError,
            "`update_ratio` must be a boolean",
        ),
        (
            lambda: GradientNormLogger(tensorboard_dir=5),
            TypeError,
            "`tensorboard_dir` must be a directory path (str or path-like) or None. "
            "Received: tensorboard_dir=5",
        ),
        (
            lambda: GradientNormLogger(histogram_freq=-1, tensorboard_dir="x"),
            ValueError,
            "`histogram_freq` must be an integer >= 0",
        ),
        (
            lambda: GradientNormLogger(histogram_freq=1.5, tensorboard_dir="x"),
            TypeError,
            "Received: histogram_freq=1.5 of type float",
        ),
        (
            lambda: GradientNormLogger(histogram_freq=2),
            ValueError,
            "`histogram_freq` needs `tensorboard_dir`",
        ),
        (
            lambda: GradientNormLogger(update_freq="step"),
            ValueError,
            "`update_freq` must be one of ['epoch', 'batch']. Received: update_freq='step'",
        ),
        (
            lambda: GradientNormLogger(update_freq=0),
            ValueError,
            "`update_freq` must be an integer >= 1",
        ),
        (lambda: RetraceWatch(max_traces=0), ValueError, "`max_traces` must be an integer >= 1"),
        (
            lambda: RetraceWatch(max_traces=True),
            TypeError,
            "Received: max_traces=True of type bool",
        ),
        (lambda: RetraceWatch(max_traces="2"), TypeError, "Received: max_traces='2' of type str"),
    ],
)
def test_invalid_arguments_are_refused_at_construction(make, error, message):
    with pytest.raises(error, match=re.escape(message)):
        make()


@pytest.mark.parametrize(
    "callback, key",
    [
        (GradientNormLogger, "grad_norm"),
        (NonFiniteGuard, "nonfinite_count"),
        (TapeVariableCounter, "tape_variables"),
        (RetraceWatch, "train_traces"),
    ],
)
def test_each_callback_measures_the_fit_of_a_plain_keras_model(callback, key):
    # The fit gets the measuring step; the model is plain again afterwards.
    model = mlp(cls=keras.Model)
    model.compile(optimizer="sgd", loss="mse")
    x, y = data()
    history = model.fit(x, y, verbose=0, callbacks=[callback()])
    assert key in history.history
    assert not isinstance(model, keras_fastgrad.FastGradModel)


def test_clip_fraction_needs_a_clipping_model():
    model = mlp()
    model.compile(optimizer="sgd", loss="mse")
    x, y = data()
    with pytest.raises(
        ValueError,
        match=re.escape(
            "`clip_fraction=True` needs a model that clips, but the model has "
            "clip_norm=None. Fix: build it with `FastGradModel(..., clip_norm=...)`"
        ),
    ):
        model.fit(x, y, verbose=0, callbacks=[GradientNormLogger(clip_fraction=True)])
    plain = mlp(cls=keras.Model)
    plain.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="needs a model that clips"):
        plain.fit(x, y, verbose=0, callbacks=[GradientNormLogger(clip_fraction=True)])
    assert type(plain) is type(mlp(cls=keras.Model))  # refused: left as it was


def test_retrace_watch_warns_about_xla_recompiles_on_a_short_last_batch():
    # 10 samples in batches of 4: the last batch has 2 rows. Keras 3 on
    # TensorFlow does not retrace, but XLA compiles the step for the new
    # shape; on JAX, `jax.jit` traces (and compiles) it again: the trace
    # count says so.
    x, y = (
        np.random.default_rng(0).normal(size=(10, 3)).astype("float32"),
        np.zeros((10, 1), "float32"),
    )
    inputs = keras.Input((3,))
    model = keras_fastgrad.FastGradModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    warning = r"input shape changed at batch 2 of epoch 0.*drop_remainder=True"
    if ON_JAX:
        warning = r"traced the train step 2 times.*last batch of epoch 0.*drop_remainder=True"
    with pytest.warns(UserWarning, match=warning) as caught:
        history = model.fit(x, y, batch_size=4, verbose=0, callbacks=[RetraceWatch()])
    assert len([w for w in caught if "RetraceWatch" in str(w.message)]) == 1
    assert history.history["input_shape_changes"] == [1.0]


def test_retrace_watch_is_quiet_with_fixed_shapes_under_xla():
    import warnings as _warnings

    x, y = np.ones((8, 3), "float32"), np.zeros((8, 1), "float32")
    inputs = keras.Input((3,))
    model = keras_fastgrad.FastGradModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    with _warnings.catch_warnings():
        _warnings.simplefilter("error", UserWarning)
        model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[RetraceWatch()])


@pytest.mark.needs_tensorflow(reason="TensorBoard's event writer")
def test_tensorboard_gets_the_task_keys_of_a_multitask_model(tmp_path):
    keras.utils.set_random_seed(7)
    inputs = keras.Input((3,))
    trunk = keras.layers.Dense(4, activation="tanh", name="trunk")(inputs)
    heads = {t: keras.layers.Dense(1, name=t)(trunk) for t in ("a", "b")}
    model = keras_fastgrad.FastGradModel(inputs, heads, multitask="pcgrad")
    model.compile(optimizer="sgd", loss={"a": "mse", "b": "mse"})
    x, _ = data(n=8)
    y = {"a": np.ones((8, 1), "float32"), "b": -3 * np.ones((8, 1), "float32")}
    history = model.fit(
        x,
        y,
        batch_size=4,
        epochs=2,
        verbose=0,
        callbacks=[GradientNormLogger(tensorboard_dir=str(tmp_path))],
    )
    scalars, _ = read_events(tmp_path / "train")
    for key in (
        "task_grad_norm/a",
        "task_grad_norm/b",
        "task_cosine/a/b",
        "task_conflicts",
        "grad_norm",
    ):
        assert key in history.history, key
        np.testing.assert_allclose(
            [scalars["epoch_" + key][e] for e in (0, 1)],
            history.history[key],
            rtol=1e-6,
        )


# ------------------------------------------- a plain model's fit that raises
@keras.saving.register_keras_serializable(package="test_callbacks")
class Subclassed(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(4, activation="tanh")
        self.out = keras.layers.Dense(1)

    def call(self, x):
        return self.out(self.hidden(x))


def test_an_unbuilt_subclassed_model_trains_with_the_callbacks_as_keras():
    # Unbuilt when `fit` starts: without a strategy Keras' TensorFlow `fit`
    # builds it only in the first trace, after the callbacks attached the
    # step; the step builds it (and its optimizer) from the first call's data.
    def build():
        keras.utils.set_random_seed(3)
        model = Subclassed()
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
        return model

    x, y = data()
    model, reference = build(), build()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "no trainable weights"
        history = model.fit(
            x,
            y,
            batch_size=4,
            verbose=0,
            shuffle=False,
            callbacks=[GradientNormLogger(), NonFiniteGuard("warn"), TapeVariableCounter()],
        )
    reference.fit(x, y, batch_size=4, verbose=0, shuffle=False)
    assert type(model) is Subclassed
    for a, b in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert history.history["tape_variables"] == [4.0]
    assert history.history["trainable_variables"] == [4.0]
    assert history.history["grad_norm"][0] > 0
    model.fit(x, y, batch_size=4, verbose=0, shuffle=False)  # Keras' own step again
    reference.fit(x, y, batch_size=4, verbose=0, shuffle=False)
    for a, b in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def _plain(kind):
    keras.utils.set_random_seed(3)
    if kind == "functional":
        return mlp(cls=keras.Model), data()
    if kind == "sequential":
        return keras.Sequential(
            [keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(1)]
        ), data()
    if kind == "subclassed":
        model = Subclassed()
        model(data()[0][:1])  # built: its weights exist before `fit`
        return model, data()
    inputs = keras.Input((5,), dtype="int32")  # embedding
    h = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(10, 3)(inputs))
    x = np.random.default_rng(0).integers(0, 10, size=(16, 5)).astype("int32")
    return keras.Model(inputs, keras.layers.Dense(1)(h)), (x, data()[1])


class Raises(keras.callbacks.Callback):
    def __init__(self, hook, error):
        super().__init__()
        self.error = error
        setattr(self, hook, self._raise)

    def _raise(self, *args, **kwargs):
        raise self.error


def _failing_generator(x, y, error):
    for i in range(0, len(x), 4):
        if i == 8:
            raise error
        yield x[i : i + 4], y[i : i + 4]


FAILURES = {
    "on_epoch_end": lambda model, x, y: model.fit(
        x,
        y,
        batch_size=4,
        epochs=2,
        verbose=0,
        callbacks=[GradientNormLogger(), Raises("on_epoch_end", RuntimeError("boom"))],
    ),
    "on_train_batch_end": lambda model, x, y: model.fit(
        x,
        y,
        batch_size=4,
        verbose=0,
        callbacks=[GradientNormLogger(), Raises("on_train_batch_end", KeyboardInterrupt())],
    ),
    "in_the_train_function": lambda model, x, y: model.fit(
        _failing_generator(x, y, KeyboardInterrupt()),
        steps_per_epoch=4,
        verbose=0,
        callbacks=[GradientNormLogger()],
    ),
}


@pytest.mark.parametrize("where", sorted(FAILURES))
@pytest.mark.parametrize("kind", ["functional", "sequential", "subclassed", "embedding"])
def test_a_fit_that_raises_leaves_a_plain_model(kind, where, tmp_path):
    model, (x, y) = _plain(kind)
    model.compile(optimizer="sgd", loss="mse")
    original, config = type(model), model.get_config()
    with pytest.raises(BaseException):
        FAILURES[where](model, x, y)
    assert type(model) is original
    assert not isinstance(model, keras_fastgrad.FastGradModel)
    assert not hasattr(model, "fastgrad_step_state") and not hasattr(model, "clip_norm")
    assert model.get_config() == config
    # Saved as a plain model saves: loads as the same class, and its weights
    # file loads into a fresh plain model of the same architecture.
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    assert type(loaded).__name__ == original.__name__
    assert not isinstance(loaded, keras_fastgrad.FastGradModel)
    model.save_weights(tmp_path / "m.weights.h5")
    fresh, _ = _plain(kind)
    fresh.load_weights(tmp_path / "m.weights.h5")
    for a, b in zip(fresh.weights, model.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    # A later fit without the callbacks is Keras' own (no step keys); one
    # with them measures again and leaves the model plain.
    assert "grad_norm" not in model.fit(x, y, batch_size=4, verbose=0).history
    assert set(model.train_on_batch(x[:4], y[:4], return_dict=True)) == {"loss"}
    history = model.fit(x, y, batch_size=4, verbose=0, callbacks=[GradientNormLogger()])
    assert "grad_norm" in history.history and type(model) is original


def test_after_a_fit_that_raised_training_equals_keras_model():
    # The same failing fit with a plain callback only, then the same fits.
    results = []
    for callbacks in ([GradientNormLogger()], []):
        model, (x, y) = _plain("functional")
        model.compile(optimizer="sgd", loss="mse")
        with pytest.raises(RuntimeError):
            model.fit(
                x,
                y,
                batch_size=4,
                epochs=2,
                verbose=0,
                shuffle=False,
                callbacks=callbacks + [Raises("on_epoch_end", RuntimeError("boom"))],
            )
        history = model.fit(x, y, batch_size=4, epochs=2, verbose=0, shuffle=False)
        results.append((history.history, [w.numpy() for w in model.weights]))
    assert results[0][0] == results[1][0]
    for a, b in zip(results[0][1], results[1][1]):
        np.testing.assert_array_equal(a, b)


def test_a_train_step_replaced_on_the_instance_is_refused():
    model = mlp(cls=keras.Model)
    model.compile(optimizer="sgd", loss="mse")

    def my_step(data):
        return keras.Model.train_step(model, data)

    model.train_step = my_step
    x, y = data()
    with pytest.raises(
        ValueError,
        match=r"`model.train_step` is replaced on the instance.*Fix: `del model.train_step`",
    ):
        model.fit(x, y, verbose=0, callbacks=[GradientNormLogger()])
    assert type(model) is type(mlp(cls=keras.Model)) and vars(model)["train_step"] is my_step
    with pytest.raises(ValueError, match=r"`model.train_step` is replaced on the instance"):
        keras_fastgrad.fastgrad(model)
    assert not isinstance(model, keras_fastgrad.FastGradModel)


def test_fastgrad_after_a_fit_that_raised_gets_its_own_step():
    model, (x, y) = _plain("functional")
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(RuntimeError):
        FAILURES["on_epoch_end"](model, x, y)
    before = int(model.optimizer.iterations.numpy())
    model = keras_fastgrad.fastgrad(model, accumulation_steps=2)
    model.fit(x, y, batch_size=4, verbose=0)  # 4 batches, 2 per update
    assert int(model.optimizer.iterations.numpy()) - before == 2


def test_an_evaluate_that_raised_does_not_keep_the_step_after_the_next_fit():
    model, (x, y) = _plain("functional")
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(RuntimeError):
        model.evaluate(
            x,
            y,
            verbose=0,
            callbacks=[GradientNormLogger(), Raises("on_test_begin", RuntimeError("boom"))],
        )
    history = model.fit(x, y, verbose=0, callbacks=[GradientNormLogger(), NonFiniteGuard()])
    assert "grad_norm" in history.history
    assert vars(model).get("make_train_function") is None  # detached at its end
    assert "grad_norm" not in model.fit(x, y, verbose=0).history


def test_adaptive_fraction_needs_an_adaptively_clipping_model():
    model = mlp()
    model.compile(optimizer="sgd", loss="mse")
    x, y = data()
    with pytest.raises(
        ValueError,
        match=re.escape(
            "`adaptive_fraction=True` needs a model that clips adaptively, but "
            "the model has clip_adaptive=None. Fix: build it with "
            "`FastGradModel(..., clip_adaptive=...)`"
        ),
    ):
        model.fit(x, y, verbose=0, callbacks=[GradientNormLogger(adaptive_fraction=True)])
    with pytest.raises(TypeError, match="`adaptive_fraction` must be a boolean"):
        GradientNormLogger(adaptive_fraction="yes")
