"""Embedding step-time ratios of FastGradModel (large sparse table), one process, interleaved.

    python benchmarks/bench_embedding.py [--quick]

Model, as a user recommending items would have: `Input((20,), int32)` ->
`Embedding(1_000_000, 32)` -> `GlobalAveragePooling1D` -> `Dense(1)`, loss
"mse", `SGD(0.01)`, batch 32, item ids drawn uniformly from [0, 1_000_000)
with a fixed seed (about 640 of the 1M rows are touched per step, so the
table's gradient is sparse: `tf.IndexedSlices`), float targets.

Ratios (median, min, max over rounds; each round = one epoch of `steps`
batches through `fit`, `shuffle=False`, after a warm-up fit that excludes
tracing):
- FastGradModel default / keras.Model                         target <= 1.05
- FastGradModel(clip_norm=1) / keras.Model with
  SGD(global_clipnorm=1)                                      target <= 1.00
- FastGradModel(accumulation_steps=4) / keras.Model with
  SGD(gradient_accumulation_steps=4)                          target <= 1.00
Every model is built after `keras.utils.set_random_seed(0)`. Each holds a
1M x 32 float32 table (128 MB) plus optimizer / accumulator state; the six
models fit easily in a few GB. Writes benchmarks/out/embedding.json.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from harness import fit_fn, interleaved_ratios, report  # noqa: E402

import keras_fastgrad  # noqa: E402

VOCAB, DIM, LENGTH, BATCH = 1_000_000, 32, 20, 32


def recommender(cls, **options):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((LENGTH,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, DIM)(inputs)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return cls(inputs, keras.layers.Dense(1)(h), **options)


def data(n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, VOCAB, size=(n, LENGTH)).astype("int32")
    y = rng.normal(size=(n, 1)).astype("float32")
    return x, y


def compiled(model, optimizer):
    model.compile(optimizer=optimizer, loss="mse")
    return model


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    rounds, steps = (5, 16) if args.quick else (12, 32)
    fg = keras_fastgrad.FastGradModel
    sgd = keras.optimizers.SGD
    x, y = data(BATCH * steps)

    def pair(fg_options, keras_options):
        fast = fit_fn(compiled(recommender(fg, **fg_options), sgd(0.01)), x, y, BATCH)
        base = fit_fn(compiled(recommender(keras.Model), sgd(0.01, **keras_options)), x, y, BATCH)
        return fast, base

    default, plain = pair({}, {})
    fg_clip, keras_clip = pair({"clip_norm": 1.0}, {"global_clipnorm": 1.0})
    fg_acc, keras_acc = pair({"accumulation_steps": 4}, {"gradient_accumulation_steps": 4})
    pairs = [
        ("embedding: FastGradModel default / keras.Model", default, plain),
        ("embedding: FastGradModel(clip_norm=1) / SGD(global_clipnorm=1)", fg_clip, keras_clip),
        (
            "embedding: FastGradModel(accumulation_steps=4) / SGD(gradient_accumulation_steps=4)",
            fg_acc,
            keras_acc,
        ),
    ]
    results = interleaved_ratios(pairs, rounds)
    targets = {}
    for name in results:
        targets[name] = "<= 1.05" if "default" in name else "<= 1.00"
    report(
        f"FastGradModel embedding step-time ratios ({rounds} rounds x {steps} steps, "
        f"Embedding({VOCAB:_}, {DIM}), batch {BATCH})",
        results,
        targets,
        "embedding",
    )


if __name__ == "__main__":
    main()
