"""The JAX step's units, now the maths written once (`keras_fastgrad.maths`)
that the TensorFlow step runs: a finite gradient whose squares overflow
float32 is clipped and applied on JAX as on TensorFlow, checked against
numpy in float64; the clip (`maths.norms.clip`, as the JAX step calls it)
and the loss-scale unit on values."""

import keras
import numpy as np
import pytest

import keras_fastgrad as kf
from keras_fastgrad.backend.jax import units as units
from keras_fastgrad.maths import norms
from keras_fastgrad.maths.finite import all_finite

# A zero-initialised linear model on one row: the MSE gradient of the
# kernel is -2 * y * x, here [-1.2e20, -1.6e20] (norm 2e20, squares 4e40:
# beyond float32's ~3.4e38), every value and the loss (1e20) finite.
X = np.array([[6e9, 8e9]], "float32")
Y = np.array([[1e10]], "float32")


def _linear(cls=keras.Model, **options):
    inputs = keras.Input((2,))
    dense = keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")
    return cls(inputs, dense(inputs), **options)


def _numpy_step(clip_norm, lr):
    """The kernel after one SGD step on the clipped gradient, in float64."""
    x, y = X.astype("float64"), Y.astype("float64")
    grad = (2 * (x @ np.zeros((2, 1)) - y) * x).T  # d/dW of (xW - y)^2
    norm = np.sqrt(np.sum(grad**2))
    assert np.isfinite(norm) and 1.9e20 < norm < 2.1e20
    return -lr * grad * min(1.0, clip_norm / norm)


@pytest.mark.parametrize("accumulation_steps", [1, 2])
def test_a_finite_gradient_of_norm_2e20_is_clipped_and_applied(accumulation_steps):
    model = _linear(kf.FastGradModel, clip_norm=1.0, accumulation_steps=accumulation_steps)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    for _ in range(accumulation_steps):  # one window: the same row each time
        model.train_on_batch(X, Y)
    kernel = model.get_weights()[0]
    np.testing.assert_allclose(kernel, _numpy_step(1.0, 0.1), rtol=1e-6)  # [[.06], [.08]]
    counters = model.telemetry_counters()
    assert counters["updates"] == 1
    assert counters["clipped_updates"] == 1
    assert counters["nonfinite_count"] == 0


def test_clip_on_values_measures_past_the_overflow():
    # `maths.norms.clip` as the JAX step calls it: gated, checked with its
    # `ok` asked; ungated, the NaN guard in the factor.
    grads = [keras.ops.array([-1.2e20]), keras.ops.array([[-1.6e20]])]
    for gated in (True, False):
        c = norms.clip(1.0, grads, checked=gated, fit=gated)
        np.testing.assert_allclose(float(c.norm), 2e20, rtol=1e-6)
        assert bool(c.was_clipped)
        assert c.ok is None if not gated else bool(c.ok)
        np.testing.assert_allclose(
            [float(keras.ops.sum(g * c.factor)) for g in grads], [-0.6, -0.8], rtol=1e-6
        )
    # A norm beyond `clip_norm / tiny` (a subnormal factor): a gated update
    # is refused (`ok` false), an ungated one gets NaN (Keras' guard).
    huge = [keras.ops.array([3e38, 3e38])]
    assert not bool(norms.clip(1.0, huge, checked=True, fit=True).ok)
    assert np.isnan(float(norms.clip(1.0, huge).factor))
    # Below the clip: untouched.
    small = [keras.ops.array([0.3, 0.4])]
    c = norms.clip(1.0, small, checked=True, fit=True)
    assert float(c.norm) == pytest.approx(0.5) and not bool(c.was_clipped) and bool(c.ok)
    assert float(c.factor) == 1.0


def test_all_finite_and_the_loss_scale_rule_on_values():
    assert bool(all_finite([keras.ops.array([1.0, 2e20])]))
    assert not bool(all_finite([keras.ops.array([1.0]), keras.ops.array([np.nan])]))

    class Scaler:
        dynamic_growth_steps = 2

    slots = type("Slots", (), {"scaler": Scaler(), "scale": (0, 1)})()
    ov = [keras.ops.array(8.0), keras.ops.array(0, "int32")]
    seen = []
    # finite, finite (grows), overflow (halves), finite outside a window's end
    for finite, counts in [(True, True), (True, True), (False, True), (True, False)]:
        units.update_scale(slots, ov, keras.ops.array(finite), counts)
        seen.append((float(ov[0]), int(ov[1])))
    assert seen == [(8.0, 1), (16.0, 0), (8.0, 0), (8.0, 0)]


@pytest.mark.parametrize("growth_steps", [1, 3])
def test_the_loss_scale_rule_is_keras_loss_scale_optimizers_on_jax(growth_steps):
    # The reference: Keras' own `LossScaleOptimizer` on JAX, driven
    # through the same finite / non-finite sequence (a NaN gradient for a
    # non-finite step), compared after every step (as tests/step's
    # test_loss_scaling.py does for TensorFlow's `LossScaling`).
    from keras_fastgrad.maths.loss_scale import next_scale

    v = keras.Variable([1.0, 2.0])
    lso = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.0), initial_scale=64.0, dynamic_growth_steps=growth_steps
    )
    lso.build([v])
    # JAX's optimizers are applied statelessly (as Keras' JAX trainer does).
    ov, tv = [w.value for w in lso.variables], [v.value]
    at_scale = [id(w) for w in lso.variables].index(id(lso.dynamic_scale))
    at_counter = [id(w) for w in lso.variables].index(id(lso.step_counter))
    scale = keras.ops.array(64.0)
    counter = ov[at_counter]
    pattern = [True, True, True, True, False, True, True, False, False, True, True, True]
    # (Keras' default of 2000 steps: tested on TensorFlow, whose rule this
    # is too; 2000 eager stateless steps here took 269 s.)
    for i, finite in enumerate(pattern):
        g = keras.ops.array([1.0, 1.0] if finite else [np.nan, 1.0])
        tv, ov = lso.stateless_apply(ov, [g], tv)
        scale, counter = next_scale(scale, counter, keras.ops.array(finite), growth_steps)
        assert float(scale) == float(ov[at_scale]), (i, finite)
        assert int(counter) == int(ov[at_counter]), (i, finite)
    if growth_steps == 3:
        # By hand: 4 finite (x2 at the 3rd: 128), F (64), T T, F F (16),
        # T T T (x2: 32).
        assert float(scale) == 32.0


def test_a_pending_window_without_an_optimizer_is_refused_on_jax(tmp_path):
    # `models.partial_window`'s test and refusal, shared with TensorFlow.
    model = _linear(kf.FastGradModel, accumulation_steps=4)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    model.train_on_batch(np.ones((2, 2), "float32"), np.ones((2, 1), "float32"))
    model.train_on_batch(np.ones((2, 2), "float32"), np.ones((2, 1), "float32"))
    path = str(tmp_path / "pending.keras")
    model.save(path)
    loaded = keras.saving.load_model(path, compile=False)
    with pytest.raises(ValueError, match=r"not compiled\. Received: a model with 2 micro-batches"):
        loaded.apply_partial_window()
    assert model.apply_partial_window()["updates"] == 1
    assert model.apply_partial_window() is None  # nothing pending now
