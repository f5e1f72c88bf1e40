"""Cost of the keras_fastgrad callbacks, side by side in one process.

    python benchmarks/bench_callbacks.py [--quick] [--models a,b] [--rounds N]

Step-time ratios: each side's compiled train function, built by a `fit`
with the callbacks attached and timed step by step (`sides.step_fn`),
interleaved in blocks of 4 steps (`harness.interleaved_step_ratios`: the
ratio of median steps judged, `p25` and `best` beside it). What a callback puts into the step is
timed; its per-batch Python work in `fit` is not. On bench_core's models
`mlp_64x256_b64` (64 -> 3 x 256 -> 10, batch 64, ~1.5 ms a step, where a
fixed cost shows most; `--quick` runs only this one), `mlp` (784 -> 3 x
1024 -> 10, batch 256) and `cnn` (28x28x1, Conv2D 32/64, batch 128):

- all callbacks / none: FastGradModel with GradientNormLogger,
  NonFiniteGuard, TapeVariableCounter and RetraceWatch (default options) /
  the same FastGradModel without callbacks.                 target <= 1.05
- NaN detection: FastGradModel + NonFiniteGuard / keras.Model with
  `tf.debugging.enable_check_numerics()`.                   lower is better
- for context: keras.Model with check_numerics / keras.Model.

`clip_norm` with GradientNormLogger, NonFiniteGuard and TapeVariableCounter
against Keras' `global_clipnorm` is a row of `bench_targets`.

`enable_check_numerics` is global: the check_numerics model is traced while
it is on and it is switched off right after, so its graph keeps the checks
(verified after the timing: a NaN batch raises) while every other model's
graph has none, and all can be timed interleaved.

Writes benchmarks/out/callbacks.json.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from bench_core import MODELS  # noqa: E402  (the core benchmark's MLP and CNN)
from harness import command_line, interleaved_step_ratios, report  # noqa: E402
from sides import dataset_of, step_fn, synthetic  # noqa: E402

import keras_fastgrad  # noqa: E402
from keras_fastgrad import callbacks as fg_callbacks  # noqa: E402


def all_callbacks():
    return [
        fg_callbacks.GradientNormLogger(),
        fg_callbacks.NonFiniteGuard("raise"),
        fg_callbacks.TapeVariableCounter(),
        fg_callbacks.RetraceWatch(),
    ]


def compiled(model, **optimizer_options):
    model.compile(
        optimizer=keras.optimizers.Adam(1e-4, **optimizer_options),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def raises_on_nan(model, x, y, batch, callbacks=(), error=Exception):
    bad = x[:batch].copy()
    bad[0].flat[0] = np.nan
    try:
        model.fit(bad, y[:batch], batch_size=batch, verbose=0, callbacks=list(callbacks))
    except error:
        return True
    return False


def main(argv=None):
    models = ["mlp_64x256_b64", "mlp", "cnn"]
    _, rounds, steps, names = command_line(
        __doc__, (6, 24), (16, 48), models, quick_models=models[:1], argv=argv
    )
    fast = keras_fastgrad.FastGradModel
    pairs, targets, checks = [], {}, []
    for name in names:
        build, shape, batch = MODELS[name]
        x, y = synthetic(shape, 10, batch * 8)
        data = dataset_of(x, y, batch)
        with_callbacks = step_fn(compiled(build(fast)), data, steps, all_callbacks())
        without = step_fn(compiled(build(fast)), data, steps)
        guard = [fg_callbacks.NonFiniteGuard("raise")]
        guarded_model = compiled(build(fast))
        guarded = step_fn(guarded_model, data, steps, guard)
        plain = step_fn(compiled(build(keras.Model)), data, steps)
        tf.debugging.enable_check_numerics()
        try:
            checked_model = compiled(build(keras.Model))
            checked = step_fn(checked_model, data, steps)
        finally:
            tf.debugging.disable_check_numerics()
        checks.append((name, checked_model, guarded_model, guard, x, y, batch))
        callbacks_row = f"{name}: all callbacks / none (FastGradModel)"
        pairs += [
            (callbacks_row, with_callbacks, without),
            (
                f"{name}: FastGradModel+NonFiniteGuard / keras.Model+check_numerics",
                guarded,
                checked,
            ),
            (f"{name}: keras.Model+check_numerics / keras.Model", checked, plain),
        ]
        targets[callbacks_row] = "<= 1.05"
    results = interleaved_step_ratios(pairs, rounds)
    # After the timing: a NaN batch can leave NaN in check_numerics' weights.
    for name, checked_model, guarded_model, guard, x, y, batch in checks:
        if not raises_on_nan(checked_model, x, y, batch, error=tf.errors.InvalidArgumentError):
            raise RuntimeError(f"{name}: check_numerics instrumentation was lost")
        if not raises_on_nan(guarded_model, x, y, batch, guard, error=fg_callbacks.NonFiniteError):
            raise RuntimeError(f"{name}: NonFiniteGuard missed the NaN batch")
    report(
        f"keras_fastgrad callbacks, step-time ratios ({rounds} rounds x {steps} steps)",
        results,
        targets,
        "callbacks",
    )


if __name__ == "__main__":
    main()
