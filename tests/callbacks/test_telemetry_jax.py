"""On JAX, the fixed telemetry keys and the callbacks that read them
(`GradientNormLogger`, `NonFiniteGuard`, `TapeVariableCounter`), against
`jax.grad` of a plain model, counts by hand and the TensorFlow step's logs
(the same script, in a TensorFlow process)."""

import json
import warnings

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

import keras_fastgrad as kf
from tests.helpers import ROOT, ROWS, run_on_tensorflow
from tests.helpers import mlp_16 as mlp
from tests.helpers import uneven_data as data


def _with_nan(x, rows=(20, 50)):  # batches 1 and 3 of 16 rows
    x = x.copy()
    for row in rows:
        x[row, 0] = np.nan
    return x


def test_grad_norm_is_the_global_norm_of_jax_grad():
    x, y = data()
    plain = mlp()
    weights = [jnp.asarray(v.numpy()) for v in plain.trainable_variables]
    non_trainable = [v.value for v in plain.non_trainable_variables]

    def loss(trainable):
        pred, _ = plain.stateless_call(trainable, non_trainable, x)
        return jnp.mean((pred - y) ** 2)

    expected = np.sqrt(sum(np.sum(np.square(np.asarray(g))) for g in jax.grad(loss)(weights)))
    model = mlp(kf.FastGradModel)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    history = model.fit(
        x, y, batch_size=ROWS, verbose=0, callbacks=[kf.callbacks.GradientNormLogger()]
    )
    np.testing.assert_allclose(history.history["grad_norm"], [expected], rtol=1e-5)
    assert expected > 0.1


def test_grad_norm_after_the_epochs_partial_window_is_that_windows():
    # 3 batches of 16: accumulation 2 leaves the third pending at the
    # epoch's end; its flush is the epoch's last update, so the logged
    # `grad_norm` is the norm of jax.grad of the mean loss over its 16 rows
    # at the weights after the first window (SGD on the first 32 rows). The
    # epoch's logs kept the first window's norm before.
    x, y = data()
    x, y = x[:48], y[:48]
    plain = mlp()
    plain.compile(keras.optimizers.SGD(0.1), "mse")
    plain.fit(x[:32], y[:32], batch_size=32, shuffle=False, verbose=0)
    weights = [v.value for v in plain.trainable_variables]
    non_trainable = [v.value for v in plain.non_trainable_variables]

    def loss(trainable):
        pred, _ = plain.stateless_call(trainable, non_trainable, x[32:])
        return jnp.mean((pred - y[32:]) ** 2)

    expected = np.sqrt(sum(np.sum(np.square(np.asarray(g))) for g in jax.grad(loss)(weights)))
    model = mlp(kf.FastGradModel, accumulation_steps=2, telemetry=True)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    history = model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    assert history.history["updates"] == [2.0]
    np.testing.assert_allclose(history.history["grad_norm"], [expected], rtol=1e-5)


@pytest.mark.parametrize("clip_norm, clipped", [(1e-6, 4.0), (1e2, 0.0)])
def test_counters_by_hand(clip_norm, clipped):
    x, y = data()
    model = mlp(kf.FastGradModel, telemetry=True, clip_norm=clip_norm)
    model.compile(keras.optimizers.SGD(0.01), "mse")
    history = model.fit(_with_nan(x), y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    logs = {k: v[-1] for k, v in history.history.items()}
    # 2 epochs of batches 16, 16, 16, 10; batches 1 and 3 hold a NaN.
    assert logs["nonfinite_count"] == 4.0
    assert logs["updates"] == 4.0
    assert logs["clipped_updates"] == clipped
    # The NaN input reaches every gradient; the first is the first kernel's.
    assert logs["nonfinite_first_index"] == 0.0
    assert logs["nonfinite_num_variables"] == 4.0
    assert logs["tape_variables"] == 4.0 == len(model.trainable_variables)
    assert logs["loss_scale"] == 1.0
    assert logs["input_shape_changes"] == 3.0  # 16 -> 10 -> 16 -> 10
    assert model.telemetry_counters()["nonfinite_count"] == 4.0


def test_loss_scale_key_reads_the_dynamic_scale():
    x, y = data()
    model = mlp(kf.FastGradModel)
    model.enable_telemetry(["loss_scale"])
    model.compile(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01)), "mse")
    history = model.fit(_with_nan(x), y, batch_size=16, shuffle=False, verbose=0)
    # Keras' initial 2**15, halved by each of the two NaN batches.
    assert history.history["loss_scale"] == [2.0**13]
    assert set(history.history) == {"loss", "loss_scale"}


_TF_SCRIPT = """
import json, sys
import keras, numpy as np
sys.path.insert(0, {helpers!r})
from tests.helpers import uneven_data as data, mlp_16 as mlp
import keras_fastgrad as kf
from tests.callbacks.test_telemetry_jax import _with_nan
x, y = data()
weights = list(np.load({weights!r}).values())
out = []
for options in {configs!r}:
    keras.backend.clear_session(free_memory=False)  # the same layer names
    model = mlp(kf.FastGradModel, telemetry=True, **options)
    model.enable_telemetry(model.layer_norm_keys() + ["update_ratio"])
    model.set_weights(weights)  # the JAX side's initial weights
    model.compile(keras.optimizers.SGD(0.01), "mse")
    history = model.fit(_with_nan(x), y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    out.append({{k: [float(v) for v in vs] for k, vs in history.history.items()}})
print("RESULT" + json.dumps(out))
"""

_CONFIGS = [
    {"accumulation_steps": 2, "clip_norm": 0.5},
    {"skip_nonfinite": False},
    # windows [0, (1), 2] and the partial [(3)]: a noise-scale estimate;
    # `telemetry=True` adds `agc_clipped_fraction` with `clip_adaptive`
    {"accumulation_steps": 3, "clip_adaptive": 0.05},
    {"clip_adaptive": 0.05},  # (the keys of NaN batches: not taken)
]
# By hand: the two NaN batches of each epoch dropped; without the skip the
# first NaN update is applied and every batch from batch 1 on is NaN.
_NONFINITE = [4.0, 7.0, 4.0, 4.0]


@pytest.mark.needs_tensorflow(reason="the reference is a TensorFlow process")
def test_same_keys_and_values_as_the_tensorflow_step(tmp_path):
    helpers = ROOT  # the repo root: `tests` imports as a package
    weights = str(tmp_path / "weights.npz")
    np.savez(weights, *mlp().get_weights())
    script = _TF_SCRIPT.format(helpers=helpers, configs=_CONFIGS, weights=weights)
    tf_runs = json.loads(run_on_tensorflow(script, timeout=240).split("RESULT", 1)[1])
    x, y = data()
    histories = []
    for options, tf_history, count in zip(_CONFIGS, tf_runs, _NONFINITE, strict=True):
        # `telemetry=True` adds the noise scale's `gns_*` keys where
        # measurable (accumulation), on both backends: compared too; and
        # the optional `grad_norm/<layer>`, `update_ratio` (both sides).
        keras.backend.clear_session(free_memory=False)  # the same layer names
        model = mlp(kf.FastGradModel, telemetry=True, **options)
        model.enable_telemetry(model.layer_norm_keys() + ["update_ratio"])
        model.compile(keras.optimizers.SGD(0.01), "mse")
        history = model.fit(_with_nan(x), y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        assert sorted(history.history) == sorted(tf_history), options
        for key, values in tf_history.items():
            if key in ("loss", "grad_norm") and options.get("skip_nonfinite") is False:
                continue  # NaN applied: NaN on both (allclose treats NaN equal)
            np.testing.assert_allclose(history.history[key], values, rtol=1e-4, err_msg=key)
        assert history.history["nonfinite_count"][-1] == count
        histories.append(history.history)
    assert np.isfinite(histories[2]["gns_simple"]).all()  # (estimated)
    assert all(0.0 < h["agc_clipped_fraction"][-1] <= 1.0 for h in histories[2:])


def test_non_finite_guard_raises_naming_the_batch_and_variable():
    x, y = data()
    model = mlp(kf.FastGradModel)
    model.compile(keras.optimizers.SGD(0.01), "mse")
    guard = kf.callbacks.NonFiniteGuard("raise")
    with pytest.raises(kf.callbacks.NonFiniteError, match=r"epoch 0, batch 1 .*4 of 4"):
        model.fit(_with_nan(x), y, batch_size=16, shuffle=False, verbose=0, callbacks=[guard])
    assert model.telemetry_counters() == {
        "updates": 1.0,
        "clipped_updates": 0.0,
        "nonfinite_count": 1.0,
    }


def test_non_finite_guard_stops_after_the_nan_batch():
    x, y = data()
    model = mlp(kf.FastGradModel)
    model.compile(keras.optimizers.SGD(0.01), "mse")
    guard = kf.callbacks.NonFiniteGuard("stop")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(
            _with_nan(x), y, batch_size=16, epochs=3, shuffle=False, verbose=0, callbacks=[guard]
        )
    assert model.stop_training
    assert model.telemetry_counters()["updates"] == 1.0  # batch 0 only
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert any("batch 1" in m and "action='stop'" in m for m in messages), messages


def test_tape_variable_counter_counts_the_trainable_variables():
    x, y = data()
    model = mlp(kf.FastGradModel)
    model.layers[1].trainable = False  # the hidden Dense
    model.compile(keras.optimizers.SGD(0.01), "mse")
    history = model.fit(x, y, epochs=2, verbose=0, callbacks=[kf.callbacks.TapeVariableCounter()])
    assert history.history["tape_variables"] == [2.0, 2.0]
    assert history.history["trainable_variables"] == [2.0, 2.0]
    assert model.tape_variable_count == 2  # the property, as the key (4 weights, 2 frozen)


@pytest.mark.parametrize(
    "options, keys",
    [
        ({"update_ratio": True}, ["update_ratio"]),
        ({"per_layer": True}, ["grad_norm/dense", "grad_norm/dense_1"]),
    ],
    ids=["update_ratio", "per_layer"],
)
def test_gradient_norm_logger_optional_keys(options, keys):
    """(Refused on JAX before; values: `test_telemetry_keys_jax.py`.)"""
    keras.backend.clear_session(free_memory=False)  # the layer names
    model = mlp(kf.FastGradModel, accumulation_steps=2)
    model.compile(keras.optimizers.SGD(0.01), "mse")
    x, y = data()
    logger = kf.callbacks.GradientNormLogger(**options)
    history = model.fit(x, y, batch_size=16, verbose=0, callbacks=[logger])
    assert sorted(history.history) == sorted(["loss", "grad_norm", *keys])
    assert all(history.history[k][0] > 0.0 for k in keys)


def test_retrace_watch_counts_the_jitted_steps_traces():
    """58 rows in batches of 16: three of 16, then one of 10, a new shape
    that JAX's jit traces again (by hand: 2 traces in the first epoch,
    none after); batches of 29 divide the rows: 1 trace."""
    x, y = data()
    model = mlp(kf.FastGradModel)
    model.compile(keras.optimizers.SGD(0.01), "mse")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(
            x, y, batch_size=16, epochs=2, verbose=0, callbacks=[kf.callbacks.RetraceWatch()]
        )
    messages = [str(w.message) for w in caught if "RetraceWatch" in str(w.message)]
    assert len(messages) == 1 and "last batch of epoch 0" in messages[0], messages
    assert history.history["train_traces"] == [2.0, 2.0]
    assert model.train_step_trace_count == 2
    even = mlp(kf.FastGradModel)
    even.compile(keras.optimizers.SGD(0.01), "mse")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        history = even.fit(
            x, y, batch_size=29, epochs=2, verbose=0, callbacks=[kf.callbacks.RetraceWatch()]
        )
    assert history.history["train_traces"] == [1.0, 1.0]


def test_a_rebuilt_train_function_is_traced_anew_while_the_old_one_is_held():
    # `jax.jit` caches its traces per function and Keras jits the bound
    # `model.train_step`: bound methods of one model compare equal, so while
    # anything holds the old train function (a user's callback, a profiler),
    # a rebuild reused the old trace, here one traced without the
    # `grad_norm` key. Reference: the same two fits, the old one not held.
    def two_fits(hold):
        x, y = data()
        model = mlp(kf.FastGradModel)
        model.compile(keras.optimizers.SGD(0.1), "mse")
        model.fit(x, y, batch_size=ROWS, verbose=0)  # no telemetry key asked for
        held = model.train_function if hold else None
        history = model.fit(
            x, y, batch_size=ROWS, verbose=0, callbacks=[kf.callbacks.GradientNormLogger()]
        )
        assert held is None or held is not model.train_function
        return history.history

    held, reference = two_fits(hold=True), two_fits(hold=False)
    assert held.get("grad_norm") == reference["grad_norm"]
    assert held["loss"] == reference["loss"]
