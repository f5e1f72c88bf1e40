"""What measuring the gradient noise scale costs, one process, interleaved.

    python benchmarks/bench_noise_scale.py [--quick] [--rounds N]

Ratios (median, min, max, best over rounds, and `p25`, the ratio of the
25th-percentile steps; each round = `steps` calls of the compiled
`train_function`, timed one by one: `sides.step_fn`):
`GradientNoiseScale` on / off, for `accumulation_steps=4` and for
`micro_batches=4`, on the core MLP (784 -> 3 x 1024 -> 10, batch 256) and a
Conv2D + BatchNorm model (28x28x1, Conv 32 / 64 each followed by
BatchNormalization, batch 128; `--quick`: the MLP with accumulation
only). Target (issue 22): <= 1.03. What it adds
per micro-batch is one squared norm of the gradient it has (per slice with
`micro_batches`) and a 5-vector `assign_add`; per update one squared norm
and scalar maths.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
from bench_core import compiled, mlp  # noqa: E402
from harness import command_line, interleaved_step_ratios, report  # noqa: E402
from sides import dataset_of, step_fn, synthetic  # noqa: E402

import keras_fastgrad  # noqa: E402


def cnn_batchnorm(cls, **options):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((28, 28, 1))
    h = inputs
    for filters in (32, 64):
        h = keras.layers.Conv2D(filters, 3, use_bias=False)(h)
        h = keras.layers.BatchNormalization()(h)
        h = keras.layers.Activation("relu")(h)
        h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Flatten()(h)
    return cls(inputs, keras.layers.Dense(10)(h), **options)


MODELS = {"mlp": (mlp, (784,), 256), "cnn_batchnorm": (cnn_batchnorm, (28, 28, 1), 128)}
OPTIONS = {"acc=4": {"accumulation_steps": 4}, "micro_batches=4": {"micro_batches": 4}}


def main(argv=None):
    args, rounds, steps, names = command_line(
        __doc__, (6, 16), (16, 32), list(MODELS), quick_models=["mlp"], argv=argv
    )
    options_run = {"acc=4": OPTIONS["acc=4"]} if args.quick else OPTIONS
    fg = keras_fastgrad.FastGradModel
    pairs = []
    for name in names:
        build, shape, batch = MODELS[name]
        data = dataset_of(*synthetic(shape, 10, batch * 8), batch)
        for label, options in options_run.items():
            adam = keras.optimizers.Adam
            off = step_fn(compiled(build(fg, **options), adam()), data, steps)
            measuring = compiled(build(fg, **options), adam())
            # What `GradientNoiseScale` asks of the step when attached.
            measuring.enable_telemetry(keras_fastgrad.callbacks.GradientNoiseScale.telemetry_keys)
            on = step_fn(measuring, data, steps)
            pairs.append((f"{name}: noise scale on / off ({label})", on, off))
    results = interleaved_step_ratios(pairs, rounds)
    report(
        f"Gradient noise scale step-time ratios ({rounds} rounds x {steps} steps)",
        results,
        dict.fromkeys(results, "<= 1.03"),
        "noise_scale",
    )


if __name__ == "__main__":
    main()
