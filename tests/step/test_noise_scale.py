"""The gradient noise scale (`keras_fastgrad.step.noise_scale`, the
`GradientNoiseScale` callback) against references not written by the same
reasoning: closed-form values of a linear regression with Gaussian noise,
and the paper's estimators on plain `keras.Model` gradients of the same
micro-batches (`gns_reference.py`)."""

import os

import keras
import numpy as np
import pytest

import keras_fastgrad
from keras_fastgrad.callbacks import GradientNoiseScale
from keras_fastgrad.callbacks.gradient_noise_scale import describe
from tests.step import gns_reference as ref

FEATURES, NOISE_VARIANCE = 8, 3.0
_MICRO_BATCHES_ON_TF = pytest.mark.tensorflow_only(
    reason="JAX measures the noise scale on accumulation windows only "
    "(`micro_batches` slices are refused there, naming the fix)"
)


def _linear_regression(rows, seed=0):
    """`y = x . w* + noise` and a start `w0 = w* + delta`, `|delta| = 1`.

    For `x ~ N(0, I_d)`, noise variance `v` and the MSE loss, the
    per-sample gradient at `w0` is `2 (x . delta - noise) x`: its mean is
    `G = 2 delta` and its covariance `4 (|delta|^2 + v) I + 4 delta
    delta^T` (Isserlis), so `|G|^2 = 4`, `tr(Sigma) = 4 (d (1 + v) + 1)`
    and `B_simple = d (1 + v) + 1` (33 here)."""
    rng = np.random.default_rng(seed)
    w_star = rng.normal(size=(FEATURES, 1))
    delta = rng.normal(size=(FEATURES, 1))
    delta /= np.linalg.norm(delta)
    x = rng.normal(size=(rows, FEATURES)).astype("float32")
    noise = np.sqrt(NOISE_VARIANCE) * rng.normal(size=(rows, 1))
    y = (x @ w_star + noise).astype("float32")
    return x, y, w_star + delta


def _frozen_linear_model(w0, **options):
    inputs = keras.Input((FEATURES,))
    layer = keras.layers.Dense(1, use_bias=False)
    model = keras_fastgrad.FastGradModel(inputs, layer(inputs), **options)
    layer.kernel.assign(w0)
    # w stays w0; many steps per call: the EMA lives in variables
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", steps_per_execution=50)
    return model


@pytest.mark.parametrize(
    "options, batch_size",
    [
        pytest.param({"micro_batches": 4}, 62, marks=_MICRO_BATCHES_ON_TF),
        ({"accumulation_steps": 4}, 16),
    ],
    ids=["micro_batches_uneven_slices", "accumulation"],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_recovers_the_closed_form_noise_scale_of_a_linear_regression(options, batch_size, seed):
    windows = 1500  # the EMA (decay 0.998) averages about the last 500
    window_rows = batch_size * options.get("accumulation_steps", 1)
    x, y, w0 = _linear_regression(rows=windows * window_rows, seed=seed)
    model = _frozen_linear_model(w0, **options)
    history = model.fit(
        x,
        y,
        batch_size=batch_size,
        verbose=0,
        shuffle=False,
        callbacks=[GradientNoiseScale(decay=0.998, verbose=0)],
    )
    expected_b = FEATURES * (1 + NOISE_VARIANCE) + 1.0
    expected_trace = 4.0 * expected_b
    logs = history.history
    assert logs["gns_simple"][-1] == pytest.approx(expected_b, rel=0.10)
    assert logs["gns_grad_sq"][-1] == pytest.approx(4.0, rel=0.10)
    assert logs["gns_trace"][-1] == pytest.approx(expected_trace, rel=0.10)


def _mlp():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(7, activation="tanh")(inputs)
    return inputs, keras.layers.Dense(2)(hidden)


def _conv():
    keras.utils.set_random_seed(4)
    inputs = keras.Input((6, 6, 2))
    h = keras.layers.Conv2D(3, 3, activation="relu")(inputs)
    h = keras.layers.Flatten()(h)
    return inputs, keras.layers.Dense(3)(h)


def _embedding():
    keras.utils.set_random_seed(5)
    inputs = keras.Input((4,), dtype="int32")
    h = keras.layers.Embedding(20, 3)(inputs)  # sparse gradients
    h = keras.layers.GlobalAveragePooling1D()(h)
    return inputs, keras.layers.Dense(2)(h)


def _data(kind, rows, seed=1):
    rng = np.random.default_rng(seed)
    if kind == "mlp":
        return rng.normal(size=(rows, 5)).astype("float32"), rng.normal(size=(rows, 2)).astype(
            "float32"
        )
    if kind == "conv":
        x = rng.normal(size=(rows, 6, 6, 2)).astype("float32")
        return x, rng.integers(0, 3, size=(rows,))
    x = rng.integers(0, 20, size=(rows, 4)).astype("int32")
    return x, rng.normal(size=(rows, 2)).astype("float32")


_BUILDERS = {"mlp": _mlp, "conv": _conv, "embedding": _embedding}
_LOSSES = {
    "mlp": keras.losses.MeanSquaredError,
    "conv": lambda: keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    "embedding": keras.losses.MeanSquaredError,
}

# (model, options, rows, batch_size, the windows' small-batch sizes)
_CASES = {
    # two windows of 3 x 8, then the epoch's partial window: 8 + 5 rows
    "mlp_accumulation_partial_window": (
        "mlp",
        {"accumulation_steps": 3},
        61,
        8,
        [[8, 8, 8], [8, 8, 8], [8, 5]],
    ),
    # slices of ceil(30 / 4) = 8 rows: 8, 8, 8, 6
    "conv_micro_batches_uneven": (
        "conv",
        {"micro_batches": 4},
        60,
        30,
        [[8, 8, 8, 6], [8, 8, 8, 6]],
    ),
    # windows of 2 batches of 12, each in 2 slices of 6; sparse gradients
    "embedding_accumulation_and_slices": (
        "embedding",
        {"accumulation_steps": 2, "micro_batches": 2},
        48,
        12,
        [[6] * 4] * 2,
    ),
    "mlp_xla_steps_per_execution": (
        "mlp",
        {"micro_batches": 2},
        40,
        8,
        [[4, 4]] * 5,
    ),
    # the gradients the estimate reads are unscaled (loss scale 2**15)
    "mlp_loss_scaled": ("mlp", {"accumulation_steps": 2}, 32, 8, [[8, 8], [8, 8]]),
}


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, marks=_MICRO_BATCHES_ON_TF) if "micro_batches" in _CASES[c][1] else c
        for c in sorted(_CASES)
    ],
)
def test_equals_the_paper_estimators_on_plain_keras_gradients(case):
    kind, options, rows, batch_size, windows = _CASES[case]
    x, y = _data(kind, rows)
    inputs, outputs = _BUILDERS[kind]()
    plain = keras.Model(inputs, outputs)
    model = keras_fastgrad.FastGradModel(inputs, outputs, **options)
    compile_kwargs = {}
    if case.endswith("steps_per_execution"):
        compile_kwargs = {"jit_compile": True, "steps_per_execution": 3}
    optimizer = keras.optimizers.SGD(0.0)
    if case.endswith("loss_scaled"):
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    model.compile(optimizer=optimizer, loss=_LOSSES[kind](), **compile_kwargs)
    decay = 0.6
    history = model.fit(
        x,
        y,
        batch_size=batch_size,
        verbose=0,
        shuffle=False,
        callbacks=[GradientNoiseScale(decay=decay, verbose=0)],
    )
    small, start = [], 0
    for window in windows:
        small.append(ref.split(x[start:], y[start:], window))
        start += sum(window)
    assert start == rows
    slices = options.get("micro_batches", 1)  # the first slice of each batch is measured
    b_simple, grad_sq, trace = ref.noise_scale(
        plain, _LOSSES[kind](), small, decay, measured=lambda j: j % slices == 0
    )
    logs = {k: v[-1] for k, v in history.history.items()}
    assert logs["gns_grad_sq"] == pytest.approx(grad_sq, rel=2e-3)
    assert logs["gns_trace"] == pytest.approx(trace, rel=2e-3)
    assert logs["gns_simple"] == pytest.approx(b_simple, rel=2e-3)


def test_a_dropped_nonfinite_micro_batch_is_left_out_of_the_estimate():
    x, y = _data("mlp", 48)
    x[8:16] = np.nan  # the first window's second micro-batch
    inputs, outputs = _mlp()
    plain = keras.Model(inputs, outputs)
    model = keras_fastgrad.FastGradModel(inputs, outputs, accumulation_steps=3, skip_nonfinite=True)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    history = model.fit(
        x,
        y,
        batch_size=8,
        verbose=0,
        shuffle=False,
        callbacks=[GradientNoiseScale(decay=0.6, verbose=0)],
    )
    assert model.telemetry_counters()["nonfinite_count"] == 1.0
    windows = [
        [(x[0:8], y[0:8]), (x[16:24], y[16:24])],
        ref.split(x[24:], y[24:], [8, 8, 8]),
    ]
    expected = ref.noise_scale(plain, keras.losses.MeanSquaredError(), windows, 0.6)
    logs = [history.history[k][-1] for k in ("gns_simple", "gns_grad_sq", "gns_trace")]
    assert logs == pytest.approx(list(expected), rel=2e-3)


# ------------------------------------------------------------- refusals
def _plain_mlp():
    inputs, outputs = _mlp()
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="sgd", loss="mse")
    return model


def test_refuses_a_model_that_holds_one_batch_size_naming_the_fix():
    x, y = _data("mlp", 16)
    for model in (_plain_mlp(), keras_fastgrad.FastGradModel(*_mlp())):
        model.compile(optimizer="sgd", loss="mse")
        # (JAX's names `accumulation_steps>=2` alone: its only way)
        with pytest.raises(ValueError, match=r"accumulation_steps>=2"):
            model.fit(x, y, verbose=0, callbacks=[GradientNoiseScale(verbose=0)])
    assert not isinstance(model, type(None))


def test_a_plain_keras_model_is_measured_through_fastgrad():
    x, y = _data("mlp", 32)
    model = keras_fastgrad.fastgrad(_plain_mlp(), accumulation_steps=2)
    history = model.fit(x, y, batch_size=8, verbose=0, callbacks=[GradientNoiseScale(verbose=0)])
    assert np.isfinite(history.history["gns_simple"][-1])


@pytest.mark.parametrize("decay", [0.0, 1.0, 1.5, -0.1, "0.9", True])
def test_decay_is_validated(decay):
    with pytest.raises(
        ValueError, match=rf"`decay` must be a number > 0.0 .*Received: decay={decay!r}"
    ):
        GradientNoiseScale(decay=decay)


def test_refuses_sample_weights_at_trace_time():
    x, y = _data("mlp", 16)
    model = keras_fastgrad.FastGradModel(*_mlp(), accumulation_steps=2)
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="cannot be measured with sample weights"):
        model.fit(x, y, sample_weight=np.ones(16), verbose=0, callbacks=[GradientNoiseScale()])


def test_refuses_a_sum_reduction_at_trace_time():
    x, y = _data("mlp", 16)
    model = keras_fastgrad.FastGradModel(*_mlp(), accumulation_steps=2)
    model.compile(optimizer="sgd", loss=keras.losses.MeanSquaredError(reduction="sum"))
    with pytest.raises(ValueError, match='reduction="sum"'):
        model.fit(x, y, batch_size=4, verbose=0, callbacks=[GradientNoiseScale()])


def test_refuses_a_multitask_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    outputs = {
        "a": keras.layers.Dense(1, name="a")(inputs),
        "b": keras.layers.Dense(1, name="b")(inputs),
    }
    model = keras_fastgrad.FastGradModel(inputs, outputs, multitask="pcgrad", accumulation_steps=2)
    model.compile(optimizer="sgd", loss={"a": "mse", "b": "mse"})
    x = np.ones((8, 3), "float32")
    with pytest.raises(ValueError, match="multi-task model"):
        model.fit(x, {"a": x[:, :1], "b": x[:, :1]}, verbose=0, callbacks=[GradientNoiseScale()])


# ---------------------------------------------- telemetry, saving, output
def test_telemetry_true_includes_the_keys_only_where_measurable():
    x, y = _data("mlp", 16)
    keys = {}
    for name, options in (("one_batch", {}), ("accumulation", {"accumulation_steps": 2})):
        model = keras_fastgrad.FastGradModel(*_mlp(), telemetry=True, **options)
        model.compile(optimizer="sgd", loss="mse")
        keys[name] = {
            k for k in model.fit(x, y, batch_size=4, verbose=0).history if k.startswith("gns")
        }
    assert keys == {"one_batch": set(), "accumulation": {"gns_simple", "gns_grad_sq", "gns_trace"}}


def test_state_round_trips_through_keras_files_and_older_files_load(tmp_path):
    x, y = _data("mlp", 32)
    model = keras_fastgrad.FastGradModel(*_mlp(), accumulation_steps=2, telemetry=True)
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=4, verbose=0)
    noise = model.fastgrad_step_state.noise_scale
    saved = [v.numpy() for v in noise.variables]
    assert saved[1] != 0.0  # an EMA has moved
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    restored = [v.numpy() for v in loaded.fastgrad_step_state.noise_scale.variables]
    for a, b in zip(saved, restored):
        np.testing.assert_array_equal(a, b)
    # a file saved without the noise scale loads into a model that measures it
    old = keras_fastgrad.FastGradModel(*_mlp(), accumulation_steps=2)
    old.compile(optimizer="sgd", loss="mse")
    old.fit(x, y, batch_size=4, verbose=0)
    old_path = str(tmp_path / "old.keras")
    old.save(old_path)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "starts fresh" warning
        fresh = keras.models.load_model(old_path)
    assert fresh.fastgrad_step_state.noise_scale is None
    # and a file saved with it loads into a model that does not measure it
    new = keras_fastgrad.FastGradModel(*_mlp(), accumulation_steps=2)
    new.compile(optimizer="sgd", loss="mse")
    new.fit(x, y, batch_size=4, verbose=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new.load_weights(path)
    np.testing.assert_array_equal(new.get_weights()[0], model.get_weights()[0])


@pytest.mark.needs_tensorflow(reason="TensorBoard's event writer")
def test_prints_in_words_and_writes_tensorboard_scalars(tmp_path, capsys):
    import tensorflow as tf

    x, y = _data("mlp", 32)
    model = keras_fastgrad.FastGradModel(*_mlp(), accumulation_steps=2)
    model.compile(optimizer="sgd", loss="mse")
    gns = GradientNoiseScale(tensorboard_dir=str(tmp_path))
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[gns])
    out = capsys.readouterr().out
    assert out.count("gradient noise scale B_simple ~") == 2
    assert gns.b_simple == history.history["gns_simple"][-1]
    tags = set()
    for name in os.listdir(tmp_path / "train"):
        for event in tf.compat.v1.train.summary_iterator(str(tmp_path / "train" / name)):
            tags |= {v.tag for v in event.summary.value}
    assert tags == {"epoch_gns_simple", "epoch_gns_grad_sq", "epoch_gns_trace"}


def test_describe_says_when_nothing_is_measured_yet():
    assert "not measured yet" in describe(float("nan"))
    assert "not yet reliable" in describe(-3.0)


# ------------------------------------------------------- MirroredStrategy
# gns_mirrored.py, run with every MirroredStrategy case in one process by
# end_to_end/test_distributed.py.


def test_keys_requested_directly_on_a_model_with_one_batch_size_are_refused():
    x, y = _data("mlp", 16)
    model = keras_fastgrad.FastGradModel(*_mlp())
    model.compile(optimizer="sgd", loss="mse")
    model.enable_telemetry(["gns_simple"])
    with pytest.raises(ValueError, match=r"Received: accumulation_steps=1, micro_batches=1"):
        model.fit(x, y, verbose=0)


# ---------------------------------------------- the core's rules, on values
# (`keras_fastgrad.step.noise_scale`, no backend: both backends run these)


def test_one_window_of_the_core_gives_the_papers_estimates():
    """Equal small batches, the big one their mean: after one window the
    bias-corrected EMAs are the window's estimates, the paper's pair
    (`gns_reference.paper_estimates`, transcribed from the paper)."""
    from keras_fastgrad.step import noise_scale as core

    rng = np.random.default_rng(0)
    small = [rng.normal(size=6).astype("float32") for _ in range(4)]
    rows, d = 8.0, 1.0
    big = np.mean(small, axis=0)
    window = keras.ops.zeros([core.MEASURES])
    for g in small:
        measures = core.small_batch(core.squared_norm([g, None]), rows, d)
        window = window + core.included(measures, True)
    skipped = core.small_batch(core.squared_norm([small[0] * 100]), rows, d)
    window = window + core.included(skipped, False)  # a dropped micro-batch: nothing
    zero = keras.ops.zeros(())
    state = core.Estimates(window, zero, zero, zero, keras.ops.array(0.9))
    after = core.after_window(state, core.squared_norm([big]))
    logs = core.logs(after.ema_grad_sq, after.ema_trace, after.ema_weight)
    small_sq = [float(np.sum(g.astype(np.float64) ** 2)) for g in small]
    big_sq = float(np.sum(big.astype(np.float64) ** 2))
    grad_sq, trace = ref.paper_estimates(small_sq, [rows] * 4, big_sq, 4 * rows)
    np.testing.assert_allclose(float(logs["gns_grad_sq"]), grad_sq, rtol=1e-4)
    np.testing.assert_allclose(float(logs["gns_trace"]), trace, rtol=1e-4)
    np.testing.assert_allclose(float(logs["gns_simple"]), trace / grad_sq, rtol=1e-4)
    assert not np.any(keras.ops.convert_to_numpy(after.window))
    # not `done`: nothing moves
    held = core.after_window(state, core.squared_norm([big]), done=keras.ops.array(False))
    for before, now in zip(state, held):
        np.testing.assert_array_equal(np.asarray(before), np.asarray(now))


def test_the_core_measures_only_the_first_slice():
    from keras_fastgrad.step import noise_scale as core

    def cond(pred, true_fn, false_fn):  # a Python conditional
        return true_fn() if pred else false_fn()

    measure, zeros = core.slice_measure(cond)
    g = [np.array([6.0, 8.0], "float32")]
    first = measure(g, 4.0, 2.0, 0)
    later = measure(g, 4.0, 2.0, 1)
    assert [float(v) for v in first] == [25.0, 0.25, 1.0, 1.0, 2.0]  # |(6, 8) / 2|^2, ...
    assert [float(v) for v in later] == [0.0, 0.0, 0.0, 1.0, 2.0]  # its weight only
    assert [float(v) for v in zeros] == [0.0] * 5
    assert core.squared_norm([None]) is None
