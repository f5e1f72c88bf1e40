"""The optional telemetry keys on JAX (`grad_norm/<layer>`, `update_ratio`,
`agc_clipped_fraction`) against numpy worked from `jax.grad` of a plain
model and the weights before and after a step (SGD: the update is exactly
`lr * grad`), and a numpy count of the units AGC clips. Their values
against the TensorFlow step's: `test_telemetry_jax.py` (its TF process)."""

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

import keras_fastgrad as kf
from tests.helpers import ROWS, embedding
from tests.helpers import mlp_16 as mlp
from tests.helpers import uneven_data as data

LR = 0.1


def _grads(plain, weights, x, y):
    """`jax.grad` of the plain model's mean squared error at `weights`."""
    non_trainable = [v.value for v in plain.non_trainable_variables]

    def loss(trainable):
        pred, _ = plain.stateless_call(trainable, non_trainable, x)
        return jnp.mean((pred - y) ** 2)

    return [np.asarray(g, np.float64) for g in jax.grad(loss)([jnp.asarray(w) for w in weights])]


def _layer_norms(plain, grads, model):
    """`{grad_norm/<layer name>: norm}` by hand: each layer's weights
    (named as `model`'s layers, in the same order)."""
    position = {id(v): i for i, v in enumerate(plain.trainable_variables)}
    return {
        f"grad_norm/{named.name}": np.sqrt(
            sum(np.sum(grads[position[id(w)]] ** 2) for w in layer.trainable_weights)
        )
        for layer, named in zip(plain.layers, model.layers, strict=True)
        if layer.trainable_weights
    }


def _ratio(before, after):
    delta = sum(np.sum((np.float64(a) - b) ** 2) for a, b in zip(after, before, strict=True))
    return np.sqrt(delta) / np.sqrt(sum(np.sum(np.float64(b) ** 2) for b in before))


class _BatchLogs(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.logs = []

    def on_train_batch_end(self, batch, logs=None):
        self.logs.append(dict(logs))


def _fit(model, x, y, batch_size, **kwargs):
    keys = model.layer_norm_keys() + ["update_ratio"]
    model.enable_telemetry(keys)
    model.compile(keras.optimizers.SGD(LR), "mse")
    batches = _BatchLogs()
    model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0, callbacks=[batches], **kwargs)
    return [{k: log[k] for k in keys} for log in batches.logs]


@pytest.mark.parametrize("options", [{}, {"skip_nonfinite": False}, {"micro_batches": 2}])
def test_layer_norms_and_update_ratio_of_one_step(options):
    x, y = data()
    plain = mlp()
    before = [v.numpy() for v in plain.trainable_variables]
    grads = _grads(plain, before, x, y)
    model = mlp(kf.FastGradModel, **options)
    (logs,) = _fit(model, x, y, ROWS)
    after = [v.numpy() for v in model.trainable_variables]
    expected = _layer_norms(plain, grads, model)
    assert sorted(expected) == sorted(k for k in logs if k.startswith("grad_norm/"))
    for key, value in expected.items():
        np.testing.assert_allclose(logs[key], value, rtol=1e-5, err_msg=key)
    np.testing.assert_allclose(logs["update_ratio"], _ratio(before, after), rtol=1e-5)
    # SGD: the update is `lr * grad`, the ratio `lr * ||g|| / ||w||`.
    np.testing.assert_allclose(
        logs["update_ratio"], _ratio(before, [w - LR * g for w, g in zip(before, grads)]), rtol=1e-5
    )
    assert 1e-4 < logs["update_ratio"] < 1.0


def test_with_accumulation_per_update_not_per_micro_step():
    """Batches 16, 16, 16, 10: windows [0, 1] and [2, 3] (rows 0-31 and
    32-57, exact: the mean over each window's rows); the keys move at
    batches 1 and 3 only, and hold between."""
    x, y = data()
    plain = mlp()
    w0 = [v.numpy() for v in plain.trainable_variables]
    g1 = _grads(plain, w0, x[:32], y[:32])
    w1 = [w - LR * g for w, g in zip(w0, g1)]
    g2 = _grads(plain, w1, x[32:], y[32:])
    w2 = [w - LR * g for w, g in zip(w1, g2)]
    model = mlp(kf.FastGradModel, accumulation_steps=2)
    logs = _fit(model, x, y, 16)
    assert len(logs) == 4
    assert all(v == 0.0 for v in logs[0].values())  # nothing applied yet
    assert logs[2] == logs[1]  # a pending micro-step changes nothing
    for log, grads, (before, after) in ((logs[1], g1, (w0, w1)), (logs[3], g2, (w1, w2))):
        for key, value in _layer_norms(plain, grads, model).items():
            np.testing.assert_allclose(log[key], value, rtol=1e-4, err_msg=key)
        np.testing.assert_allclose(log["update_ratio"], _ratio(before, after), rtol=1e-4)


def _np_clipped_fraction(plain, weights, grads, clipping, eps=1e-3):
    """Units whose `||G_i|| > lambda * max(||W_i||, eps)`, by hand: an
    embedding table's rows, a kernel's columns (output units), a bias whole."""
    clipped = units = 0
    for v, w, g in zip(plain.trainable_variables, weights, grads, strict=True):
        w = np.float64(w)
        if v.path.endswith("embeddings"):
            g_norm, w_norm = np.linalg.norm(g, axis=1), np.linalg.norm(w, axis=1)
        elif w.ndim == 2:
            g_norm, w_norm = np.linalg.norm(g, axis=0), np.linalg.norm(w, axis=0)
        else:
            g_norm, w_norm = np.array([np.linalg.norm(g)]), np.array([np.linalg.norm(w)])
        clipped += int(np.sum(g_norm > clipping * np.maximum(w_norm, eps)))
        units += g_norm.size
    return clipped / units


@pytest.mark.parametrize("accumulation_steps", [1, 2])
def test_agc_clipped_fraction_counts_the_clipped_units(accumulation_steps):
    """Embedding(30, 4) rows, a Dense kernel's 3 columns and its bias: 34
    units; rows of tokens not in the batch have no gradient (unclipped).
    With accumulation, one window of two micro-batches of 29 rows: the
    whole batch's gradient."""
    rng = np.random.default_rng(1)
    x = rng.integers(0, 30, size=(ROWS, 5)).astype("int32")
    _, y = data()
    clipping = 0.05
    plain = embedding()
    before = [v.numpy() for v in plain.trainable_variables]
    expected = _np_clipped_fraction(plain, before, _grads(plain, before, x, y), clipping)
    assert 0.0 < expected < 1.0  # some units clipped, not all
    model = embedding(
        kf.FastGradModel, clip_adaptive=clipping, accumulation_steps=accumulation_steps
    )
    model.compile(keras.optimizers.SGD(LR), "mse")
    logger = kf.callbacks.GradientNormLogger(adaptive_fraction=True)
    history = model.fit(
        x, y, batch_size=ROWS // accumulation_steps, verbose=0, shuffle=False, callbacks=[logger]
    )
    np.testing.assert_allclose(history.history["agc_clipped_fraction"], [expected], rtol=1e-6)


def test_telemetry_true_logs_agc_clipped_fraction():
    x, y = data()
    model = mlp(kf.FastGradModel, telemetry=True, clip_adaptive=1e-3)
    model.compile(keras.optimizers.SGD(LR), "mse")
    history = model.fit(x, y, batch_size=ROWS, verbose=0)
    assert history.history["agc_clipped_fraction"] == [1.0]  # every unit, at 1e-3


def test_files_keep_the_layout_with_the_keys(tmp_path):
    """The keys' variables are measurements, not saved (as on TF): a file
    written with them holds the step state of a model without them, and
    the loaded model, asked for the keys, resumes the pending window as
    the saved one does."""
    x, y = data()
    model = mlp(kf.FastGradModel, accumulation_steps=4)
    keys = model.layer_norm_keys() + ["update_ratio"]
    model.enable_telemetry(keys)
    model.compile(keras.optimizers.SGD(LR), "mse")
    for start in (0, 16):  # two micro-batches of a window of four: pending
        model.train_on_batch(x[start : start + 16], y[start : start + 16])
    state = model.fastgrad_step_state
    assert len(model.non_trainable_variables) == len(state.variables) + 3  # 2 layers, ratio
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    assert loaded.fastgrad_step_state.log_keys == set()  # loaded without the keys
    for a, b in zip(loaded.fastgrad_step_state.values(), state.values(), strict=True):
        np.testing.assert_array_equal(a, b)
    loaded.enable_telemetry(keys)
    for start in (32, 48):  # the window completes at the second
        expected = model.train_on_batch(
            x[start : start + 16], y[start : start + 16], return_dict=True
        )
        logs = loaded.train_on_batch(x[start : start + 16], y[start : start + 16], return_dict=True)
    for a, b in zip(model.get_weights(), loaded.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    assert expected["update_ratio"] > 0.0
    for key in keys:
        np.testing.assert_allclose(logs[key], expected[key], rtol=1e-5, err_msg=key)
