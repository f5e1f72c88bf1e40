"""On TensorFlow, keras_fastgrad needs no JAX: the `jax` extra is optional
(CI's oldest-versions venv and the wheel's venv have no JAX). A fresh Python
with every `jax` import blocked imports the package and trains a
`FastGradModel` with the options and callbacks whose modules are shared with
the JAX step (telemetry, TapeVariableCounter, accumulation, clipping)."""

import json
import os

import numpy as np
import pytest

from tests.subprocesses import run_python

pytestmark = pytest.mark.tensorflow_only(reason="TensorFlow without JAX installed")

_SCRIPT = """
import json, sys, traceback


class NoJax:
    refused = []

    def find_spec(self, name, path=None, target=None):
        if name in ("jax", "jaxlib") or name.startswith(("jax.", "jaxlib.")):
            frames = [f for f in traceback.extract_stack() if "keras_fastgrad" in f.filename]
            self.refused.append(f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "keras")
            raise ImportError(f"No module named {name!r} (blocked by the test)")
        return None


BLOCK = NoJax()
sys.meta_path.insert(0, BLOCK)
import numpy as np
import keras
import keras_fastgrad as kf
from keras_fastgrad.callbacks import GradientNormLogger, NonFiniteGuard, TapeVariableCounter

rng = np.random.default_rng(0)
x = rng.normal(size=(24, 3)).astype("float32")
y = rng.normal(size=(24, 2)).astype("float32")
weights = None
out = {}
for cls, options, callbacks in (
    (keras.Model, {}, []),
    (kf.FastGradModel, {"accumulation_steps": 3}, [GradientNormLogger(), NonFiniteGuard(), TapeVariableCounter()]),
):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((3,))
    model = cls(inputs, keras.layers.Dense(2)(keras.layers.Dense(4, activation="tanh")(inputs)), **options)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    batch = 24 if cls is keras.Model else 8
    history = model.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
    out[cls.__name__] = {"weights": [w.tolist() for w in model.get_weights()],
                         "keys": sorted(history.history)}
out["backend"] = keras.backend.backend()
out["refused"] = BLOCK.refused
print("RESULT" + json.dumps(out))
"""


def test_trains_on_tensorflow_with_jax_unimportable():
    env = {**os.environ, "KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = json.loads(run_python(_SCRIPT, env).split("RESULT", 1)[1])
    assert out["backend"] == "tensorflow"
    assert out["refused"] == [] or all("keras_fastgrad" not in r for r in out["refused"]), out[
        "refused"
    ]
    # Accumulation over 3 micro-batches of 8 == keras.Model on the batch of 24.
    for ours, ref in zip(out["FastGradModel"]["weights"], out["Model"]["weights"], strict=True):
        np.testing.assert_allclose(ours, ref, atol=1e-6)
    assert {"grad_norm", "nonfinite_count", "tape_variables"} <= set(out["FastGradModel"]["keys"])


@pytest.fixture(autouse=True)
def _tensorflow_only_here():
    import keras

    if keras.backend.backend() != "tensorflow":
        pytest.skip("checks the TensorFlow backend without JAX")
    yield
