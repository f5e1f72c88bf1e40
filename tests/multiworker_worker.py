"""One worker of the two-process MultiWorkerMirroredStrategy test.

    TF_CONFIG=... python multiworker_worker.py OUT.npz

Trains FastGradModel(accumulation_steps=2, clip_norm=1.0) on the data of
`helpers.data` and saves its weights and history for the test to compare.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

strategy = tf.distribute.MultiWorkerMirroredStrategy()

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tests.helpers import data, fast  # noqa: E402

OPTIONS = {"accumulation_steps": 2, "clip_norm": 1.0, "telemetry": True}
FIT = {"batch_size": 4, "epochs": 2, "shuffle": False, "verbose": 0}


def training_data():
    x, y = data(n=20)
    return x, y * 10.0  # large gradients: clipping acts


def main():
    x, y = training_data()
    with strategy.scope():
        model = fast(**OPTIONS)
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    history = model.fit(x, y, **FIT)
    np.savez(sys.argv[1], *model.get_weights())
    with open(sys.argv[1] + ".json", "w") as f:
        json.dump(history.history, f)


if __name__ == "__main__":
    main()
