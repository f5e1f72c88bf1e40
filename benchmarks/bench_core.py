"""Core step-time ratios of FastGradModel (issue: core), one process, interleaved.

    python benchmarks/bench_core.py [--quick]

Ratios (median, min, max over rounds; each round = one epoch of `steps`
batches through `fit`, after a warm-up fit that excludes tracing):
- FastGradModel default / keras.Model                         target <= 1.03
- FastGradModel(accumulation_steps=4) / keras.Model with
  Adam(gradient_accumulation_steps=4)                         target <= 1.00
- FastGradModel(clip_norm=1) / keras.Model with
  Adam(global_clipnorm=1)                                     target <= 1.05
- telemetry on / off (FastGradModel, accumulation 4)          target <= 1.05
- BatchNorm statistics of the window / per micro-batch
  (`batchnorm_statistics`, accumulation 4; cnn_bn only)       target <= 1.03
on an MLP (784 -> 3 x 1024 -> 10, batch 256), the fixed-cost cases of
issue 13 (MLP 256 -> 3 x 1024 -> 10 at batch 64, about 8 ms a step on a
quiet 2-core machine; MLP 64 -> 3 x 256 -> 10 at batch 64, about 1 ms a
step, where any per-step overhead shows), a small CNN (28x28x1, Conv
32/64, batch 128) and the same CNN with a BatchNormalization after each
convolution (`cnn_bn`). `--models a,b` picks some of them.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
from harness import command_line, fit_fn, interleaved_ratios, report, synthetic  # noqa: E402

import keras_fastgrad  # noqa: E402


def dense_stack(features, width):
    def build(cls, **options):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((features,))
        h = inputs
        for _ in range(3):
            h = keras.layers.Dense(width, activation="relu")(h)
        return cls(inputs, keras.layers.Dense(10)(h), **options)

    return build


mlp = dense_stack(784, 1024)


def cnn(cls, **options):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((28, 28, 1))
    h = keras.layers.Conv2D(32, 3, activation="relu")(inputs)
    h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Conv2D(64, 3, activation="relu")(h)
    h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Flatten()(h)
    return cls(inputs, keras.layers.Dense(10)(h), **options)


def cnn_bn(cls, **options):
    """The CNN with a BatchNormalization after each convolution."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((28, 28, 1))
    h = inputs
    for filters in (32, 64):
        h = keras.layers.Conv2D(filters, 3)(h)
        h = keras.layers.BatchNormalization()(h)
        h = keras.layers.MaxPooling2D()(keras.layers.Activation("relu")(h))
    h = keras.layers.Flatten()(h)
    return cls(inputs, keras.layers.Dense(10)(h), **options)


# name: (builder, input shape, batch, steps multiplier: short steps get
# longer epochs so that fit's own per-call cost does not dilute the ratio)
MODELS = {
    "mlp": (mlp, (784,), 256, 1),
    "mlp_256x1024_b64": (dense_stack(256, 1024), (256,), 64, 4),
    "mlp_64x256_b64": (dense_stack(64, 256), (64,), 64, 16),
    "cnn": (cnn, (28, 28, 1), 128, 1),
    "cnn_bn": (cnn_bn, (28, 28, 1), 128, 1),
}


def compiled(model, optimizer):
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def main():
    _, rounds, steps, names = command_line(
        __doc__, (5, 8), (12, 16), list(MODELS), quick_models=["mlp", "cnn", "cnn_bn"]
    )
    fg = keras_fastgrad.FastGradModel
    results = {}
    for name in names:
        build, shape, batch, longer = MODELS[name]
        x, y = synthetic(shape, 10, batch * steps * longer)
        adam = keras.optimizers.Adam
        plain = fit_fn(compiled(build(keras.Model), adam()), x, y, batch)
        default = fit_fn(compiled(build(fg), adam()), x, y, batch)
        keras_acc = fit_fn(
            compiled(build(keras.Model), adam(gradient_accumulation_steps=4)), x, y, batch
        )
        fg_acc = fit_fn(compiled(build(fg, accumulation_steps=4), adam()), x, y, batch)
        fg_acc_tel = fit_fn(
            compiled(build(fg, accumulation_steps=4, telemetry=True), adam()), x, y, batch
        )
        keras_clip = fit_fn(compiled(build(keras.Model), adam(global_clipnorm=1.0)), x, y, batch)
        fg_clip = fit_fn(compiled(build(fg, clip_norm=1.0), adam()), x, y, batch)
        pairs = [
            (f"{name}: FastGradModel default / keras.Model", default, plain),
            (f"{name}: FastGradModel(clip_norm=1) / Adam(global_clipnorm=1)", fg_clip, keras_clip),
            (f"{name}: FastGradModel(acc=4) / Adam(grad_acc_steps=4)", fg_acc, keras_acc),
            (f"{name}: telemetry on / off (acc=4)", fg_acc_tel, fg_acc),
        ]
        if name == "cnn_bn":  # issue 22: the statistics of the window
            per_micro_batch = fit_fn(
                compiled(
                    build(fg, accumulation_steps=4, batchnorm_statistics="micro_batch"), adam()
                ),
                x,
                y,
                batch,
            )
            pairs.append(
                (
                    f"{name}: BatchNorm window / micro_batch statistics (acc=4)",
                    fg_acc,
                    per_micro_batch,
                )
            )
        results.update(interleaved_ratios(pairs, rounds))
    targets = {}
    for name in results:
        targets[name] = (
            "<= 1.03"
            if "default" in name or "BatchNorm" in name
            else ("<= 1.00" if "grad_acc" in name else "<= 1.05")  # clip_norm, telemetry
        )
    report(
        f"FastGradModel core step-time ratios ({rounds} rounds x {steps} steps)",
        results,
        targets,
        "core",
    )


if __name__ == "__main__":
    main()
