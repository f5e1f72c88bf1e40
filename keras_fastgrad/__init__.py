"""keras_fastgrad: exact, fast and safe gradient steps for Keras 3 models.

Swap `keras.Model` for `keras_fastgrad.FastGradModel` and train with the
usual `compile` / `fit`.
"""

# Imports TensorFlow first, its start-up notices held to TF_CPP_MIN_LOG_LEVEL.
from keras_fastgrad import _tf_startup  # noqa: F401, I001

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
