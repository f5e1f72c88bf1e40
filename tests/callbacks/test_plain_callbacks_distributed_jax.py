"""The callbacks on a plain Keras model's `fit` under a `keras.distribution`
on JAX: `DataParallel` over 2 host devices and `ModelParallel` on a 2 x 4
mesh of 8 (the kernels sharded over `"model"` by a `LayoutMap`). The model
trains as the same `fit` without the callbacks on one device (to float
rounding: the sharded sums add in another order), and the logged values
(`grad_norm`, `grad_norm/<layer>`, `nonfinite_count`, `tape_variables`)
are those of the same `fit` with the callbacks on one device; a NaN row in
one device's shard is counted once, as on one device. After `fit` the
model is the plain model it was.

JAX's host device count is fixed when it starts
(`XLA_FLAGS=--xla_force_host_platform_device_count=8`, before `jax` is
imported), so every case runs in one fresh process: this file, run as a
script (`python -m tests.callbacks.test_plain_callbacks_distributed_jax
OUT.json`), writes each case's result, and the tests check them."""

import json
import sys

import numpy as np
import pytest

from tests.subprocesses import run_on_host_devices

TOL = 2e-5  # float32 rounding over a few Adam steps
ROWS, BATCH, SEQ, VOCAB = 40, 8, 6, 16
NAN_ROW = 33  # the last batch's row 1: in its first "batch" shard only

# name: (distribution, NaN row or None, epochs)
CASES = {
    "data_parallel": ("data_parallel", None, 2),
    "data_parallel_nan_row": ("data_parallel", NAN_ROW, 1),
    "model_parallel": ("model_parallel", None, 2),
    "model_parallel_nan_row": ("model_parallel", NAN_ROW, 1),
}
LOG_KEYS = ("grad_norm", "nonfinite_count", "tape_variables")


def transformer():
    """A plain `keras.Model`: Embedding -> self-attention (2 heads) ->
    residual, LayerNorm -> feed-forward -> mean over positions -> 4
    outputs; the same initial weights each call."""
    import keras

    keras.utils.set_random_seed(0)
    tokens = keras.Input((SEQ,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, 16, name="embed")(tokens)
    a = keras.layers.MultiHeadAttention(2, 8, name="attention")(h, h)
    h = keras.layers.LayerNormalization(name="norm")(h + a)
    f = keras.layers.Dense(32, activation="relu", name="up")(h)
    h = h + keras.layers.Dense(16, name="down")(f)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(tokens, keras.layers.Dense(4, name="head")(h))


def distribution(name, devices):
    import keras

    if name == "data_parallel":
        return keras.distribution.DataParallel(devices=devices[:2])
    mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"], devices=devices)
    layouts = keras.distribution.LayoutMap(mesh)
    layouts["embed/embeddings"] = (None, "model")
    layouts["attention/.*/kernel"] = (None, None, "model")
    layouts["up/kernel"] = (None, "model")
    layouts["up/bias"] = ("model",)
    layouts["down/kernel"] = ("model", None)
    layouts["head/kernel"] = (None, "model")
    return keras.distribution.ModelParallel(layout_map=layouts, batch_dim_name="batch")


def _train(x, y, epochs, with_callbacks):
    """`epochs` of `fit`; the model and its logs."""
    import keras

    import keras_fastgrad as kf

    model = transformer()
    model.compile(keras.optimizers.Adam(1e-2), "mse")
    callbacks = []
    if with_callbacks:
        callbacks = [
            kf.callbacks.GradientNormLogger(per_layer=True),
            kf.callbacks.NonFiniteGuard("warn"),
            kf.callbacks.TapeVariableCounter(),
        ]
    fit = dict(batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks)
    history = model.fit(x, y, **fit).history
    return model, history


def _run_cases(out_path):
    """(In the 8-device process.) Each case under its distribution, and its
    references on one device; writes `{name: result}` as JSON."""
    import warnings

    import jax

    assert len(jax.devices()) == 8, jax.devices()
    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCAB, size=(ROWS, SEQ)).astype("int32")
    y = rng.normal(size=(ROWS, 4)).astype("float32")
    results = {}
    references = {}  # (NaN row, epochs): the plain fit and the callbacks' on one device
    for name, (kind, nan_row, epochs) in CASES.items():
        ys = y.copy()
        if nan_row is not None:
            ys[nan_row, 0] = np.nan  # (a NaN label: the loss and gradient non-finite)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # NonFiniteGuard("warn")
            if (nan_row, epochs) not in references:
                references[nan_row, epochs] = (
                    _train(x, ys, epochs, with_callbacks=False)[0],
                    *_train(x, ys, epochs, with_callbacks=True),
                )
            plain, alone, alone_logs = references[nan_row, epochs]
            with distribution(kind, jax.devices()).scope():
                model, logs = _train(x, ys, epochs, with_callbacks=True)
                embeddings = model.get_layer("embed").embeddings.value
        keys = sorted(k for k in logs if k in LOG_KEYS or k.startswith("grad_norm/"))
        results[name] = {
            "keys": keys,
            "logs": {k: logs[k] for k in keys},
            "alone_logs": {k: alone_logs.get(k) for k in keys},
            "max_diff": _max_finite_diff(model, plain),
            "nan_equal": all(
                np.array_equal(np.isnan(a), np.isnan(b))
                for a, b in zip(model.get_weights(), plain.get_weights())
            ),
            "alone_max_diff": _max_finite_diff(alone, plain),
            "class": type(model).__name__,
            "embedding_devices": len(embeddings.sharding.device_set),
            "embedding_shard_shape": list(embeddings.addressable_shards[0].data.shape),
        }
    with open(out_path, "w") as f:
        json.dump(results, f)


def _max_finite_diff(a, b):
    diffs = [np.abs(u - v) for u, v in zip(a.get_weights(), b.get_weights())]
    return max(float(np.max(d, initial=0.0, where=np.isfinite(d))) for d in diffs)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("plain_distributed") / "results.json"
    return run_on_host_devices("tests.callbacks.test_plain_callbacks_distributed_jax", 8, out)


def test_plain_fit_with_the_callbacks_under_a_distribution_equals_one_device(results):
    # (One test: the cases share one 8-device process, started once.)
    for case, (_, nan_row, epochs) in CASES.items():
        result = results[case]
        assert result["class"] == "Functional", case  # the plain model again after `fit`
        if case.startswith("model_parallel"):  # sharded over "model": 4 columns each
            assert result["embedding_devices"] == 8, case
            assert result["embedding_shard_shape"] == [VOCAB, 4], case
        else:
            assert result["embedding_devices"] == 2, case
        assert result["max_diff"] < TOL, (case, result["max_diff"])
        assert result["nan_equal"], case
        assert result["alone_max_diff"] == 0.0, case  # the callbacks change nothing on one device
        assert "grad_norm/attention/query" in result["keys"], case
        for key in result["keys"]:
            got, want = result["logs"][key], result["alone_logs"][key]
            np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=f"{case}: {key}")
        # By hand: 5 batches an epoch, the last one with the NaN row (in one
        # device's shard) in the NaN cases: counted once, and applied as
        # Keras applies it (the plain step skips nothing: NaN weights where
        # the reference's are NaN).
        counts = [0.0] * epochs if nan_row is None else [1.0]
        assert result["logs"]["nonfinite_count"] == counts, case
        if nan_row is not None:
            assert np.isnan(result["logs"]["grad_norm"]).all(), case
        # embed 1, attention 8 (4 kernels, 4 biases), norm 2, up 2, down 2, head 2
        assert result["logs"]["tape_variables"] == [17.0] * epochs, case


if __name__ == "__main__":
    _run_cases(sys.argv[1])
