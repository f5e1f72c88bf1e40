"""Step-level models (issue 21): builders, data and optimizers per model.

Its ratios (default, `clip_norm` and accumulation against `keras.Model`,
step by step) are rows of `bench_targets` (issue 28's table), and the
BatchNorm statistics row is in `bench_core`; this module keeps the models
they were measured on, for the scripts that import them. `run_all` runs
only scripts with a `main`: this one has none.

Models: `mlp_64x256_b64` (MLP 64 -> 3 x 256 -> 10, batch 64, Adam: about
1-2 ms a step on a quiet 2-core machine, where any fixed cost shows),
`mlp_256x1024_b64` (256 -> 3 x 1024 -> 10, batch 64, Adam), `embedding`
(bench_embedding's recommender: a 1M x 32 table, sparse gradients, SGD,
"mse", batch 32), `cnn_bn` (bench_core's CNN with BatchNormalization,
batch 128). `MODELS[name]` is `(make, dataset, optimizer class, batch)`:
`make(cls, optimizer, **options)` a compiled model, `dataset(batch)` a
`tf.data.Dataset` of whole batches.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
from bench_core import cnn_bn, compiled, dense_stack  # noqa: E402
from bench_embedding import data as embedding_data  # noqa: E402
from bench_embedding import recommender  # noqa: E402
from harness import dataset_of, synthetic  # noqa: E402


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
