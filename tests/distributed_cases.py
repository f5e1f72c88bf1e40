"""MirroredStrategy cases, run in a subprocess by end_to_end/test_distributed.py.

Two logical CPU devices must be configured before TensorFlow initialises,
so this runs as its own process: `python distributed_cases.py OUT.json
[CASE ...]` (every case by default). Each case trains a single-device
reference and the same model under `MirroredStrategy` on the same global
batches, and records what the test asserts (max weight difference, logs,
replica agreement). Every MirroredStrategy case of the suite is here, those
written beside a feature's tests too (mirrored_adaptive_clipping.py,
mirrored_multitask.py, step/gns_mirrored.py, the `mirrored_*` functions of
models/test_keras_hooks.py and step/test_batchnorm.py): one process for
them all (TensorFlow's start and the strategy's, about 7 s of CPU, once).
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_fastgrad  # noqa: E402
from tests.helpers import data, fast, max_weight_diff, mlp  # noqa: E402

STRATEGY = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


def replicas_agree(model):
    """Max difference between the two replicas' copies of every weight."""
    worst = 0.0
    for v in model.trainable_variables:
        copies = STRATEGY.experimental_local_results(v.value)
        worst = max(worst, float(np.max(np.abs(copies[0].numpy() - copies[1].numpy()))))
    return worst


def train(build, compile_kwargs, x, y, fit_kwargs, distributed):
    if distributed:
        with STRATEGY.scope():
            model = build()
            model.compile(**compile_kwargs())
    else:
        model = build()
        model.compile(**compile_kwargs())
    history = model.fit(x, y, shuffle=False, verbose=0, **fit_kwargs)
    return model, history.history


def compare(build, compile_kwargs, x, y, fit_kwargs, reference=None):
    ref, h_ref = reference or train(build, compile_kwargs, x, y, fit_kwargs, False)
    dist, h_dist = train(build, compile_kwargs, x, y, fit_kwargs, True)
    return {
        "max_weight_diff": max_weight_diff(ref, dist),
        "replicas_agree": replicas_agree(dist),
        "history": h_dist,
        "reference_history": h_ref,
    }


def adam():
    return {"optimizer": keras.optimizers.Adam(0.01), "loss": "mse", "metrics": ["mae"]}


def sgd(**kwargs):
    return lambda: {"optimizer": keras.optimizers.SGD(0.1, **kwargs), "loss": "mse"}


def case_default():
    # 11 samples, global batch 4: the last batch (3) splits 2/1 over replicas.
    x, y = data(n=11)
    return compare(lambda: fast(telemetry=True), adam, x, y, {"batch_size": 4, "epochs": 2})


def case_accumulation_and_clipping():
    x, y = data(n=22)
    y = y * 20.0  # large gradients: clipping acts
    build = lambda: fast(accumulation_steps=3, clip_norm=1.0, telemetry=True)  # noqa: E731
    return compare(build, sgd(), x, y, {"batch_size": 4, "epochs": 2})


def case_steps_per_execution():
    x, y = data(n=26)
    y = y * 20.0
    build = lambda: fast(accumulation_steps=2, clip_norm=1.0)  # noqa: E731
    compile_spe = lambda: {**adam(), "steps_per_execution": 3}  # noqa: E731
    try:
        compare(build, compile_spe, x, y, {"batch_size": 4, "epochs": 2})
        return {"ok": True}
    except Exception as e:  # the message is what the test checks
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}


def case_micro_batches():
    # Batches of 10 over 2 replicas (5 each) in 2 slices (3 + 2, padded).
    x, y = data(n=30)
    build = lambda: fast(micro_batches=2, accumulation_steps=2, clip_norm=1.0)  # noqa: E731
    return compare(build, adam, x, y * 10.0, {"batch_size": 10, "epochs": 2})


def case_nan_on_one_replica():
    # Global batch 8 = replica 0 gets samples 0-3, replica 1 samples 4-7.
    x, y = data(n=24)
    xs = x.copy()
    xs[8 + 5, 1] = np.nan  # second global batch, replica 1's half only
    keep = np.r_[0:8, 16:24]
    reference = train(mlp, adam, x[keep], y[keep], {"batch_size": 8}, False)
    result = compare(
        lambda: fast(telemetry=True), adam, xs, y, {"batch_size": 8}, reference=reference
    )
    return result


def case_per_output_losses_nan_on_one_replica():
    # A two-output model; replica 1's half of global batch 2 has a NaN in
    # output b's target: the whole global batch is dropped, and Keras'
    # `a_loss` / `b_loss` leave it out as `loss` does. Reference: the
    # single device trained without that global batch.
    def two_outputs():
        keras.utils.set_random_seed(3)
        inputs = keras.Input((4,))
        trunk = keras.layers.Dense(8, activation="tanh")(inputs)
        outputs = {"a": keras.layers.Dense(1, name="a")(trunk)}
        outputs["b"] = keras.layers.Dense(2, name="b")(trunk)
        return inputs, outputs

    def losses():
        return {"optimizer": keras.optimizers.SGD(0.1), "loss": {"a": "mse", "b": "mse"}}

    rng = np.random.default_rng(0)
    x = rng.normal(size=(24, 4)).astype("float32")
    y = {"a": rng.normal(size=(24, 1)), "b": rng.normal(size=(24, 2))}
    y = {k: v.astype("float32") for k, v in y.items()}
    ys = {k: v.copy() for k, v in y.items()}
    ys["b"][8 + 5, 0] = np.nan
    keep = np.r_[0:8, 16:24]
    reference = train(
        lambda: keras.Model(*two_outputs()),
        losses,
        x[keep],
        {k: v[keep] for k, v in y.items()},
        {"batch_size": 8},
        False,
    )
    return compare(
        lambda: keras_fastgrad.FastGradModel(*two_outputs(), telemetry=True),
        losses,
        x,
        ys,
        {"batch_size": 8},
        reference,
    )


def case_mixed_float16_overflow_on_one_replica():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        x, y = data(n=16)
        xs = x.copy()
        xs[8 + 6] = 1e5  # inf in float16; replica 1's half of batch 2
        keep = np.r_[0:8]
        lso = lambda: {  # noqa: E731
            "optimizer": keras.optimizers.LossScaleOptimizer(
                keras.optimizers.SGD(0.1), initial_scale=2.0**8
            ),
            "loss": "mse",
        }
        reference = train(mlp, lso, x[keep], y[keep], {"batch_size": 8}, False)
        result = compare(lambda: fast(telemetry=True), lso, xs, y, {"batch_size": 8}, reference)
        return result
    finally:
        keras.mixed_precision.set_global_policy("float32")


def case_keras_global_clipnorm():
    # What Keras' own clipping does under two replicas (FACTS: per replica,
    # before the all-reduce), next to ours.
    x, y = data(n=8)
    y = y * 50.0
    keras_clip = compare(mlp, sgd(global_clipnorm=1.0), x, y, {"batch_size": 8})
    ours = compare(lambda: fast(clip_norm=1.0), sgd(), x, y, {"batch_size": 8})
    return {"keras": keras_clip["max_weight_diff"], "ours": ours["max_weight_diff"]}


def case_jit_compile():
    x, y = data(n=16)
    build = lambda: fast(accumulation_steps=2, clip_norm=1.0)  # noqa: E731
    compile_xla = lambda: {**adam(), "jit_compile": True}  # noqa: E731
    try:
        result = compare(build, compile_xla, x, y, {"batch_size": 4})
        return {"ok": True, "max_weight_diff": result["max_weight_diff"]}
    except Exception as e:  # the message is what the test checks
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}


def case_masked_sequences():
    # Global batch 8: replica 0 gets rows with 1 valid step, replica 1 rows
    # with 6. Weighted by samples, the replicas' shares would be wrong;
    # weighted by valid steps (the loss's normaliser) the update is exact.
    from tests.end_to_end.test_exactness import masked_data, masked_rnn

    x, y = masked_data()
    x, y = np.concatenate([x, x[::-1]]), np.concatenate([y, y[::-1]])
    build = lambda: masked_rnn(keras_fastgrad.FastGradModel, accumulation_steps=2)  # noqa: E731
    reference = train(lambda: masked_rnn(keras.Model), sgd(), x, y, {"batch_size": 16}, False)
    return compare(build, sgd(), x, y, {"batch_size": 8}, reference=reference)


def case_zero_normaliser():
    # Global batches of 8 (4 per replica, 2 slices of 2), windows of 2
    # batches; every sample weight of the second window is 0 (its global
    # normaliser is 0): Keras on the big batch (16) steps with a zero
    # gradient, so Adam's moments move; no NaN may reach the weights.
    x, y = data(n=64)
    w = np.ones(64, "float32")
    w[16:32] = 0.0
    loss = keras.losses.MeanSquaredError(reduction="mean_with_sample_weight")
    compile_kwargs = lambda: {"optimizer": keras.optimizers.Adam(0.05), "loss": loss}  # noqa: E731
    build = lambda: fast(micro_batches=2, accumulation_steps=2)  # noqa: E731
    reference = train(mlp, compile_kwargs, x, y, {"batch_size": 16, "sample_weight": w}, False)
    result = compare(build, compile_kwargs, x, y, {"batch_size": 8, "sample_weight": w}, reference)
    result["iterations"] = int(reference[0].optimizer.iterations.numpy())
    return result


def case_replica_sum_overflow():
    # One sample per replica, each gradient 2e38 (finite); their sum is inf.
    inputs = keras.Input((1,))
    layer = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")
    with STRATEGY.scope():
        model = keras_fastgrad.FastGradModel(inputs, layer(inputs), telemetry=True)
        model.compile(optimizer=keras.optimizers.SGD(1e-40), loss="mse")
    x = np.array([[1e19], [1e19], [1.0], [1.0]], "float32")
    h = model.fit(x, np.zeros((4, 1), "float32"), batch_size=2, shuffle=False, verbose=0)
    return {"weights": model.get_weights()[0].ravel().tolist(), "history": h.history}


def _conv_bn(cls, synchronized, **options):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((6, 6, 2))
    h = keras.layers.Conv2D(4, 3)(inputs)
    h = keras.layers.BatchNormalization(momentum=0.9, synchronized=synchronized, name="bn")(h)
    return cls(inputs, keras.layers.Dense(1)(keras.layers.Flatten()(h)), **options)


def case_batchnorm_window():
    # One window of two global batches (8, then 7: replicas split 4/4 and
    # 4/3; unsynchronized, each in 2 slices, padded): the moving statistics
    # against keras.Model on one device on the 15 samples concatenated.
    # (A `synchronized=True` layer all-reduces inside Keras' moments, which
    # TensorFlow refuses inside the slices' loop: no `micro_batches` there.)
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(15, 6, 6, 2)) * 2.0 + 1.0).astype("float32")
    y = rng.normal(size=(15, 1)).astype("float32")
    result = {}
    for synchronized in (False, True):
        ref = _conv_bn(keras.Model, synchronized)
        ref.compile(optimizer="sgd", loss="mse")
        ref.train_on_batch(x, y)
        with STRATEGY.scope():
            model = _conv_bn(
                keras_fastgrad.FastGradModel,
                synchronized,
                accumulation_steps=2,
                micro_batches=1 if synchronized else 2,
            )
            model.compile(optimizer="sgd", loss="mse")
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        got, want = model.get_layer("bn"), ref.get_layer("bn")
        copies = STRATEGY.experimental_local_results(got.moving_mean.value)
        result[f"synchronized={synchronized}"] = {
            "mean_diff": float(np.max(np.abs(got.moving_mean.numpy() - want.moving_mean.numpy()))),
            "variance_diff": float(
                np.max(np.abs(got.moving_variance.numpy() - want.moving_variance.numpy()))
            ),
            "moved": float(np.max(np.abs(want.moving_mean.numpy()))),
            "replicas_agree": float(np.max(np.abs(copies[0].numpy() - copies[1].numpy()))),
        }
    return result


# ---------------------------------------- the cases of a feature's own tests
# (All under the one STRATEGY: two MirroredStrategy objects in one process
# draw the same collective keys, and their all-reduces collide.)
def case_adaptive_clipping():
    from tests import mirrored_adaptive_clipping

    return mirrored_adaptive_clipping.results(STRATEGY)


def case_noise_scale():
    from tests.step import gns_mirrored

    return gns_mirrored.results(STRATEGY)


def case_multitask_merger_pcgrad():
    from tests import mirrored_multitask

    return mirrored_multitask.results(STRATEGY, "test_merger", "pcgrad")


def case_multitask_features_mgda():
    from tests import mirrored_multitask

    return mirrored_multitask.results(STRATEGY, "test_feature_space", "mgda")


def case_training_only_layer():
    from tests.models.test_keras_hooks import mirrored_training_only_layer

    return mirrored_training_only_layer(STRATEGY)


def case_synchronized_batchnorm_micro_batches():
    from tests.step.test_batchnorm import mirrored_synchronized_micro_batches

    return mirrored_synchronized_micro_batches(STRATEGY)


CASES = {
    name[len("case_") :]: fn for name, fn in sorted(globals().items()) if name.startswith("case_")
}


def main():
    out_path, names = sys.argv[1], sys.argv[2:] or list(CASES)
    results = {}
    for name in names:
        keras.backend.clear_session()
        keras.mixed_precision.set_global_policy("float32")
        try:
            results[name] = CASES[name]()
        except Exception as e:  # record, so every other case still reports
            import traceback

            results[name] = {"crashed": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1, default=float)


if __name__ == "__main__":
    main()
