"""Cost of the keras_fastgrad callbacks, side by side in one process.

    python benchmarks/bench_callbacks.py [--quick]

Ratios (median, min, max over rounds; a round times one epoch of `steps`
batches through `fit(verbose=0)` for each side, the two sides alternating
their order from round to round; a warm-up fit first, so tracing is not
timed), on an MLP (784 -> 3 x 1024 relu -> 10, batch 256) and a small CNN
(28x28x1, Conv2D 32/64 + pooling -> Dense 10, batch 128), synthetic data
from a fixed seed:

- all callbacks / none: FastGradModel with GradientNormLogger,
  NonFiniteGuard, TapeVariableCounter and RetraceWatch (default options) /
  the same FastGradModel without callbacks.                 target <= 1.05
- NaN detection: FastGradModel + NonFiniteGuard / keras.Model with
  `tf.debugging.enable_check_numerics()`.                   lower is better
- for context: keras.Model with check_numerics / keras.Model.
- safety, clipping and monitoring together: FastGradModel(clip_norm=1)
  with GradientNormLogger, NonFiniteGuard and TapeVariableCounter /
  keras.Model (no clipping).                                 target <= 1.06
  and, for context, the same / keras.Model with Adam(global_clipnorm=1).
  Also on the core benchmark's short-step MLP (64 -> 3 x 256 -> 10,
  batch 64, ~2 ms a step), where a fixed cost shows most.

Also printed (and in the JSON as `best_epoch_ratio`): the ratio of each
side's fastest epoch, the estimate least hit by other work on a shared
machine.

`enable_check_numerics` is global: the check_numerics model is traced while
it is on and it is switched off right after, so its graph keeps the checks
(verified after the timing: a NaN batch raises) while every other model's graph has
none, and all can be timed interleaved.

Writes benchmarks/out/callbacks.json.
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from bench_core import MODELS  # noqa: E402  (the core benchmark's MLP and CNN)
from harness import interleaved_ratios, report, synthetic  # noqa: E402

import keras_fastgrad  # noqa: E402
from keras_fastgrad import callbacks as fg_callbacks  # noqa: E402


def all_callbacks():
    return [
        fg_callbacks.GradientNormLogger(),
        fg_callbacks.NonFiniteGuard("raise"),
        fg_callbacks.TapeVariableCounter(),
        fg_callbacks.RetraceWatch(),
    ]


def three_callbacks():
    """Gradient norms, NaN/Inf guard, tape count (issue 21's "all three")."""
    return [
        fg_callbacks.GradientNormLogger(),
        fg_callbacks.NonFiniteGuard("raise"),
        fg_callbacks.TapeVariableCounter(),
    ]


def compiled(model, **optimizer_options):
    model.compile(
        optimizer=keras.optimizers.Adam(1e-4, **optimizer_options),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def fit_fn(model, x, y, batch, callbacks=()):
    def run():
        start = time.perf_counter()
        model.fit(
            x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=list(callbacks)
        )
        run.times.append(time.perf_counter() - start)

    run.times = []
    run()  # warm-up: trace outside the timed rounds
    run.times.clear()
    return run


def raises_on_nan(model, x, y, batch, callbacks=(), error=Exception):
    bad = x[:batch].copy()
    bad[0].flat[0] = np.nan
    try:
        model.fit(bad, y[:batch], batch_size=batch, verbose=0, callbacks=list(callbacks))
    except error:
        return True
    return False


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--quick", action="store_true", help="fewer rounds and steps (about 2 minutes on 2 cores)"
    )
    args = parser.parse_args()
    rounds, steps = (5, 8) if args.quick else (12, 20)
    fast = keras_fastgrad.FastGradModel
    pairs, targets, checks = [], {}, []
    for name in ("mlp", "cnn"):  # the core benchmark's MLP and CNN
        build, shape, batch, _ = MODELS[name]
        x, y = synthetic(shape, 10, batch * steps)
        with_callbacks = fit_fn(compiled(build(fast)), x, y, batch, all_callbacks())
        without = fit_fn(compiled(build(fast)), x, y, batch)
        guard = [fg_callbacks.NonFiniteGuard("raise")]
        guarded_model = compiled(build(fast))
        guarded = fit_fn(guarded_model, x, y, batch, guard)
        plain = fit_fn(compiled(build(keras.Model)), x, y, batch)
        tf.debugging.enable_check_numerics()
        try:
            checked_model = compiled(build(keras.Model))
            checked = fit_fn(checked_model, x, y, batch)
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
    for name in ("mlp", "cnn", "mlp_64x256_b64"):
        build, shape, batch, multiplier = MODELS[name]
        x, y = synthetic(shape, 10, batch * steps * multiplier)
        watched = fit_fn(compiled(build(fast, clip_norm=1.0)), x, y, batch, three_callbacks())
        plain = fit_fn(compiled(build(keras.Model)), x, y, batch)
        keras_clip = fit_fn(compiled(build(keras.Model), global_clipnorm=1.0), x, y, batch)
        row = f"{name}: FastGradModel(clip_norm=1)+3 callbacks / keras.Model"
        pairs += [
            (row, watched, plain),
            (
                f"{name}: FastGradModel(clip_norm=1)+3 callbacks / keras.Model(global_clipnorm=1)",
                watched,
                keras_clip,
            ),
        ]
        targets[row] = "<= 1.06"
    results = interleaved_ratios(pairs, rounds)
    # After the timing: a NaN batch can leave NaN in check_numerics' weights.
    for name, checked_model, guarded_model, guard, x, y, batch in checks:
        if not raises_on_nan(checked_model, x, y, batch, error=tf.errors.InvalidArgumentError):
            raise RuntimeError(f"{name}: check_numerics instrumentation was lost")
        if not raises_on_nan(guarded_model, x, y, batch, guard, error=fg_callbacks.NonFiniteError):
            raise RuntimeError(f"{name}: NonFiniteGuard missed the NaN batch")
    # On a shared machine bursts of other work hit single rounds; the ratio
    # of each side's best epoch is the least disturbed estimate.
    for name, numerator, denominator in pairs:
        results[name]["best_epoch_ratio"] = min(numerator.times) / min(denominator.times)
    report(
        f"keras_fastgrad callbacks: {rounds} rounds of one {steps}-step epoch "
        "per side (ratios of epoch times)",
        results,
        targets,
        "callbacks",
    )
    print(f"\n{'ratio of best epoch times':58s} {'best':>7s}")
    for name, r in results.items():
        print(f"{name:58s} {r['best_epoch_ratio']:7.3f}")


if __name__ == "__main__":
    main()
