"""BatchNorm moving statistics pooled over the window (`step/batchnorm.py`).

References: `keras.Model` trained on the concatenated batch (one update of
the moving statistics from the big batch's moments); numpy moments of the
inputs each BatchNorm saw (recorded with a probe model); the per-micro-batch
momentum steps worked out by hand for `batchnorm_statistics="micro_batch"`.
"""

import inspect

import keras
import numpy as np
import pytest

import keras_fastgrad
from keras_fastgrad import FastGradModel, fastgrad
from keras_fastgrad.step.batchnorm import chan_combine


def conv_bn(cls, axis=-1, **options):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((6, 6, 2))
    h = keras.layers.Conv2D(4, 3, name="conv")(inputs)
    h = keras.layers.BatchNormalization(axis=axis, momentum=0.9, name="bn")(h)
    out = keras.layers.Dense(1)(keras.layers.Flatten()(h))
    return cls(inputs, out, **options)


def dense_bn(cls, **options):
    keras.utils.set_random_seed(4)
    inputs = keras.Input((5,))
    h = keras.layers.Dense(3, name="hidden")(inputs)
    h = keras.layers.BatchNormalization(momentum=0.8, name="bn")(h)
    return cls(inputs, keras.layers.Dense(1)(h), **options)


def sequence_bn(cls, axis=-1, **options):
    """Embedding(mask_zero) -> Dense -> BatchNorm: the BatchNorm gets the mask."""
    keras.utils.set_random_seed(5)
    inputs = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(9, 4, mask_zero=True)(inputs)
    h = keras.layers.Dense(3, name="project")(h)
    h = keras.layers.BatchNormalization(axis=axis, momentum=0.7, name="bn")(h)
    out = keras.layers.GlobalAveragePooling1D()(h)
    return cls(inputs, keras.layers.Dense(1)(out), **options)


def image_data(n=8, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(n, 6, 6, 2)) * 2.0 + 1.0).astype("float32")
    return x, rng.normal(size=(n, 1)).astype("float32")


def vector_data(n=8, seed=1):
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(n, 5)) * 3.0 - 2.0).astype("float32")
    return x, rng.normal(size=(n, 1)).astype("float32")


def sequence_data(n=8, seed=2):
    rng = np.random.default_rng(seed)
    x = rng.integers(1, 9, size=(n, 6))
    lengths = rng.integers(1, 7, size=n)
    x[np.arange(6)[None, :] >= lengths[:, None]] = 0  # trailing padding
    return x.astype("int32"), rng.normal(size=(n, 1)).astype("float32")


def moving(model):
    bn = model.get_layer("bn")
    return bn.moving_mean.numpy(), bn.moving_variance.numpy()


def keras_on_concatenation(build, x, y, **kwargs):
    ref = build(keras.Model, **kwargs)
    ref.compile(optimizer="sgd", loss="mse")
    ref.train_on_batch(x, y)
    return moving(ref)


def assert_moving_close(model, expected, rtol=1e-5, atol=1e-6):
    for got, want in zip(moving(model), expected):
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


# (options, how the batch of 8 is fed): uneven micro-batches everywhere.
SPLITS = {
    "accumulation": ({"accumulation_steps": 2}, [slice(0, 5), slice(5, 8)]),
    "micro_batches": ({"micro_batches": 3}, [slice(0, 8)]),  # 3 + 3 + 2 (padded)
    "both": ({"accumulation_steps": 2, "micro_batches": 2}, [slice(0, 3), slice(3, 8)]),
}


def test_chan_combine_equals_numpy_moments_of_the_union():
    if keras.backend.backend() == "jax":  # float64 as on TensorFlow (JAX's default: 32 bits)
        import jax

        with jax.enable_x64(True):
            return _chan_combine_equals_numpy_moments_of_the_union()
    _chan_combine_equals_numpy_moments_of_the_union()


def _chan_combine_equals_numpy_moments_of_the_union():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(11, 3)) * 5.0 + 7.0
    parts = [x[:1], x[1:7], x[7:]]
    total = (np.zeros(3), np.zeros(3), np.zeros(3))
    for p in parts:
        moments = (np.full(3, len(p), float), p.mean(0), ((p - p.mean(0)) ** 2).sum(0))
        total = [np.asarray(t) for t in chan_combine(total, moments)]
    np.testing.assert_allclose(total[0], 11.0)
    np.testing.assert_allclose(total[1], x.mean(0), rtol=1e-12)
    np.testing.assert_allclose(total[2] / total[0], x.var(0), rtol=1e-12)


@pytest.mark.parametrize("split", sorted(SPLITS))
@pytest.mark.parametrize("build, make_data", [(conv_bn, image_data), (dense_bn, vector_data)])
def test_moving_statistics_equal_keras_on_the_concatenated_batch(build, make_data, split):
    options, parts = SPLITS[split]
    x, y = make_data()
    model = build(FastGradModel, **options)
    model.compile(optimizer="sgd", loss="mse")
    for p in parts:
        model.train_on_batch(x[p], y[p])
    assert_moving_close(model, keras_on_concatenation(build, x, y))


@pytest.mark.parametrize("axis", [-1, 1])
def test_masked_batchnorm_pools_the_mask_weighted_moments(axis):
    # axis=-1: features; axis=1: the time steps are the "features" (the
    # mask's weights differ per feature then).
    x, y = sequence_data()
    model = sequence_bn(FastGradModel, axis=axis, accumulation_steps=3)
    model.compile(optimizer="sgd", loss="mse")
    for p in (slice(0, 2), slice(2, 5), slice(5, 8)):
        model.train_on_batch(x[p], y[p])
    expected = keras_on_concatenation(sequence_bn, x, y, axis=axis)
    assert_moving_close(model, expected, rtol=1e-5, atol=1e-6)


def test_masked_batchnorm_in_padded_slices():
    x, y = sequence_data(n=7)
    model = sequence_bn(FastGradModel, micro_batches=3)  # 3 + 3 + 1 (padded)
    model.compile(optimizer="sgd", loss="mse")
    model.train_on_batch(x, y)
    assert_moving_close(model, keras_on_concatenation(sequence_bn, x, y))


def test_statistics_move_once_per_window():
    x, y = image_data()
    model = conv_bn(FastGradModel, accumulation_steps=2)
    model.compile(optimizer="sgd", loss="mse")
    start = moving(model)
    model.train_on_batch(x[:5], y[:5])
    for got, want in zip(moving(model), start):  # mid-window: unchanged
        np.testing.assert_array_equal(got, want)
    model.train_on_batch(x[5:], y[5:])
    assert_moving_close(model, keras_on_concatenation(conv_bn, x, y))


def test_micro_batch_option_moves_the_statistics_per_micro_batch():
    # The previous behaviour: one momentum step per micro-batch, from its
    # own moments (numpy, on the BatchNorm's inputs: the window's weights
    # do not change before the update).
    x, y = image_data()
    model = conv_bn(FastGradModel, accumulation_steps=2, batchnorm_statistics="micro_batch")
    probe = keras.Model(model.inputs, model.get_layer("conv").output)
    features = [keras.ops.convert_to_numpy(probe(part)) for part in (x[:5], x[5:])]
    model.compile(optimizer="sgd", loss="mse")
    mean, var = moving(model)
    for f in features:
        mean = mean * 0.9 + f.mean(axis=(0, 1, 2)) * 0.1
        var = var * 0.9 + f.var(axis=(0, 1, 2)) * 0.1
    model.train_on_batch(x[:5], y[:5])
    model.train_on_batch(x[5:], y[5:])
    assert_moving_close(model, (mean, var))
    assert model.fastgrad_step_state.batchnorm is None


def test_dropped_micro_batch_is_left_out_of_the_pooled_moments():
    x, y = image_data()
    bad = x[5:].copy()
    bad[0, 0, 0, 0] = np.nan
    model = conv_bn(FastGradModel, accumulation_steps=2)
    model.compile(optimizer="sgd", loss="mse")
    model.train_on_batch(x[:5], y[:5])
    model.train_on_batch(bad, y[5:])  # not finite: dropped
    assert model.telemetry_counters()["nonfinite_count"] == 1.0
    # The window's update is the first micro-batch's alone.
    assert_moving_close(model, keras_on_concatenation(conv_bn, x[:5], y[:5]))


def test_save_and_load_mid_window_keeps_the_pooled_moments(tmp_path):
    x, y = image_data()
    model = conv_bn(FastGradModel, accumulation_steps=2)
    model.compile(optimizer="sgd", loss="mse")
    model.train_on_batch(x[:5], y[:5])
    path = str(tmp_path / "mid_window.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    loaded.train_on_batch(x[5:], y[5:])
    assert_moving_close(loaded, keras_on_concatenation(conv_bn, x, y))


def mobilenet(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.applications.MobileNetV3Small(
        input_shape=(32, 32, 3),
        weights=None,
        classes=4,
        dropout_rate=0.0,
        include_preprocessing=False,
    )


def test_every_batchnorm_of_a_keras_application_pools_what_it_saw():
    # `fastgrad` on MobileNetV3Small: each BatchNorm's moving statistics
    # after one window are one momentum step from the pooled moments of
    # the inputs it saw (each micro-batch normalised by its own moments
    # upstream: recorded by a probe of the same weights in training mode).
    rng = np.random.default_rng(0)
    x = rng.uniform(size=(7, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 4, size=(7,))
    parts = [slice(0, 4), slice(4, 7)]
    model = fastgrad(mobilenet(), accumulation_steps=2)
    twin = mobilenet()
    norms = [l for l in twin.layers if isinstance(l, keras.layers.BatchNormalization)]
    assert len(norms) > 30
    start = {l.name: (l.moving_mean.numpy(), l.moving_variance.numpy()) for l in norms}
    probe = keras.Model(twin.inputs, [l.input for l in norms])
    seen = [[] for _ in norms]
    for p in parts:
        for i, t in enumerate(probe(x[p], training=True)):
            seen[i].append(np.asarray(t, np.float64))
    expected = {}
    for layer, inputs in zip(norms, seen):
        pooled = np.concatenate([t.reshape(-1, t.shape[-1]) for t in inputs])
        mom = layer.momentum
        mean0, var0 = start[layer.name]  # (the probe moved the twin's)
        expected[layer.name] = (
            mean0 * mom + pooled.mean(0) * (1 - mom),
            var0 * mom + pooled.var(0) * (1 - mom),
        )
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy")
    for p in parts:
        model.train_on_batch(x[p], y[p])
    for name, (mean, var) in expected.items():
        layer = model.get_layer(name)
        np.testing.assert_allclose(layer.moving_mean.numpy(), mean, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(layer.moving_variance.numpy(), var, rtol=1e-4, atol=1e-5)


def test_batchnorm_statistics_is_validated_and_round_trips(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"`batchnorm_statistics` must be one of .*Received: batchnorm_statistics='batch'",
    ):
        conv_bn(FastGradModel, batchnorm_statistics="batch")
    with pytest.raises(TypeError, match="batchnorm_statistics"):
        keras_fastgrad.FastGradSequential([keras.layers.Dense(1)], batchnorm_statistics=None)
    model = conv_bn(keras.Model)
    with pytest.raises(ValueError, match="batchnorm_statistics"):
        fastgrad(model, batchnorm_statistics="pooled")
    adapted = fastgrad(conv_bn(keras.Model), batchnorm_statistics="micro_batch")
    adapted.compile(optimizer="sgd", loss="mse")
    path = str(tmp_path / "adapted.keras")
    adapted.save(path)
    assert keras.models.load_model(path).batchnorm_statistics == "micro_batch"
    model = conv_bn(FastGradModel, accumulation_steps=2, batchnorm_statistics="micro_batch")
    assert model.get_config()["batchnorm_statistics"] == "micro_batch"
    path = str(tmp_path / "m.keras")
    model.save(path)
    assert keras.models.load_model(path).batchnorm_statistics == "micro_batch"


@pytest.mark.skipif(
    "renorm" not in inspect.signature(keras.layers.BatchNormalization).parameters,
    reason="BatchNormalization has no `renorm` in this Keras",
)
def test_renorm_is_refused_with_the_fix():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    h = keras.layers.BatchNormalization(renorm=True)(inputs)
    model = FastGradModel(inputs, keras.layers.Dense(1)(h), accumulation_steps=2)
    model.compile(optimizer="sgd", loss="mse")
    x, y = vector_data()
    with pytest.raises(ValueError, match=r"renorm=True.*batchnorm_statistics='micro_batch'"):
        model.train_on_batch(x[:, :3], y)
    model = FastGradModel(
        inputs, keras.layers.Dense(1)(h), accumulation_steps=2, batchnorm_statistics="micro_batch"
    )
    model.compile(optimizer="sgd", loss="mse")
    model.train_on_batch(x[:, :3], y)  # the previous behaviour: accepted


def test_without_a_split_the_step_is_keras_own():
    x, y = image_data()
    model = conv_bn(FastGradModel)
    model.compile(optimizer="sgd", loss="mse")
    model.train_on_batch(x, y)
    assert model.fastgrad_step_state.batchnorm is None
    assert_moving_close(model, keras_on_concatenation(conv_bn, x, y), rtol=0, atol=0)


def test_a_file_whose_step_state_does_not_fit_leaves_no_pooled_moments(tmp_path):
    # The file's core step state (an accumulation window) does not fit a
    # model without accumulation: its window starts fresh, and so must
    # its BatchNorm moments (the file's unfinished window belongs to no
    # window of this model).
    x, y = image_data()
    saved = conv_bn(FastGradModel, accumulation_steps=2)
    saved.compile(optimizer="sgd", loss="mse")
    saved.train_on_batch(x[:5], y[:5])  # mid-window: moments pooled
    path = str(tmp_path / "mid_window.weights.h5")
    saved.save_weights(path)
    model = conv_bn(FastGradModel, micro_batches=2)
    model.compile(optimizer="sgd", loss="mse")
    model.train_on_batch(x[:5], y[:5])  # built
    with pytest.warns(UserWarning, match="start fresh"):
        model.load_weights(path)  # the weights and moving statistics as saved
    model.train_on_batch(x[5:], y[5:])
    assert_moving_close(model, keras_on_concatenation(conv_bn, x[5:], y[5:]))


def test_a_file_without_the_pooled_window_starts_it_empty_on_every_backend(tmp_path):
    # A unit the file lacks starts fresh (`state_files`: `reset_state`,
    # from the host). On JAX `ops.zeros_like` of a variable raised there,
    # so such a file failed to load (found by the full-tier test above).
    # Units: the BatchNorm window and the noise scale's window and EMAs.
    x, y = image_data()
    saved = conv_bn(FastGradModel, accumulation_steps=2, batchnorm_statistics="micro_batch")
    saved.compile(optimizer="sgd", loss="mse")
    saved.train_on_batch(x[:5], y[:5])
    path = str(tmp_path / "no_units.weights.h5")
    saved.save_weights(path)
    model = conv_bn(FastGradModel, accumulation_steps=2)
    model.compile(optimizer="sgd", loss="mse")
    model.enable_telemetry(["gns_simple"])
    model.train_on_batch(x[:5], y[:5])  # mid-window: moments and small batches pooled
    model.train_on_batch(x[5:], y[5:])  # a window: the noise scale's EMAs set
    state = model.fastgrad_step_state
    units = [state.batchnorm, state.noise_scale]
    model.train_on_batch(x[:5], y[:5])  # mid-window again
    assert all(np.any(keras.ops.convert_to_numpy(u.window)) for u in units)
    model.load_weights(path)
    for unit in units:
        for v in unit.variables[:4]:  # (the noise scale's decay is kept)
            assert not np.any(keras.ops.convert_to_numpy(v)), v.path
    for got, want in zip(model.get_weights(), saved.get_weights()):
        np.testing.assert_array_equal(got, want)


# ------------------------------------ synchronized=True and micro_batches
def mirrored_synchronized_micro_batches(strategy):
    """`synchronized=True` with `micro_batches` under `strategy` (two
    replicas; the layer all-reduces inside the slices' loop): refused by
    name, and both fixes the message names train. Run by
    distributed_cases.py (the process with two logical CPUs), asserted by
    end_to_end/test_distributed.py."""

    def build(synchronized, **options):
        keras.utils.set_random_seed(3)
        inputs = keras.Input((3,))
        h = keras.layers.Dense(4)(inputs)
        h = keras.layers.BatchNormalization(synchronized=synchronized, name="sync_bn")(h)
        return FastGradModel(inputs, keras.layers.Dense(1)(h), **options)

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 3)).astype("float32"), rng.normal(size=(16, 1)).astype("float32")
    results = {}
    for name, synchronized, options, batch in [
        ("refused", True, {"micro_batches": 2}, 8),
        ("accumulation", True, {"accumulation_steps": 2}, 4),
        ("unsynchronized", False, {"micro_batches": 2}, 8),
    ]:
        with strategy.scope():
            model = build(synchronized, **options)
            model.compile(optimizer="sgd", loss="mse")
        try:
            model.fit(x, y, batch_size=batch, verbose=0)
            results[name] = {"ok": True, "traced": model.train_function is not None}
        except Exception as e:  # the message is what the test checks
            results[name] = {"ok": False, "type": type(e).__name__, "error": str(e)}
    return results


@pytest.mark.tensorflow_only(reason="Keras: synchronized=True exists on TensorFlow only")
def test_synchronized_batchnorm_with_micro_batches_runs_without_a_strategy():
    # One device: the layer's all-reduce is a no-op, nothing to refuse; it
    # normalises each slice as the unsynchronized layer does.
    def build(synchronized):
        keras.utils.set_random_seed(3)
        inputs = keras.Input((3,))
        h = keras.layers.BatchNormalization(synchronized=synchronized)(
            keras.layers.Dense(4)(inputs)
        )
        model = keras_fastgrad.FastGradModel(inputs, keras.layers.Dense(1)(h), micro_batches=2)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return model

    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(7, 3)).astype("float32"), rng.normal(size=(7, 1)).astype("float32")
    synced, plain = build(True), build(False)
    synced.fit(x, y, batch_size=7, verbose=0)
    plain.fit(x, y, batch_size=7, verbose=0)
    for a, b in zip(synced.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)


# ---------------------------------------------- the core's rules, on values
# (`keras_fastgrad.step.batchnorm`, no backend: both backends run these)


def _moments(samples):
    """numpy `[3, features]` `(n, mean, M2)` of `samples` `[rows, features]`."""
    samples = np.asarray(samples, np.float64)
    n = np.full(samples.shape[1], len(samples))
    mean = samples.mean(0)
    return np.stack([n, mean, ((samples - mean) ** 2).sum(0)])


def test_core_pooling_over_replicas_equals_the_moments_of_all_samples():
    """Three replicas of uneven sizes, each calling the core's k-group
    combination with a `replica_sum` that sums over them (threads, as a
    strategy's replicas): each gets the moments of the concatenation."""
    import threading

    from keras_fastgrad.step.batchnorm import pooled_over_replicas

    rng = np.random.default_rng(0)
    parts = [rng.normal(size=(n, 3)) * (1 + i) + i for i, n in enumerate((2, 5, 1))]
    barrier = threading.Barrier(len(parts))
    posted, results = [None] * len(parts), [None] * len(parts)

    def replica(r):
        def replica_sum(values):
            posted[r] = [np.asarray(v, np.float64) for v in values]
            barrier.wait()
            total = [sum(p[i] for p in posted) for i in range(len(values))]
            barrier.wait()
            return [keras.ops.convert_to_tensor(t, "float32") for t in total]

        local = keras.ops.convert_to_tensor(_moments(parts[r]), "float32")
        results[r] = keras.ops.convert_to_numpy(pooled_over_replicas(local, replica_sum))

    threads = [threading.Thread(target=replica, args=(r,)) for r in range(len(parts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expected = _moments(np.concatenate(parts))
    for result in results:
        np.testing.assert_allclose(result, expected, rtol=1e-5, atol=1e-5)


def test_core_recorder_window_and_step_against_numpy():
    """A layer called twice (pooled), a dropped micro-batch left out, then
    one momentum step from the moments of everything kept: numpy's."""
    from keras_fastgrad.step import batchnorm as core

    layer = keras.layers.BatchNormalization(momentum=0.75)
    layer.build((None, 2))
    rng = np.random.default_rng(1)
    calls = [rng.normal(size=(n, 2)).astype("float32") * 2 + 1 for n in (3, 5, 4)]
    window = keras.ops.zeros((3, 2))
    for keep, x in ((True, calls[0]), (False, calls[2] * 50), (True, calls[1])):
        recorder = core.Recorder([layer])
        for half in (x[:2], x[2:]):  # two calls of the layer in one forward pass
            m = keras.ops.convert_to_tensor(half)
            recorder.record(layer, m, None, keras.ops.mean(m, 0), keras.ops.var(m, 0))
        window = core.kept(
            keras.ops.array(keep), core.combined(window, recorder.stacked([2])), window
        )
    expected = _moments(np.concatenate([calls[0], calls[1]]))
    np.testing.assert_allclose(keras.ops.convert_to_numpy(window), expected, rtol=1e-5)
    old_mean, old_var = np.zeros(2, "float32"), np.ones(2, "float32")
    ((mean, var),), empty = core.moved(window, [layer], [2], [(old_mean, old_var)])
    everything = np.concatenate([calls[0], calls[1]]).astype(np.float64)
    np.testing.assert_allclose(mean, 0.25 * everything.mean(0), rtol=1e-5)
    np.testing.assert_allclose(var, 0.75 + 0.25 * everything.var(0), rtol=1e-5)
    assert not np.any(keras.ops.convert_to_numpy(empty))
    # a window not complete: nothing moves
    (same,), kept_window = core.moved(
        window, [layer], [2], [(old_mean, old_var)], complete=keras.ops.array(False)
    )
    np.testing.assert_array_equal(same[0], old_mean)
    np.testing.assert_array_equal(kept_window, window)


def test_core_counts_weigh_by_the_mask():
    from keras_fastgrad.maths.batchnorm import counts

    inputs = np.ones((2, 3, 4), "float32")
    mask = np.array([[1, 1, 0], [1, 0, 0]], bool)
    assert [float(c) for c in counts(inputs, mask, -1)] == [3.0] * 4
    assert [float(c) for c in counts(inputs, None, 1)] == [8.0] * 3


class _OwnMovingStatistics(keras.layers.BatchNormalization):
    """Moves its statistics in a `call` of its own (no Keras moments)."""

    def call(self, inputs, training=None, mask=None):
        if training:
            self.moving_mean.assign(self.moving_mean * 0.5)
        return inputs


def test_a_batchnorm_moving_its_statistics_without_keras_moments_is_refused():
    """Both backends' steps refuse it with the core's message (nothing
    would be pooled), naming the layer and the fix."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    h = _OwnMovingStatistics(name="own_bn")(inputs)
    model = FastGradModel(inputs, keras.layers.Dense(1)(h), accumulation_steps=2)
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((4, 3), "float32"), np.ones((4, 1), "float32")
    with pytest.raises(ValueError, match=r"`own_bn`.*batchnorm_statistics='micro_batch'"):
        model.fit(x, y, batch_size=2, verbose=0)
