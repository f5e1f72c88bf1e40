"""`keras.distribution.ModelParallel` on a 2 x 4 mesh of 8 host devices
(`"batch"` x `"model"`, the kernels sharded over `"model"` by a
`LayoutMap`) trains a `FastGradModel` as on one device, option by option:
the weights are within float rounding of a plain `keras.Model` on one
device trained on the equivalent big batches (`Adam(global_clipnorm=)`
for `clip_norm`, the data without its NaN micro-batch, Keras' own
`LossScaleOptimizer`), or, for what Keras has no equivalent of
(`clip_adaptive`, the telemetry keys), of the same `FastGradModel` on one
device. The window's sums are sharded exactly as their variables (each
device holds `1/shards` of each), and the finite verdict is global: a NaN
in the rows of one `"batch"` shard drops the whole micro-batch. Per
device, the compiled accumulating step needs no more memory than Keras' own
`gradient_accumulation_steps` on the same mesh (XLA's `memory_analysis()`).

JAX's host device count is fixed when it starts
(`XLA_FLAGS=--xla_force_host_platform_device_count=8`, before `jax` is
imported), so every case runs in one fresh process: this file, run as a
script (`python -m tests.end_to_end.test_model_parallel_jax OUT.json`),
writes each case's result, and the tests check them one by one."""

import json
import math
import sys

import numpy as np
import pytest

from tests.subprocesses import run_on_host_devices

TOL = 2e-5  # float32 rounding over a few Adam steps (the sharded sums add in another order)
CLIP = 0.05
ROWS, BATCH, SEQ, VOCAB = 40, 8, 6, 16
NAN_ROW = 10  # the second batch's row 2: in the first of its two "batch" shards
MESH = (2, 4)

# Each case: (model, FastGradModel options, epochs, reference), a reference
# `("keras", batches, Adam options)`: a plain keras.Model's
# `train_on_batch` calls per epoch as row ranges (`"skip_nan"`: the data
# without the NaN row's micro-batch), or `("alone", ...)`: the same
# FastGradModel on one device.
CASES = {
    # windows [8, 8] [8, 8] and the epoch's partial [8]; clipped; telemetry
    "accumulation_2_partial_window_clip_norm_telemetry": (
        "transformer",
        {"accumulation_steps": 2, "clip_norm": CLIP, "telemetry": True},
        2,
        ("keras", [(0, 16), (16, 32), (32, 40)], {"global_clipnorm": CLIP}),
    ),
    "micro_batches_2": ("transformer", {"micro_batches": 2}, 1, ("keras", "batches", {})),
    "clip_adaptive_accumulation_2": (
        "transformer",
        {"clip_adaptive": 0.01, "accumulation_steps": 2},
        1,
        ("alone",),
    ),
    # windows [8, NaN]: the first micro-batch alone; then [8, 8], [8]
    "nan_row_accumulation_2": (
        "transformer",
        {"accumulation_steps": 2},
        1,
        ("keras", [(0, 8), (16, 32), (32, 40)], {}),
    ),
    "nan_row_default_step": ("transformer", {}, 1, ("keras", "skip_nan", {})),
    # Keras' own rule on both sides: the NaN batch skipped, the scale halved
    # (the plain model trains on the NaN batch too; float32: XLA's CPU dot
    # has no float16 x float16 -> float32)
    "loss_scale_optimizer_nan_row": ("transformer", {}, 1, ("keras", "with_nan", {})),
    # BatchNorm's window statistics: its moving statistics moved once a
    # window, from the moments pooled over it (the forward pass normalises
    # each micro-batch by its own: no keras.Model equivalent)
    "batchnorm_window_accumulation_2": ("batchnorm", {"accumulation_steps": 2}, 1, ("alone",)),
}

# By hand: updates, non-finite micro-batches.
EXPECTED_COUNTS = {
    "accumulation_2_partial_window_clip_norm_telemetry": (6.0, 0.0),
    "micro_batches_2": (5.0, 0.0),
    "clip_adaptive_accumulation_2": (3.0, 0.0),
    "nan_row_accumulation_2": (3.0, 1.0),
    "nan_row_default_step": (4.0, 1.0),
    "loss_scale_optimizer_nan_row": (4.0, 1.0),
    "batchnorm_window_accumulation_2": (3.0, 0.0),
}


# Beyond the transformer: tests/model_cases.py's models, data and
# windows (40 rows in batches of 8; windows of 16, 16 and the epoch's
# partial 8; every update clipped; 2 epochs), each with kernels sharded
# over "model" as below (the layer names as after `clear_session()`).
MODEL_OPTIONS = {"accumulation_steps": 2, "clip_norm": CLIP}
MODEL_LAYOUTS = {
    # (the GRU's recurrent kernel and bias, 18 = 3 x 6 units wide, have no
    # dimension divisible by 4: replicated)
    "masked_gru": {"embedding/embeddings": (None, "model"), "gru/gru_cell/kernel": ("model", None)},
    "per_pixel_conv": {
        "conv2d/kernel": (None, None, None, "model"),
        "conv2d/bias": ("model",),
        "conv2d_1/kernel": (None, None, "model", None),
    },
    "embedding": {"embedding/embeddings": (None, "model"), "dense/kernel": ("model", None)},
    # (a Sequential's paths start with its own name: "dense/kernel" would
    # match nothing, and leave the kernel replicated without a word)
    "sequential": {
        "fast_grad_sequential/dense/kernel": (None, "model"),
        "fast_grad_sequential/dense/bias": ("model",),
        "fast_grad_sequential/dense_1/kernel": ("model", None),
    },
}


def transformer(cls, **options):
    """Embedding -> self-attention (2 heads) -> residual, LayerNorm ->
    feed-forward -> mean over positions -> 4 outputs; the same initial
    weights each call."""
    import keras

    keras.utils.set_random_seed(0)
    tokens = keras.Input((SEQ,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, 16, name="embed")(tokens)
    a = keras.layers.MultiHeadAttention(2, 8, name="attention")(h, h)
    h = keras.layers.LayerNormalization(name="norm")(h + a)
    f = keras.layers.Dense(32, activation="relu", name="up")(h)
    h = h + keras.layers.Dense(16, name="down")(f)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return cls(tokens, keras.layers.Dense(4, name="head")(h), **options)


def batchnorm_model(cls, **options):
    """8 inputs -> Dense 16 (no bias) -> BatchNorm -> relu -> 4 outputs."""
    import keras

    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    h = keras.layers.Dense(16, use_bias=False, name="up")(inputs)  # (BatchNorm's beta is its bias)
    h = keras.layers.BatchNormalization(name="bn")(h)
    h = keras.layers.Activation("relu")(h)
    return cls(inputs, keras.layers.Dense(4, name="head")(h), **options)


def layout_map(devices):
    """Every kernel (and the feed-forward's bias, BatchNorm's per-feature
    weights) sharded over `"model"`, the batch over `"batch"`."""
    import keras

    mesh = keras.distribution.DeviceMesh(MESH, ["batch", "model"], devices=devices)
    layouts = keras.distribution.LayoutMap(mesh)
    layouts["embed/embeddings"] = (None, "model")
    layouts["attention/.*/kernel"] = (None, None, "model")  # query, key, value, output
    layouts["up/kernel"] = (None, "model")
    layouts["up/bias"] = ("model",)
    layouts["down/kernel"] = ("model", None)
    layouts["head/kernel"] = (None, "model")
    layouts["bn/(gamma|beta|moving_mean|moving_variance)"] = ("model",)
    return layouts


def data(model_name):
    rng = np.random.default_rng(0)
    if model_name == "transformer":
        x = rng.integers(0, VOCAB, size=(ROWS, SEQ)).astype("int32")
    else:
        x = rng.normal(size=(ROWS, 8)).astype("float32")
    y = rng.normal(size=(ROWS, 4)).astype("float32")
    return x, y


def optimizer(case, **options):
    """Adam; for the loss scaling case inside Keras' `LossScaleOptimizer`."""
    import keras

    adam = keras.optimizers.Adam(1e-2, **options)
    if case.startswith("loss_scale"):
        return keras.optimizers.LossScaleOptimizer(adam, initial_scale=2.0**10)
    return adam


def _layouts(model):
    """For each window sum and its variable: spec, shape, per-device shard shape."""
    sums = model.fastgrad_step_state.accumulator.sums
    out = []
    for s, v in zip(sums, model.trainable_variables, strict=True):
        out.append(
            {
                "path": v.path,
                "shape": list(v.shape),
                "variable_spec": [str(a) for a in v.value.sharding.spec],
                "sum_spec": [str(a) for a in s.value.sharding.spec],
                "variable_shard": list(v.value.sharding.shard_shape(v.shape)),
                "sum_shard": list(s.value.sharding.shard_shape(s.shape)),
                "sum_devices": len(s.value.sharding.device_set),
            }
        )
    return out


def _memory(kf):
    """(In the 8-device process.) Per device, XLA's `memory_analysis()` of
    the compiled step (jitted as Keras' JAX trainer jits it under a
    distribution) of `FastGradModel(accumulation_steps=4,
    skip_nonfinite=False)` and of keras.Model with Keras' own
    `gradient_accumulation_steps=4`, on the same mesh; and the window's
    sums' bytes, per device and in all."""
    import jax
    import keras

    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map(jax.devices()), batch_dim_name="batch"
    )
    x, y = data("transformer")
    out = {}
    with distribution.scope():
        batch = tuple(
            jax.device_put(a, distribution.get_data_layout(a.shape).backend_layout)
            for a in (x[:BATCH], y[:BATCH])
        )
        for side in ("fastgrad", "keras"):
            if side == "fastgrad":
                model = transformer(kf.FastGradModel, accumulation_steps=4, skip_nonfinite=False)
                model.compile(keras.optimizers.Adam(1e-2), "mse")
            else:
                model = transformer(keras.Model)
                model.compile(keras.optimizers.Adam(1e-2, gradient_accumulation_steps=4), "mse")
            model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, verbose=0)  # (built)
            state = model._get_jax_state(
                trainable_variables=True,
                non_trainable_variables=True,
                optimizer_variables=True,
                metrics_variables=True,
                purge_model_variables=False,
            )
            shardings = (None, model._get_state_sharding_spec())
            step = jax.jit(model.train_step, donate_argnums=0, out_shardings=shardings)
            analysis = step.lower(state, batch).compile().memory_analysis()
            out[side] = {
                "argument": analysis.argument_size_in_bytes,
                "peak": analysis.temp_size_in_bytes
                + analysis.argument_size_in_bytes
                + analysis.output_size_in_bytes
                - analysis.alias_size_in_bytes,
            }
            if side == "fastgrad":
                sums = model.fastgrad_step_state.accumulator.sums
                out["sums_per_device"] = sum(
                    math.prod(s.value.sharding.shard_shape(s.shape)) * 4 for s in sums
                )
                out["sums_in_all"] = sum(math.prod(s.shape) * 4 for s in sums)
    return out


def _run_model(kf, name):
    """(In the 8-device process.) `name`'s model under ModelParallel
    (`MODEL_LAYOUTS[name]`) against a plain `keras.Model` on one device,
    `Adam(global_clipnorm=CLIP)`, on the windows as big batches."""
    import jax
    import keras

    from tests import model_cases
    from tests.helpers import max_weight_diff as max_diff

    build, x, y = model_cases.model_case(name)
    expected = build(keras.Model)
    expected.compile(keras.optimizers.Adam(1e-2, global_clipnorm=CLIP), "mse")
    for _ in range(model_cases.EPOCHS):
        for start, stop in model_cases.WINDOWS:
            expected.train_on_batch(x[start:stop], y[start:stop])
    keras.backend.clear_session()  # (the names; in the scope it would clear the distribution)
    mesh = keras.distribution.DeviceMesh(MESH, ["batch", "model"], devices=jax.devices())
    layouts = keras.distribution.LayoutMap(mesh)
    for path, axes in MODEL_LAYOUTS[name].items():
        layouts[path] = axes
    with keras.distribution.ModelParallel(layout_map=layouts, batch_dim_name="batch").scope():
        model = build(kf.FastGradModel, **MODEL_OPTIONS)
        model.compile(keras.optimizers.Adam(1e-2), "mse")
        fit = dict(batch_size=BATCH, epochs=model_cases.EPOCHS, shuffle=False, verbose=0)
        model.fit(x, y, **fit)
    counters = model.telemetry_counters()
    return {
        "max_diff": max_diff(expected, model),
        "counts": [counters[k] for k in ("updates", "clipped_updates", "nonfinite_count")],
        "specs": {v.path: [str(a) for a in v.value.sharding.spec] for v in model.variables},
        "devices": sorted({len(v.value.sharding.device_set) for v in model.variables}),
        "sequential": isinstance(model, keras.Sequential),
    }


def _run_cases(out_path, names):
    """(In the 8-device process.) Each case under ModelParallel and its
    reference on one device; writes `{name: result}` as JSON."""
    import jax
    import keras

    import keras_fastgrad as kf
    from tests.helpers import max_weight_diff as max_diff

    assert len(jax.devices()) == 8, jax.devices()
    builders = {"transformer": transformer, "batchnorm": batchnorm_model}
    results = {}
    for name in names:
        if name == "memory":
            results[name] = _memory(kf)
            continue
        if name in MODEL_LAYOUTS:
            results[name] = _run_model(kf, name)
            continue
        model_name, options, epochs, reference = CASES[name]
        build = builders[model_name]
        x, y = data(model_name)
        xs, ys = x.copy(), y.copy()
        if "nan_row" in name:
            ys[NAN_ROW, 0] = np.nan
        fit = dict(batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)
        if reference[0] == "keras":  # one device, no distribution
            _, batches, adam = reference
            every = [(i, i + BATCH) for i in range(0, ROWS, BATCH)]
            if batches == "skip_nan":
                batches = [b for b in every if not b[0] <= NAN_ROW < b[1]]
            targets = ys if batches == "with_nan" else y
            if batches in ("batches", "with_nan"):
                batches = every
            expected = build(keras.Model)
            expected.compile(optimizer(name, **adam), "mse")
            for _ in range(epochs):
                for start, stop in batches:
                    expected.train_on_batch(x[start:stop], targets[start:stop])
        else:  # the same FastGradModel on one device
            expected = build(kf.FastGradModel, **options)
            expected.compile(optimizer(name), "mse")
            alone = expected.fit(xs, ys, **fit).history
        distribution = keras.distribution.ModelParallel(
            layout_map=layout_map(jax.devices()), batch_dim_name="batch"
        )
        with distribution.scope():
            model = build(kf.FastGradModel, **options)
            model.compile(optimizer(name), "mse")
            history = model.fit(xs, ys, **fit).history
        counters = model.telemetry_counters()
        scales = [getattr(m.optimizer, "dynamic_scale", None) for m in (model, expected)]
        result = {
            "max_diff": max_diff(expected, model),
            "updates": counters["updates"],
            "nonfinite_count": counters["nonfinite_count"],
            "specs": {v.path: [str(a) for a in v.value.sharding.spec] for v in model.variables},
            "devices": sorted({len(v.value.sharding.device_set) for v in model.variables}),
            "loss_scales": [None if v is None else float(v.numpy()) for v in scales],
            "layouts": _layouts(model) if model.fastgrad_step_state.accumulator else [],
        }
        if options.get("telemetry"):  # the keys, as the same FastGradModel's on one device
            alone_model = build(kf.FastGradModel, **options)
            alone_model.compile(optimizer(name), "mse")
            alone = alone_model.fit(xs, ys, **fit).history
        if reference[0] == "alone" or options.get("telemetry"):
            result["logs"] = {k: (history[k], alone[k]) for k in history}
        results[name] = result
    with open(out_path, "w") as f:
        json.dump(results, f)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("model_parallel") / "results.json"
    return run_on_host_devices(
        "tests.end_to_end.test_model_parallel_jax",
        8,
        out,
        [*CASES, *MODEL_LAYOUTS, "memory"],
        timeout=600,
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_model_parallel_equals_one_device(results, case):
    result = results[case]
    assert result["max_diff"] < TOL, result["max_diff"]
    assert (result["updates"], result["nonfinite_count"]) == EXPECTED_COUNTS[case]
    # The kernels really were sharded over "model" (the LayoutMap applied),
    # every variable laid out over the 8 devices.
    assert result["devices"] == [8], result["devices"]
    kernels = {p: s for p, s in result["specs"].items() if p.endswith(("kernel", "embeddings"))}
    assert len(kernels) == (8 if CASES[case][0] == "transformer" else 2), result["specs"]
    assert all("model" in spec for spec in kernels.values()), kernels
    for key, (sharded, alone) in result.get("logs", {}).items():
        np.testing.assert_allclose(sharded, alone, rtol=1e-4, atol=1e-6, err_msg=key)


@pytest.mark.parametrize("case", sorted(MODEL_LAYOUTS))
def test_more_models_under_model_parallel_equal_one_device(results, case):
    result = results[case]
    assert result["max_diff"] < TOL, result["max_diff"]
    assert result["counts"] == [6.0, 6.0, 0.0], result  # 3 windows an epoch, each clipped
    assert result["devices"] == [8], result["devices"]
    assert result["sequential"] == (case == "sequential")
    for path, axes in MODEL_LAYOUTS[case].items():  # the LayoutMap applied
        spec = result["specs"][path]
        assert spec + ["None"] * (len(axes) - len(spec)) == [str(a) for a in axes], (path, spec)


@pytest.mark.parametrize(
    "case", sorted(c for c, v in CASES.items() if "accumulation_steps" in v[1])
)
def test_window_sums_are_sharded_as_their_variables(results, case):
    layouts = results[case]["layouts"]
    assert layouts
    sharded = 0
    for row in layouts:
        # (a spec may leave out its trailing `None`s: the same sharding)
        spec, variable_spec = (
            s + ["None"] * (len(row["shape"]) - len(s))
            for s in (row["sum_spec"], row["variable_spec"])
        )
        assert spec == variable_spec, row
        # Each device holds 1/shards of the sum: the mesh axes its spec
        # names divide those dimensions (worked out from MESH, not read).
        sizes = dict(zip(["batch", "model"], MESH))
        expected = [n if a == "None" else n // sizes[a] for n, a in zip(row["shape"], spec)]
        assert row["sum_shard"] == expected == row["variable_shard"], row
        assert row["sum_devices"] == 8
        if math.prod(expected) < math.prod(row["shape"]):
            sharded += 1
    # the 8 kernels and a bias; the 2 kernels and BatchNorm's gamma, beta
    assert sharded == (9 if CASES[case][0] == "transformer" else 4), layouts


def test_the_accumulating_step_needs_no_more_memory_per_device_than_keras_own(results):
    memory = results["memory"]
    fastgrad, keras_own = memory["fastgrad"], memory["keras"]
    # issue 49's target, per device (XLA's memory_analysis of each compiled step)
    assert fastgrad["peak"] <= 1.05 * keras_own["peak"], memory
    # The sums are sharded: the step's arguments (the state and the batch)
    # hold no more than Keras' (its accumulators sharded as its optimizer's
    # slots) beyond a few scalars, far less than whole copies would add.
    whole_copies = memory["sums_in_all"] - memory["sums_per_device"]
    assert memory["sums_per_device"] * 3 < memory["sums_in_all"], memory
    assert fastgrad["argument"] - keras_own["argument"] < whole_copies / 4, memory


def test_the_loss_scale_was_halved_on_both_sides(results):
    # one non-finite step from 2**10, no growth (2000 finite steps needed)
    assert results["loss_scale_optimizer_nan_row"]["loss_scales"] == [512.0, 512.0]


def test_the_telemetry_keys_are_those_of_one_device(results):
    logs = results["accumulation_2_partial_window_clip_norm_telemetry"]["logs"]
    assert {"grad_norm", "gns_simple"} <= set(logs), sorted(logs)


if __name__ == "__main__":
    _run_cases(sys.argv[1], sys.argv[2:])
