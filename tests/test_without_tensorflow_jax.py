"""keras_fastgrad on Keras' JAX backend without TensorFlow (issue 29): a
JAX user has `keras` and `jax`, TensorFlow is an extra.

Each test runs a fresh Python process: the first makes `tensorflow`
unimportable (a `sys.meta_path` finder installed before anything is
imported), the second leaves it installed and checks that it is not
imported. The references are a plain `keras.Model` trained in the same
process (Keras' own clipping on the equivalent big batch) and the trained
model itself (the loaded file's predictions)."""

import json
import os

from tests.subprocesses import run_python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Refuses `tensorflow` and its submodules, and records who asked (Keras'
# own saving probes for TensorFlow, and goes on without it).
_BLOCK = """
import sys, traceback


class NoTensorFlow:
    refused = []

    def find_spec(self, name, path=None, target=None):
        if name == "tensorflow" or name.startswith("tensorflow."):
            frames = [f for f in traceback.extract_stack() if "keras_fastgrad" in f.filename]
            where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "keras"
            self.refused.append(where)
            raise ImportError(f"No module named {name!r} (blocked by the test)")
        return None


BLOCK = NoTensorFlow()
sys.meta_path.insert(0, BLOCK)
"""

_FIT_SAVE_LOAD = """
import json, os
import numpy as np
import keras
import keras_fastgrad

imported_tf = "tensorflow" in sys.modules
rng = np.random.default_rng(0)
x = rng.normal(size=(16, 3)).astype("float32")
y = rng.normal(size=(16, 2)).astype("float32")


def mlp(cls, **options):
    keras.utils.set_random_seed(7)
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(4, activation="tanh")(inputs)
    return cls(inputs, keras.layers.Dense(2)(hidden), **options)


# accumulation 2 of batches of 4, clipped to 0.05 (it clips: the first
# gradient's norm is ~1) == Keras on batches of 8 with `global_clipnorm`.
model = mlp(keras_fastgrad.FastGradModel, accumulation_steps=2, clip_norm=0.05)
model.compile(keras.optimizers.SGD(0.1), "mse")
logger = keras_fastgrad.callbacks.GradientNormLogger(clip_fraction=True)
history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0, callbacks=[logger])
plain = mlp(keras.Model)
plain.compile(keras.optimizers.SGD(0.1, global_clipnorm=0.05), "mse")
plain.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
gap = max(
    float(np.max(np.abs(a - b))) for a, b in zip(model.get_weights(), plain.get_weights())
)

path = os.path.join({tmp!r}, "model.keras")
model.save(path)
loaded = keras.saving.load_model(path)
loaded_gap = float(np.max(np.abs(loaded.predict(x, verbose=0) - model.predict(x, verbose=0))))



def two_heads(cls, **options):  # `multitask` (its merger's module) without TensorFlow
    keras.utils.set_random_seed(3)
    inputs = keras.Input((3,))
    trunk = keras.layers.Dense(4, activation="tanh")(inputs)
    heads = {{"a": keras.layers.Dense(1)(trunk), "b": keras.layers.Dense(1)(trunk)}}
    model = cls(inputs, heads, **options)
    model.compile(keras.optimizers.SGD(0.1), {{"a": "mse", "b": "mse"}})
    model.fit(x, {{"a": y[:, :1], "b": y[:, 1:]}}, batch_size=8, shuffle=False, verbose=0)
    return model.get_weights()


merged = two_heads(keras_fastgrad.FastGradModel, multitask="sum")  # Sum == the summed losses
multitask_gap = max(
    float(np.max(np.abs(a - b))) for a, b in zip(merged, two_heads(keras.Model))
)
refused_by = sorted(set(BLOCK.refused))

# What a TensorFlow-only path says when it is reached without TensorFlow.
from keras_fastgrad._tf_startup import tf

try:
    tf.zeros(())
    message = None
except ImportError as error:
    message = str(error)
writer = keras_fastgrad.callbacks.GradientNormLogger(tensorboard_dir={tmp!r})
try:  # refused in `on_train_begin`, before any step
    model.fit(x, y, batch_size=4, verbose=0, callbacks=[writer])
    board_message = None
except ImportError as error:
    board_message = str(error)
print(json.dumps({{
    "imported_tf_at_import": imported_tf,
    "tensorflow_loaded": "tensorflow" in sys.modules,
    "updates": int(model.optimizer.iterations.numpy()),
    "clipped_fraction": history.history["clipped_fraction"],
    "weights_gap": gap,
    "multitask_gap": multitask_gap,
    "loaded": [type(loaded).__name__, loaded.accumulation_steps, loaded.clip_norm],
    "loaded_gap": loaded_gap,
    "message": message,
    "board_message": board_message,
    "refused_by": refused_by,
}}))
"""


def _run(script, env, cwd):
    return json.loads(run_python(script, env, cwd).strip().splitlines()[-1])


def test_trains_saves_and_loads_without_tensorflow(tmp_path):
    env = dict(os.environ, KERAS_BACKEND="jax")
    result = _run(_BLOCK + _FIT_SAVE_LOAD.format(tmp=str(tmp_path)), env, ROOT)
    assert not result["imported_tf_at_import"] and not result["tensorflow_loaded"]
    # Only Keras' own saving asked for TensorFlow (`tf.available`), none of
    # keras_fastgrad's modules.
    assert result["refused_by"] in ([], ["keras"]), result["refused_by"]
    assert result["updates"] == 4  # 2 epochs x 4 batches / 2 per update
    assert result["clipped_fraction"] == [1.0, 1.0]
    assert result["weights_gap"] < 1e-6, result["weights_gap"]
    assert result["multitask_gap"] < 1e-6, result["multitask_gap"]
    assert result["loaded"] == ["FastGradModel", 2, 0.05]
    assert result["loaded_gap"] == 0.0
    message = result["message"]
    assert "`tf.zeros`" in message and "'jax'" in message and "pip install tensorflow" in message
    board = result["board_message"]
    assert "`tensorboard_dir` needs TensorFlow" in board and "`tensorboard_dir=None`" in board


def test_import_and_fit_do_not_import_installed_tensorflow(tmp_path):
    # The backend chosen in `keras.json` (no `KERAS_BACKEND`): read as
    # Keras reads it, before Keras is imported.
    (tmp_path / "keras.json").write_text(json.dumps({"backend": "jax"}))
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    env.update(KERAS_HOME=str(tmp_path), PYTHONPATH=ROOT)
    script = """
import json, sys
import numpy as np
import keras_fastgrad, keras

at_import = "tensorflow" in sys.modules
inputs = keras.Input((3,))
model = keras_fastgrad.FastGradModel(inputs, keras.layers.Dense(1)(inputs), accumulation_steps=2)
model.compile("sgd", "mse")
model.fit(np.ones((8, 3)), np.zeros((8, 1)), batch_size=2, verbose=0)
print(json.dumps([keras.backend.backend(), at_import, "tensorflow" in sys.modules]))
"""
    assert _run(script, env, str(tmp_path)) == ["jax", False, False]
