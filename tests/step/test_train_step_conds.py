"""What the step puts inside its `cond`s (issue 28: work that waits for the
verdict cannot overlap the backward pass).

`skip_nonfinite=False` (no loss scaling): every micro-batch goes on, a
fact known when the step is traced, so the step puts no `cond` on it (the
update, the window's addition and the metrics run unconditionally); only
the bookkeeping of a non-finite micro-batch stays in a `cond`. Adaptive
clipping on the step's single `cond` is computed before it.

References: `keras.Model` and Keras' own `gradient_accumulation_steps`
trained on the same data; the count of a NaN micro-batch by hand; AGC's
update against `optax`-style numpy in `test_adaptive_clipping_fit.py`.
"""

import keras
import numpy as np
import pytest

import keras_fastgrad
from tests.helpers import tf


@pytest.fixture(autouse=True)
def _clean():
    keras.backend.clear_session()
    yield
    keras.backend.clear_session()


def mlp(cls, **options):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((5,))
    h = keras.layers.Dense(8, activation="tanh")(inputs)
    return cls(inputs, keras.layers.Dense(2)(h), **options)


def data(n=16):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 5)).astype("float32"), rng.normal(size=(n, 2)).astype("float32")


def traced_ops(model):
    """`(top, nested)`: the op types of `train_step` traced on one batch,
    outside any function, and in its functions (`cond` branches)."""
    spec = (tf.TensorSpec((4, 5), tf.float32), tf.TensorSpec((4, 2), tf.float32))
    graph = tf.function(model.train_step).get_concrete_function(spec).graph
    top = [op.type for op in graph.get_operations()]
    nested, seen = [], set()

    def walk(g):
        for name, fn in getattr(g, "_functions", {}).items():
            if name not in seen:
                seen.add(name)
                nested.extend(op.type for op in fn.graph.get_operations())
                walk(fn.graph)

    walk(graph)
    return top, nested


def traced_conds(model, x, y):
    """The `If` ops of `train_step` traced on one batch (nested ones too)."""
    return sum(t in ("If", "StatelessIf") for t in sum(traced_ops(model), []))


@pytest.mark.parametrize("telemetry", [False, True])
@pytest.mark.parametrize("steps", [None, 2])
def test_skip_nonfinite_false_trains_like_keras_without_a_check(steps, telemetry):
    x, y = data()
    options = {} if steps is None else {"accumulation_steps": steps}
    model = mlp(keras_fastgrad.FastGradModel, skip_nonfinite=False, telemetry=telemetry, **options)
    ref = mlp(keras.Model)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    ref.compile(optimizer=keras.optimizers.SGD(0.1, gradient_accumulation_steps=steps), loss="mse")
    h = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    r = ref.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(model.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(h.history["loss"], r.history["loss"], rtol=1e-5)
    if keras.backend.backend() == "tensorflow":  # (the traced graph's ops)
        # No finite check unless a key reads its count (`telemetry=True`,
        # NonFiniteGuard: then the count's bookkeeping, a `cond` with one of
        # its own for where it went bad); with accumulation, the window's update.
        assert traced_conds(model, x, y) == 2 * int(telemetry) + (0 if steps is None else 1)


def test_skip_nonfinite_false_counts_nothing_unless_asked():
    x, y = data(n=8)
    x[1, 0] = np.nan
    model = mlp(keras_fastgrad.FastGradModel, skip_nonfinite=False)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert np.isnan(model.get_weights()[0]).any()  # applied, as keras.Model does
    assert model.telemetry_counters()["nonfinite_count"] == 0.0  # not checked


def test_skip_nonfinite_false_still_counts_a_nan_micro_batch():
    x, y = data(n=8)
    x[1, 0] = np.nan  # the first batch of 4
    model = mlp(keras_fastgrad.FastGradModel, skip_nonfinite=False, telemetry=True)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    h = model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    # Applied, as keras.Model does: the weights are NaN from then on, so
    # the second batch's gradient is NaN too: both counted.
    assert np.isnan(model.get_weights()[0]).any()
    assert h.history["nonfinite_count"] == [2.0]


@pytest.mark.tensorflow_only(reason="the ops of the traced tf.function graph")
def test_adaptive_clipping_is_computed_before_the_single_cond():
    x, y = data()
    model = mlp(keras_fastgrad.FastGradModel, clip_adaptive=0.01)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    top, nested = traced_ops(model)
    # AGC's unit norms (one `EuclideanNorm` per weight and per gradient)
    # wait for no verdict; the update and its check stay in the `cond`.
    assert top.count("EuclideanNorm") == 2 * len(model.trainable_variables)
    assert "EuclideanNorm" not in nested
