# How tests/data/*_max_iter_v0.1.0.keras were made (once, by the code of commit
# 3b3f576, exported with `git archive 3b3f576 keras_fastgrad | tar -x -C oldpkg`):
#   PYTHONPATH=oldpkg python tests/data/save_max_iter_models.py tests/data
# Run with PYTHONPATH=<export of commit 3b3f576>: saves UPGrad/DualProj models
# whose configs carry `max_iter` (the format before the exact QP solver).
import os
import sys

import keras

import keras_fastgrad
from keras_fastgrad import aggregators

assert "oldpkg" in keras_fastgrad.__file__, keras_fastgrad.__file__
out = sys.argv[1]
for name, agg in (
    ("upgrad", aggregators.UPGrad(max_iter=150)),
    ("dualproj", aggregators.DualProj(reg_eps=0.0, max_iter=200)),
):
    keras.utils.set_random_seed(7)
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(4, activation="tanh", name="trunk")(inputs)
    outputs = {t: keras.layers.Dense(1, name=t)(hidden) for t in ("a", "b")}
    model = keras_fastgrad.FastGradModel(inputs, outputs, multitask=agg)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss={"a": "mse", "b": "mse"})
    print(name, model.multitask.get_config())
    model.save(os.path.join(out, f"{name}_max_iter_v0.1.0.keras"))
