"""Cost of adaptive gradient clipping (issue 22): AGC's own time, isolated.

    python benchmarks/bench_adaptive_clipping.py [--quick] [--models a,b]

The step-time ratios `clip_adaptive=0.01 / FastGradModel default` are
rows of `bench_targets` (issue 28's table: <= 1.03 on Conv2D+BN and the
Transformer, <= 1.06 on the dense MLP). This script gives what those
ratios cannot separate from the noise of a shared machine: AGC's own
time, `clip_unitwise` on the model's weights and gradients of their
shapes (10 applications chained in one `tf.function`, best of 30 calls,
divided by 10), over the default model's fastest step (`sides.step_fn`,
the best of 3 rounds). Not a step ratio: it leaves out what the step adds
around AGC, but is robust to the load. Target: <= 0.03. Models: the
benchmark MLP of bench_core (784 -> 3 x 1024 -> 10, batch 256), its
short-step case (64 -> 3 x 256 -> 10, batch 64), bench_targets' 14 ms MLP
(256 -> 3 x 1024 -> 10, batch 64) and a Conv2D + BatchNorm
model (32x32x3, three Conv-BN-ReLU blocks of 32/64/64 channels, batch 64);
`--quick`: the last two.

Writes benchmarks/out/adaptive_clipping.json.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from bench_core import dense_stack, mlp  # noqa: E402
from harness import command_line, report, time_call  # noqa: E402
from sides import dataset_of, step_fn, synthetic  # noqa: E402

import keras_fastgrad  # noqa: E402
from keras_fastgrad.backend.tensorflow.adaptive_clipping import clip_unitwise  # noqa: E402
from keras_fastgrad.step.adaptive_clipping import row_unit_variables  # noqa: E402

CHAIN = 10


def isolated_seconds(model):
    """AGC's own time per update on `model`'s weights (best of 30)."""
    variables = model.trainable_variables
    tables = row_unit_variables(model)
    rows = [id(v) in tables for v in variables]
    grads = [tf.random.normal(v.shape) * 1e-2 for v in variables]

    @tf.function
    def chained(grads):
        for _ in range(CHAIN):
            grads = clip_unitwise(
                grads, [v.value for v in variables], rows, 0.01, count=False
            ).grads
        return tf.add_n([tf.reduce_sum(g) for g in grads])

    chained(grads)
    return min(time_call(lambda: chained(grads).numpy()) for _ in range(30)) / CHAIN


def conv_bn(cls, **options):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((32, 32, 3))
    h = inputs
    for i, filters in enumerate((32, 64, 64)):
        h = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(h)
        h = keras.layers.BatchNormalization()(h)
        h = keras.layers.ReLU()(h)
        if i < 2:
            h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    return cls(inputs, keras.layers.Dense(10)(h), **options)


# name: (builder, input shape, batch, steps multiplier)
MODELS = {
    "mlp": (mlp, (784,), 256, 1),
    "mlp_64x256_b64": (dense_stack(64, 256), (64,), 64, 16),
    # bench_targets' 14 ms MLP, whose AGC on / off row is not met
    "mlp_256x1024_b64": (dense_stack(256, 1024), (256,), 64, 4),
    "conv_bn": (conv_bn, (32, 32, 3), 64, 1),
}


def main(argv=None):
    _, _, steps, names = command_line(
        __doc__,
        (1, 8),
        (1, 32),
        list(MODELS),
        quick_models=["mlp_64x256_b64", "conv_bn"],
        argv=argv,
    )
    fg = keras_fastgrad.FastGradModel
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    results = {}
    for name in names:
        build, shape, batch, longer = MODELS[name]
        data = dataset_of(*synthetic(shape, 10, batch * 8), batch)
        model = build(fg)
        model.compile(optimizer=keras.optimizers.Adam(), loss=loss)
        default = step_fn(model, data, steps * longer)
        step = min(min(default()) for _ in range(3))
        agc = isolated_seconds(model)
        results[f"{name}: AGC alone / default step (isolated)"] = {
            "median": agc / step,
            "min": agc / step,
            "max": agc / step,
            "rounds": 1,
            "kind": "AGC alone over the fastest step",
            "seconds": [agc, step],
        }
        keras.backend.clear_session()
    report(
        "Adaptive gradient clipping: AGC's own time over a step (isolated)",
        results,
        dict.fromkeys(results, "<= 0.03"),
        "adaptive_clipping",
    )


if __name__ == "__main__":
    main()
