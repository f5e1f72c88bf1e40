"""The step's own cost (issue 21), step by step: `train_function` timed alone.

    python benchmarks/bench_steps.py [--quick] [--models a,b] [--rounds N]

`bench_core` and `bench_embedding` time epochs of `fit`, whose own Python
work per epoch and per batch is the same on both sides of a ratio and
dilutes it. Here each side's compiled `train_function` (what `fit` calls
per batch) runs alone on a repeating `tf.data` pipeline, and every step
is timed: `harness.step_fn`. Rounds of 48 steps (whole windows of 4),
interleaved, the order of the two sides alternating. Per pair: the median,
min and max of the per-round ratios, the ratio of each side's best round
and `p25`, the ratio of each side's 25th-percentile step over all rounds
(what a step costs when nothing else takes the cores).

Pairs, on each model:
- FastGradModel default / keras.Model                          <= 1.03
- FastGradModel(clip_norm=1) / optimizer(global_clipnorm=1)    <= 1.05
- FastGradModel(accumulation_steps=4) /
  optimizer(gradient_accumulation_steps=4)                     <= 1.02
Models: `mlp_64x256_b64` (MLP 64 -> 3 x 256 -> 10, batch 64, Adam: about
1-2 ms a step on a quiet 2-core machine, where any fixed cost shows),
`mlp_256x1024_b64` (256 -> 3 x 1024 -> 10, batch 64, Adam: about 8-10
ms), `embedding` (bench_embedding's recommender: a 1M x 32 table, sparse
gradients, SGD, "mse", batch 32; default target <= 1.05). `cnn_bn`
(bench_core's CNN with BatchNormalization, batch 128) has one pair, issue
22's budget: BatchNorm statistics of the window / per micro-batch
(`batchnorm_statistics`, accumulation 4), target <= 1.03.

Writes benchmarks/out/steps.json.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
from bench_core import cnn_bn, compiled, dense_stack  # noqa: E402
from bench_embedding import data as embedding_data  # noqa: E402
from bench_embedding import recommender  # noqa: E402
from harness import (  # noqa: E402
    command_line,
    dataset_of,
    interleaved_step_ratios,
    report,
    step_fn,
    synthetic,
)

import keras_fastgrad  # noqa: E402

STEPS = 48  # whole windows of 4


def classifier(features, width):
    build = dense_stack(features, width)

    def make(cls, optimizer, **options):
        model = build(cls, **options)
        model.compile(
            optimizer=optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        return model

    def dataset(batch):
        return dataset_of(*synthetic((features,), 10, batch * 16), batch)

    return make, dataset, keras.optimizers.Adam


def batchnorm_cnn():
    """bench_core's CNN with a BatchNormalization after each convolution."""

    def make(cls, optimizer, **options):
        return compiled(cnn_bn(cls, **options), optimizer)

    def dataset(batch):
        return dataset_of(*synthetic((28, 28, 1), 10, batch * 8), batch)

    return make, dataset, keras.optimizers.Adam


def embedding():
    def make(cls, optimizer, **options):
        model = recommender(cls, **options)
        model.compile(optimizer=optimizer, loss="mse")
        return model

    def dataset(batch):
        return dataset_of(*embedding_data(batch * 16), batch)

    return make, dataset, lambda **kw: keras.optimizers.SGD(0.01, **kw)


# name: (make, dataset, optimizer class, batch)
MODELS = {
    "mlp_64x256_b64": (*classifier(64, 256), 64),
    "mlp_256x1024_b64": (*classifier(256, 1024), 64),
    "embedding": (*embedding(), 32),
    "cnn_bn": (*batchnorm_cnn(), 128),
}


def main():
    _, rounds, steps, names = command_line(
        __doc__,
        (8, STEPS // 2),
        (24, STEPS),
        list(MODELS),
        quick_models=["mlp_64x256_b64", "mlp_256x1024_b64"],
    )
    fg = keras_fastgrad.FastGradModel
    results, targets = {}, {}
    for name in names:
        make, dataset, optimizer, batch = MODELS[name]
        data = dataset(batch)

        def timed(cls, opt_kwargs=None, **options):
            model = make(cls, optimizer(**(opt_kwargs or {})), **options)
            return step_fn(model, data, steps)

        if name == "cnn_bn":  # issue 22's budget: one pair
            window = f"{name}: BatchNorm window / micro_batch statistics (acc=4)"
            results.update(
                interleaved_step_ratios(
                    [
                        (
                            window,
                            timed(fg, accumulation_steps=4),
                            timed(fg, accumulation_steps=4, batchnorm_statistics="micro_batch"),
                        )
                    ],
                    rounds,
                )
            )
            targets[window] = "<= 1.03"
            continue
        pairs = [
            (
                f"{name}: FastGradModel default / keras.Model",
                timed(fg),
                timed(keras.Model),
            ),
            (
                f"{name}: FastGradModel(clip_norm=1) / global_clipnorm=1",
                timed(fg, clip_norm=1.0),
                timed(keras.Model, {"global_clipnorm": 1.0}),
            ),
            (
                f"{name}: FastGradModel(acc=4) / gradient_accumulation_steps=4",
                timed(fg, accumulation_steps=4),
                timed(keras.Model, {"gradient_accumulation_steps": 4}),
            ),
        ]
        results.update(interleaved_step_ratios(pairs, rounds))
        targets.update(
            {
                pairs[0][0]: "<= 1.05" if name == "embedding" else "<= 1.03",
                pairs[1][0]: "<= 1.05",
                pairs[2][0]: "<= 1.02",
            }
        )
    report(
        f"Step-time ratios, train_function alone ({rounds} rounds x {steps} steps)",
        results,
        targets,
        "steps",
    )
    print("median step (ms), FastGradModel / Keras side:")
    for key, stats in results.items():
        print(f"  {key:58s} {stats['step_ms'][0]:7.3f} / {stats['step_ms'][1]:7.3f}")


if __name__ == "__main__":
    main()
