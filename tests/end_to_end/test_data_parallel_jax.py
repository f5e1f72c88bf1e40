"""`keras.distribution.DataParallel` over 2 host devices trains a
`FastGradModel` as a plain `keras.Model` trains on one device (the
equivalent big batch, `Adam(global_clipnorm=)`, the data without its NaN
batch), with the batch sharded over both devices; the noise scale's keys
are those of the same `FastGradModel` on one device. Beyond the MLP: a
masked GRU (a per-timestep masked loss), a Conv2D with a per-pixel loss,
an Embedding model, a `keras.Sequential` and a subclass with a
training-only branch, each with accumulation and clipping.

JAX's host device count is fixed when it starts
(`XLA_FLAGS=--xla_force_host_platform_device_count=2`, before `jax` is
imported), so every case runs in one fresh process: this file, run as a
script (`python test_data_parallel_jax.py OUT.json`), writes each case's
result, and the tests check them one by one."""

import json
import sys

import numpy as np
import pytest

from tests import model_cases
from tests.subprocesses import run_on_host_devices

TOL = 1e-5
CLIP = 0.05
NAN_ROW = 20  # in the second batch of 16


def _cases():
    """`{name: (fastgrad options, epochs, reference)}`; a reference is
    `(batches, plain Adam options)`: the plain model's `train_on_batch`
    calls, per epoch, as row ranges."""
    without_nan = [(0, 16), (32, 48), (48, 58)]
    return {
        # the default step (one micro-batch, one update), clipped
        "nan_row_clip_norm": ({"clip_norm": CLIP}, 2, (without_nan, {"global_clipnorm": CLIP})),
        # windows [16, NaN]: the first micro-batch alone; then [16, 10] (uneven)
        "nan_row_accumulation_2": ({"accumulation_steps": 2}, 2, ([(0, 16), (32, 58)], {})),
        # windows [16, 16, 16] and the epoch's partial window [10]; the
        # noise scale's keys (`telemetry=True`) as on one device
        "accumulation_3_partial_window_clip_norm": (
            {"accumulation_steps": 3, "clip_norm": CLIP, "telemetry": True},
            2,
            ([(0, 48), (48, 58)], {"global_clipnorm": CLIP}),
        ),
    }


# By hand: updates, non-finite micro-batches over the two epochs.
EXPECTED_COUNTS = {
    "nan_row_clip_norm": (6.0, 2.0),
    "nan_row_accumulation_2": (4.0, 2.0),
    "accumulation_3_partial_window_clip_norm": (4.0, 0.0),
}


# Beyond the MLP: 40 rows in batches of 8, `accumulation_steps=2`: windows
# of 16, 16 and the epoch's partial window of 8; every update clipped.
MODELS = ("masked_gru", "per_pixel_conv", "embedding", "sequential", "training_branch")
MODEL_OPTIONS = {"accumulation_steps": 2, "clip_norm": CLIP}


def _per_micro_batch_weights(x):
    """Weights under which the big batch's masked loss is the mean of
    its two micro-batches' masked means (each over its own valid
    timesteps): what a per-micro-batch normaliser would train on (Keras'
    own `gradient_accumulation_steps=2` on the full windows, checked by
    hand)."""
    valid = (x != 0).sum(axis=1).astype("float64")
    weights = np.ones(len(x), "float32")
    for start, stop in model_cases.WINDOWS[:2]:
        middle = (start + stop) // 2
        for lo, hi in ((start, middle), (middle, stop)):
            weights[lo:hi] = valid[start:stop].sum() / (2 * valid[lo:hi].sum())
    return np.repeat(weights[:, None], x.shape[1], axis=1)  # one a timestep


def _fit_sharded(build, options, x, y, seen, batch_size, epochs):
    """(In the 2-device process.) `build(FastGradModel, **options)` fit
    under DataParallel over both devices. Returns `(model, history,
    where)`; `where` says how the batch (as `seen` collects it at trace
    time) and the first trainable variable were laid out."""
    import jax
    import keras

    import keras_fastgrad as kf

    distribution = keras.distribution.DataParallel(devices=jax.devices())
    del seen[:]
    with distribution.scope():
        model = build(kf.FastGradModel, **options)
        model.compile(keras.optimizers.Adam(1e-2), "mse")
        fit = dict(batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
        history = model.fit(x, y, **fit).history
        kernel = model.trainable_variables[0].value
    where = {
        "batch_devices": sorted({len(s.device_set) for s in seen}),
        "batch_specs": sorted({str(tuple(s.spec)) for s in seen}),
        "kernel_devices": len(kernel.sharding.device_set),
    }
    return model, history, where


def _run_model_cases(results, seen):
    """(In the 2-device process.) `MODELS` under DataParallel against a
    plain `keras.Model` on one device on the windows as big batches."""
    import keras

    from tests.helpers import max_weight_diff as max_diff

    def plain(build, x, y, sample_weight=None):
        model = build(keras.Model)
        model.compile(keras.optimizers.Adam(1e-2, global_clipnorm=CLIP), "mse")
        for _ in range(model_cases.EPOCHS):
            for start, stop in model_cases.WINDOWS:
                weights = None if sample_weight is None else sample_weight[start:stop]
                model.train_on_batch(x[start:stop], y[start:stop], sample_weight=weights)
        return model

    for name in MODELS:
        build, x, y = model_cases.model_case(name)
        reference = plain(build, x, y)
        model, _, result = _fit_sharded(build, MODEL_OPTIONS, x, y, seen, 8, model_cases.EPOCHS)
        counters = model.telemetry_counters()
        result.update(
            max_diff=max_diff(reference, model),
            counts=[counters[k] for k in ("updates", "clipped_updates", "nonfinite_count")],
            sequential=isinstance(model, keras.Sequential),
        )
        if name == "masked_gru":  # how far a per-micro-batch normaliser lands
            wrong = plain(build, x, y, sample_weight=_per_micro_batch_weights(x))
            result["per_micro_batch_diff"] = max_diff(wrong, model)
        results[name] = result


def _run_cases(out_path):
    """(In the 2-device process.) Each case on DataParallel and its
    reference on one device; writes `{name: result}` as JSON."""
    import jax
    import keras

    import keras_fastgrad as kf
    from keras_fastgrad.backend.jax import step as jax_step
    from tests.helpers import max_weight_diff as max_diff
    from tests.helpers import mlp_16 as mlp
    from tests.helpers import uneven_data as data

    assert len(jax.devices()) == 2, jax.devices()
    seen = []
    step = jax_step.train_step

    def spying_step(model, state, batch):  # the batch's sharding, at trace time
        first = keras.tree.flatten(batch)[0]
        jax.debug.inspect_array_sharding(first, callback=lambda s: seen.append(s))
        return step(model, state, batch)

    jax_step.train_step = spying_step
    x, y = data()
    results = {}
    for name, (options, epochs, (batches, adam)) in _cases().items():
        xs = x.copy()
        if "nan_row" in name:
            xs[NAN_ROW, 0] = np.nan
        plain = mlp()  # one device (no distribution)
        plain.compile(keras.optimizers.Adam(1e-2, **adam), "mse")
        for _ in range(epochs):
            for start, stop in batches:
                plain.train_on_batch(x[start:stop], y[start:stop])
        model, history, where = _fit_sharded(mlp, options, xs, y, seen, 16, epochs)
        counters = model.telemetry_counters()
        gns = {}
        if options.get("telemetry"):  # the same FastGradModel on one device
            alone = mlp(kf.FastGradModel, **options)
            alone.compile(keras.optimizers.Adam(1e-2), "mse")
            one = alone.fit(xs, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0).history
            gns = {k: (history[k], one[k]) for k in history if k.startswith("gns_")}
        results[name] = {
            **where,
            "max_diff": max_diff(plain, model),
            "updates": counters["updates"],
            "nonfinite_count": counters["nonfinite_count"],
            "gns": gns,
        }
    _run_model_cases(results, seen)
    with open(out_path, "w") as f:
        json.dump(results, f)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("data_parallel") / "results.json"
    return run_on_host_devices("tests.end_to_end.test_data_parallel_jax", 2, out)


@pytest.mark.parametrize("case", sorted(EXPECTED_COUNTS))
def test_data_parallel_equals_one_device(results, case):
    result = results[case]
    # The batch really was split over both devices, the weights replicated.
    assert result["batch_devices"] == [2], result
    assert result["batch_specs"] == ["('batch',)"], result
    assert result["kernel_devices"] == 2
    assert result["max_diff"] < TOL, result
    assert (result["updates"], result["nonfinite_count"]) == EXPECTED_COUNTS[case]
    if case.startswith("accumulation_3"):  # the noise scale's keys
        assert sorted(result["gns"]) == ["gns_grad_sq", "gns_simple", "gns_trace"]
        for key, (sharded, alone) in result["gns"].items():
            assert np.isfinite(alone).all(), key
            np.testing.assert_allclose(sharded, alone, rtol=1e-4, err_msg=key)


def test_masked_gru_data_has_uneven_valid_counts():
    # Each window's micro-batches, and each device's half of one, hold
    # different numbers of valid timesteps, so a normaliser per
    # micro-batch (or per device) would weigh them differently.
    valid = model_cases.lengths()
    for start, stop in model_cases.WINDOWS:
        halves = [valid[i : i + 4].sum() for i in range(start, stop, 4)]
        assert len(set(halves)) == len(halves), halves
    assert (valid < 7).any() and (valid == 7).any()


@pytest.mark.parametrize("case", MODELS)
def test_models_under_data_parallel_equal_one_device(results, case):
    result = results[case]
    assert result["batch_devices"] == [2], result
    assert result["batch_specs"] == ["('batch',)"], result
    assert result["kernel_devices"] == 2
    assert result["sequential"] == (case == "sequential")
    assert result["max_diff"] < TOL, result
    # 3 windows an epoch, each update clipped
    assert result["counts"] == [6.0, 6.0, 0.0], result
    if case == "masked_gru":  # the window's normaliser, not a micro-batch's
        assert result["per_micro_batch_diff"] > 100 * TOL, result


if __name__ == "__main__":
    _run_cases(sys.argv[1])
