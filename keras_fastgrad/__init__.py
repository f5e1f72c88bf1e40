"""keras_fastgrad: exact, fast and safe gradient steps for Keras 3 models.

Swap `keras.Model` for `keras_fastgrad.FastGradModel` and train with the
usual `compile` / `fit`.

Runs on Keras' TensorFlow and JAX backends (`keras_fastgrad.backend`:
what a backend does not support is refused there, by name).
Importing it under another backend (`torch`, `numpy`, `openvino`) raises
`ImportError`, naming the backend in use and the supported ones, rather
than failing later in `fit`. On JAX, TensorFlow is neither imported nor
needed (only `tensorboard_dir` writes its events with it).
"""

# On Keras' TensorFlow backend: imports TensorFlow first, its start-up
# notices held to TF_CPP_MIN_LOG_LEVEL. On JAX: imports nothing.
from keras_fastgrad import _tf_startup  # noqa: F401, I001

import keras as _keras

if _keras.backend.backend() not in ("tensorflow", "jax"):
    raise ImportError(
        "keras_fastgrad supports Keras' TensorFlow and JAX backends "
        "(`tensorflow`, `jax`). Received: "
        f"keras.backend.backend()={_keras.backend.backend()!r}. Fix: set the "
        "environment variable `KERAS_BACKEND=tensorflow` (or `jax`) before "
        'Python starts (or `os.environ["KERAS_BACKEND"] = "tensorflow"` '
        'before the first `import keras`), or `"backend": "tensorflow"` in '
        "~/.keras/keras.json."
    )

from keras_fastgrad import callbacks
from keras_fastgrad.models.adapt import fastgrad
from keras_fastgrad.models.model import FastGradModel
from keras_fastgrad.models.sequential import FastGradSequential
from keras_fastgrad.profiling.measure import StepProfile, profile_step
from keras_fastgrad.step.telemetry import LOG_KEYS

__version__ = "0.1.0"

__all__ = [
    "FastGradModel",
    "FastGradSequential",
    "fastgrad",
    "callbacks",
    "LOG_KEYS",
    "StepProfile",
    "profile_step",
    "__version__",
]
