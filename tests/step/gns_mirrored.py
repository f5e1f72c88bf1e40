"""The noise scale under `MirroredStrategy` (2 logical CPUs): a case of
distributed_cases.py (the process that sets the devices up), asserted by
end_to_end/test_distributed.py.

Each replica's micro-batch is a small batch, the replicas' sum the big
one; Keras gives each replica a contiguous half of the global batch. Returns
the step's `gns_*` logs and the numpy reference (`gns_reference.py`)."""

import keras
import numpy as np

import keras_fastgrad  # noqa: E402
from tests.step import gns_reference as ref  # noqa: E402

DECAY = 0.6


def build(plain, **options):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(7, activation="tanh")(inputs)
    outputs = keras.layers.Dense(2)(hidden)
    if plain:
        return keras.Model(inputs, outputs)
    return keras_fastgrad.FastGradModel(inputs, outputs, **options)


def case(strategy, plain, batch_size, windows, **options):
    rng = np.random.default_rng(1)
    rows = sum(sum(w) for w in windows)
    x = rng.normal(size=(rows, 5)).astype("float32")
    y = rng.normal(size=(rows, 2)).astype("float32")
    with strategy.scope():
        model = build(plain, **options)
        model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    history = model.fit(
        x,
        y,
        batch_size=batch_size,
        shuffle=False,
        verbose=0,
        callbacks=[keras_fastgrad.callbacks.GradientNoiseScale(decay=DECAY, verbose=0)],
    )
    small, start = [], 0
    for window in windows:
        small.append(ref.split(x[start:], y[start:], window))
        start += sum(window)
    reference = ref.noise_scale(build(True), keras.losses.MeanSquaredError(), small, DECAY)
    logs = [history.history[k][-1] for k in ("gns_simple", "gns_grad_sq", "gns_trace")]
    return {"step": logs, "reference": list(reference)}


def results(strategy):
    return {
        # each batch of 16: two replicas of 8 rows
        "replicas": case(strategy, False, 16, [[8, 8]] * 3),
        # a plain keras.Model: the replicas are its two batch sizes
        "plain_keras_model": case(strategy, True, 16, [[8, 8]] * 3),
        # windows of 2 batches x 2 replicas; the last batch of 12 splits 6 + 6
        "replicas_and_accumulation": case(
            strategy, False, 16, [[8, 8, 8, 8], [8, 8, 6, 6]], accumulation_steps=2
        ),
    }
