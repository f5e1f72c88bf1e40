"""`keras.distribution.DataParallel` over 2 host devices trains a
`FastGradModel` as a plain `keras.Model` trains on one device (the
equivalent big batch, `Adam(global_clipnorm=)`, the data without its NaN
batch), with the batch sharded over both devices; the noise scale's keys
are those of the same `FastGradModel` on one device.

JAX's host device count is fixed when it starts
(`XLA_FLAGS=--xla_force_host_platform_device_count=2`, before `jax` is
imported), so every case runs in one fresh process: this file, run as a
script (`python test_data_parallel_jax.py OUT.json`), writes each case's
result, and the tests check them one by one."""

import json
import sys

import numpy as np
import pytest

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
        distribution = keras.distribution.DataParallel(devices=jax.devices())
        del seen[:]
        with distribution.scope():
            model = mlp(kf.FastGradModel, **options)
            model.compile(keras.optimizers.Adam(1e-2), "mse")
            fit = dict(batch_size=16, epochs=epochs, shuffle=False, verbose=0)
            history = model.fit(xs, y, **fit).history
            kernel = model.trainable_variables[0].value
        sharded = list(seen)
        counters = model.telemetry_counters()
        gns = {}
        if options.get("telemetry"):  # the same FastGradModel on one device
            alone = mlp(kf.FastGradModel, **options)
            alone.compile(keras.optimizers.Adam(1e-2), "mse")
            one = alone.fit(xs, y, **fit).history
            gns = {k: (history[k], one[k]) for k in history if k.startswith("gns_")}
        results[name] = {
            "max_diff": max_diff(plain, model),
            "updates": counters["updates"],
            "nonfinite_count": counters["nonfinite_count"],
            "batch_devices": sorted({len(s.device_set) for s in sharded}),
            "batch_specs": sorted({str(tuple(s.spec)) for s in sharded}),
            "kernel_devices": len(kernel.sharding.device_set),
            "gns": gns,
        }
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


if __name__ == "__main__":
    _run_cases(sys.argv[1])
