"""Embedding step-time ratios of FastGradModel (large sparse table), one process, interleaved.

    python benchmarks/bench_embedding.py [--quick]

Model, as a user recommending items would have: `Input((20,), int32)` ->
`Embedding(1_000_000, 32)` -> `GlobalAveragePooling1D` -> `Dense(1)`, loss
"mse", `SGD(0.01)`, batch 32, item ids drawn uniformly from [0, 1_000_000)
with a fixed seed (about 640 of the 1M rows are touched per step, so the
table's gradient is sparse: `tf.IndexedSlices`), float targets.

Step-time ratios (`sides.step_fn`: each side's compiled train function
timed step by step; `harness.interleaved_step_ratios`: interleaved rounds,
the median judged, `p25` and `best` beside it):
- FastGradModel(clip_norm=1) / keras.Model with
  SGD(global_clipnorm=1)                                      target <= 1.05
- FastGradModel(accumulation_steps=4) / keras.Model with
  SGD(gradient_accumulation_steps=4)                          reported
`default / keras.Model` (<= 1.05 in every run) and the accumulation
targets against Keras' (gated) accumulation are rows of `bench_targets`.
Every model is built after `keras.utils.set_random_seed(0)`. Each holds a
1M x 32 float32 table (128 MB) plus optimizer / accumulator state; the four
models fit easily in a few GB. Writes benchmarks/out/embedding.json.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from harness import command_line, interleaved_step_ratios, report  # noqa: E402
from sides import dataset_of, step_fn  # noqa: E402

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


def main(argv=None):
    _, rounds, steps = command_line(__doc__, (4, 8), (16, 48), argv=argv)[:3]
    fg = keras_fastgrad.FastGradModel
    sgd = keras.optimizers.SGD
    batches = dataset_of(*data(BATCH * 16), BATCH)

    def pair(fg_options, keras_options):
        fast = step_fn(compiled(recommender(fg, **fg_options), sgd(0.01)), batches, steps)
        base = step_fn(
            compiled(recommender(keras.Model), sgd(0.01, **keras_options)), batches, steps
        )
        return fast, base

    clip = "embedding: FastGradModel(clip_norm=1) / SGD(global_clipnorm=1)"
    pairs = [
        (clip, *pair({"clip_norm": 1.0}, {"global_clipnorm": 1.0})),
        (
            "embedding: FastGradModel(accumulation_steps=4) / SGD(gradient_accumulation_steps=4)",
            *pair({"accumulation_steps": 4}, {"gradient_accumulation_steps": 4}),
        ),
    ]
    report(
        f"FastGradModel embedding step-time ratios ({rounds} rounds x {steps} steps, "
        f"Embedding({VOCAB:_}, {DIM}), batch {BATCH})",
        interleaved_step_ratios(pairs, rounds),
        {clip: "<= 1.05"},
        "embedding",
    )


if __name__ == "__main__":
    main()
