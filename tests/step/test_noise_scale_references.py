"""The gradient noise scale (`GradientNoiseScale`, the `gns_*` keys), on
either backend, against references not written by the same reasoning: the
closed form of a linear regression with Gaussian noise, and the paper's
estimators (equal-batch form, harmonic mean for uneven batches) on numpy
gradients of a linear model. (The same keys on TensorFlow and JAX, for the
same data: `tests/callbacks/test_telemetry_jax.py`.)"""

import keras
import numpy as np
import pytest

import keras_fastgrad as kf
from keras_fastgrad.callbacks import GradientNoiseScale

FEATURES, NOISE_VARIANCE = 8, 3.0
KEYS = ("gns_simple", "gns_grad_sq", "gns_trace")


def _linear(d_in, d_out, weights, use_bias=True, **options):
    inputs = keras.Input((d_in,))
    layer = keras.layers.Dense(d_out, use_bias=use_bias)
    model = kf.FastGradModel(inputs, layer(inputs), **options)
    layer.set_weights(weights)
    return model


def test_recovers_the_closed_form_noise_scale_of_a_linear_regression():
    """`y = x . w* + noise`, `x ~ N(0, I_8)`, noise variance 3, from
    `w0 = w* + delta` (`|delta| = 1`), MSE: the per-sample gradient's mean
    is `2 delta` and its covariance `4 (1 + v) I + 4 delta delta^T`, so
    `|G|^2 = 4`, `tr(Sigma) = 4 (8 (1 + v) + 1)`, `B_simple = 33`."""
    rng = np.random.default_rng(0)
    w_star = rng.normal(size=(FEATURES, 1))
    delta = rng.normal(size=(FEATURES, 1))
    delta /= np.linalg.norm(delta)
    windows, batch_size, steps = 1200, 16, 4
    rows = windows * batch_size * steps
    x = rng.normal(size=(rows, FEATURES)).astype("float32")
    y = (x @ w_star + np.sqrt(NOISE_VARIANCE) * rng.normal(size=(rows, 1))).astype("float32")
    model = _linear(FEATURES, 1, [w_star + delta], use_bias=False, accumulation_steps=steps)
    model.compile(keras.optimizers.SGD(0.0), "mse", steps_per_execution=100)
    gns = GradientNoiseScale(decay=0.998, verbose=0)
    history = model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0, callbacks=[gns])
    expected_b = FEATURES * (1 + NOISE_VARIANCE) + 1.0
    logs = {k: history.history[k][-1] for k in KEYS}
    assert logs["gns_simple"] == pytest.approx(expected_b, rel=0.10)
    assert logs["gns_grad_sq"] == pytest.approx(4.0, rel=0.10)
    assert logs["gns_trace"] == pytest.approx(4.0 * expected_b, rel=0.10)
    assert gns.b_simple == logs["gns_simple"]


def _squared_gradient_norm(weights, x, y):
    """`|grad of mean((x W + b - y)^2)|^2`, by hand (float64)."""
    kernel, bias = (np.asarray(w, np.float64) for w in weights)
    residual = x.astype(np.float64) @ kernel + bias - y
    scale = 2.0 / residual.size
    return np.sum((scale * x.T @ residual) ** 2) + np.sum((scale * residual.sum(0)) ** 2)


def _paper_noise_scale(weights, windows, decay):
    """The paper's `(B_simple, |G|^2, tr(Sigma))` after the windows (each a
    list of small batches `(x, y)`), EMAs bias-corrected."""
    ema_g = ema_s = weight = 0.0
    for window in windows:
        small = np.mean([_squared_gradient_norm(weights, x, y) for x, y in window])
        b_small = 1.0 / np.mean([1.0 / len(x) for x, _ in window])
        big_x = np.concatenate([x for x, _ in window])
        big_y = np.concatenate([y for _, y in window])
        big = _squared_gradient_norm(weights, big_x, big_y)
        b_big = len(big_x)
        grad_sq = (b_big * big - b_small * small) / (b_big - b_small)
        trace = (small - big) / (1.0 / b_small - 1.0 / b_big)
        ema_g = decay * ema_g + (1 - decay) * grad_sq
        ema_s = decay * ema_s + (1 - decay) * trace
        weight = decay * weight + (1 - decay)
    return ema_s / ema_g, ema_g / weight, ema_s / weight


def _batches(x, y, bounds):
    return [(x[a:b], y[a:b]) for a, b in bounds]


# (FastGradModel options, compile options, the windows' batches as row ranges)
_CASES = {
    # windows [8, 8, 8] x 2, then the epoch's partial window [8, 5] (flushed);
    # on JAX a micro-batch is a small batch whole, its `micro_batches` slices
    # are not measured apart
    "partial_window_micro_batches": ({"accumulation_steps": 3, "micro_batches": 2}, {}, [[(0, 8), (8, 16), (16, 24)],
                                                      [(24, 32), (32, 40), (40, 48)],
                                                      [(48, 56), (56, 61)]]),
    # a NaN micro-batch (rows 8-16) left out of the window and the estimate
    "nonfinite_left_out": ({"accumulation_steps": 3}, {},
                           [[(0, 8), (16, 24)], [(24, 32), (32, 40), (40, 48)],
                            [(48, 56), (56, 61)]]),
    # the gradients the estimate reads are unscaled (loss scale 2**15)
    "loss_scaled": ({"accumulation_steps": 2}, {"steps_per_execution": 3},
                    [[(0, 8), (8, 16)], [(16, 24), (24, 32)], [(32, 40), (40, 48)],
                     [(48, 56), (56, 61)]]),
}  # fmt: skip


# JAX measures a micro-batch whole; TensorFlow measures the slices of
# `micro_batches` (tests/step/test_noise_scale.py).
_JAX_ONLY_CASES = {"partial_window_micro_batches"}


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(
            case,
            marks=[pytest.mark.jax_only(reason="JAX measures a micro-batch whole, unsliced")]
            if case in _JAX_ONLY_CASES
            else [],
        )
        for case in sorted(_CASES)
    ],
)
def test_equals_the_paper_estimators_on_numpy_gradients(case):
    options, compile_kw, bounds = _CASES[case]
    rng = np.random.default_rng(1)
    x = rng.normal(size=(61, 5)).astype("float32")
    y = rng.normal(size=(61, 2)).astype("float32")
    weights = [rng.normal(size=(5, 2)).astype("float32"), rng.normal(size=2).astype("float32")]
    model = _linear(5, 2, weights, **options)
    optimizer = keras.optimizers.SGD(0.0)
    if case == "loss_scaled":
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    model.compile(optimizer, "mse", **compile_kw)
    x_fit = x.copy()
    if case == "nonfinite_left_out":
        x_fit[8:16] = np.nan
    decay = 0.6
    history = model.fit(
        x_fit,
        y,
        batch_size=8,
        shuffle=False,
        verbose=0,
        callbacks=[GradientNoiseScale(decay=decay, verbose=0)],
    )
    windows = [_batches(x, y, window) for window in bounds]
    expected = _paper_noise_scale(weights, windows, decay)
    logs = [history.history[k][-1] for k in KEYS]
    np.testing.assert_allclose(logs, expected, rtol=2e-3)
    if case == "nonfinite_left_out":
        assert model.telemetry_counters()["nonfinite_count"] == 1.0


def test_telemetry_true_adds_the_keys_where_two_batch_sizes_are_seen():
    # `micro_batches` alone: measured on TensorFlow (its slices), not on JAX
    # (a micro-batch is measured whole)
    x = np.random.default_rng(2).normal(size=(32, 5)).astype("float32")
    y = x[:, :2] * 2.0
    keys = {}
    for name, options in (
        ("slices", {"micro_batches": 2}),
        ("accumulation", {"accumulation_steps": 2}),
    ):
        model = _linear(5, 2, [np.ones((5, 2)), np.zeros(2)], telemetry=True, **options)
        model.compile(keras.optimizers.SGD(0.01), "mse")
        history = model.fit(x, y, batch_size=4, verbose=0)
        keys[name] = {k for k in history.history if k.startswith("gns")}
        assert all(np.isfinite(history.history[k][-1]) for k in keys[name])
    slices = set(KEYS) if keras.backend.backend() == "tensorflow" else set()
    assert keys == {"slices": slices, "accumulation": set(KEYS)}


def test_one_batch_size_refused_naming_accumulation():
    model = _linear(5, 2, [np.ones((5, 2)), np.zeros(2)])
    model.compile(keras.optimizers.SGD(0.01), "mse")
    x = np.ones((8, 5), "float32")
    with pytest.raises(
        ValueError, match=r"Received: accumulation_steps=1.*`accumulation_steps>=2`"
    ):
        model.fit(x, x[:, :2], verbose=0, callbacks=[GradientNoiseScale(verbose=0)])
    model = _linear(5, 2, [np.ones((5, 2)), np.zeros(2)], accumulation_steps=2)
    model.compile(keras.optimizers.SGD(0.01), "mse")
    with pytest.raises(ValueError, match="cannot be measured with sample weights"):
        model.fit(
            x, x[:, :2], sample_weight=np.ones(8), verbose=0, callbacks=[GradientNoiseScale()]
        )
