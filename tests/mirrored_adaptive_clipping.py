"""Adaptive clipping under MirroredStrategy (2 logical CPUs): a case of
distributed_cases.py (the process that sets the devices up), asserted by
end_to_end/test_distributed.py.

Each case: one update of a FastGradModel(clip_adaptive=lam) under the
strategy on a global batch, against the plain keras.Model's gradient of
that batch (single device), clipped by `helpers.np_agc`, then one SGD step
in numpy. Clipping each replica's gradient before the sum would differ.
"""

import os

import keras
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
from tests.end_to_end.test_adaptive_clipping_fit import (  # noqa: E402
    FG,
    LR,
    dense,
    embedding,
    keras_gradient,
    median_lambda,
    reference_step,
    tokens,
)
from tests.helpers import data  # noqa: E402


def case(strategy, build, x, y, **options):
    ref = build(keras.Model)
    grads = keras_gradient(ref, x, y, "mse")
    lam = median_lambda(ref, grads)
    expected, n_clipped = reference_step(ref, grads, lam)
    with strategy.scope():
        model = build(FG, clip_adaptive=lam, **options)
        model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    steps = options.get("accumulation_steps", 1)
    model.fit(x, y, batch_size=len(x) // steps, shuffle=False, verbose=0)
    return {
        "n_clipped": n_clipped,
        "updates": int(model.optimizer.iterations.numpy()),
        "max_diff": max(
            float(np.max(np.abs(v.numpy() - e)))
            for v, e in zip(model.trainable_variables, expected)
        ),
    }


def results(strategy):
    x, y = data(n=8, outputs=2)
    t, u = tokens()
    return {
        "dense": case(strategy, dense, x, y),
        "dense_acc2": case(strategy, dense, x, y, accumulation_steps=2),
        "embedding": case(strategy, embedding, t, u),
    }
