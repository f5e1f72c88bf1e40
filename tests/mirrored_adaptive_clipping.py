"""Adaptive clipping under MirroredStrategy (2 logical CPUs), run in a
subprocess by end_to_end/test_adaptive_clipping_fit.py:
`python mirrored_adaptive_clipping.py OUT.json`.

Each case: one update of a FastGradModel(clip_adaptive=lam) under the
strategy on a global batch, against the plain keras.Model's gradient of
that batch (single device), clipped by `helpers.np_agc`, then one SGD step
in numpy. Clipping each replica's gradient before the sum would differ.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "end_to_end")]
from helpers import data  # noqa: E402
from test_adaptive_clipping_fit import (  # noqa: E402
    FG,
    LR,
    dense,
    embedding,
    keras_gradient,
    median_lambda,
    reference_step,
    tokens,
)

STRATEGY = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


def case(build, x, y, **options):
    ref = build(keras.Model)
    grads = keras_gradient(ref, x, y, "mse")
    lam = median_lambda(ref, grads)
    expected, n_clipped = reference_step(ref, grads, lam)
    with STRATEGY.scope():
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


def main(out):
    x, y = data(n=8, outputs=2)
    t, u = tokens()
    result = {
        "dense": case(dense, x, y),
        "dense_acc2": case(dense, x, y, accumulation_steps=2),
        "embedding": case(embedding, t, u),
    }
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
