"""Cost of adaptive gradient clipping (issue 22): step-time ratios, interleaved.

    python benchmarks/bench_adaptive_clipping.py [--quick] [--models a,b]

Ratio per model: FastGradModel(clip_adaptive=0.01) / FastGradModel default,
each round one epoch of `steps` batches through `fit` (after a warm-up fit
that excludes tracing), median, min, max over rounds and best of rounds
(`harness.interleaved_ratios`). Target: <= 1.03 (AGC costs at most 3% of a
step). Models: the benchmark MLP of bench_core (784 -> 3 x 1024 -> 10,
batch 256), its short-step case (64 -> 3 x 256 -> 10, batch 64, about 1 ms
a step, where any fixed cost shows) and a Conv2D + BatchNorm model
(32x32x3, three Conv-BN-ReLU blocks of 32/64/64 channels, batch 64).

Writes benchmarks/out/adaptive_clipping.json.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
from bench_core import dense_stack, mlp  # noqa: E402
from harness import fit_fn, interleaved_ratios, report, synthetic  # noqa: E402

import keras_fastgrad  # noqa: E402


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
    "conv_bn": (conv_bn, (32, 32, 3), 64, 1),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args()
    rounds, steps = (5, 8) if args.quick else (12, 16)
    rounds = args.rounds or rounds
    fg = keras_fastgrad.FastGradModel
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    pairs = []
    for name in args.models.split(","):
        build, shape, batch, longer = MODELS[name]
        x, y = synthetic(shape, 10, batch * steps * longer)
        sides = []
        for options in ({}, {"clip_adaptive": 0.01}):
            model = build(fg, **options)
            model.compile(optimizer=keras.optimizers.Adam(), loss=loss)
            sides.append(fit_fn(model, x, y, batch))
        pairs.append((f"{name}: clip_adaptive=0.01 / FastGradModel default", sides[1], sides[0]))
    results = interleaved_ratios(pairs, rounds)
    report(
        f"Adaptive gradient clipping step-time ratios ({rounds} rounds x {steps} steps)",
        results,
        dict.fromkeys(results, "<= 1.03"),
        "adaptive_clipping",
    )


if __name__ == "__main__":
    main()
