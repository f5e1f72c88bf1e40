"""The models: `FastGradModel` (`model.py`), `FastGradSequential`
(`sequential.py`), `fastgrad(model)` for a model you have (`adapt.py`), and
where they meet Keras' own machinery (`_keras_hooks.py`)."""

from keras_fastgrad.models.adapt import fastgrad
from keras_fastgrad.models.model import FastGradModel
from keras_fastgrad.models.sequential import FastGradSequential

__all__ = ["FastGradModel", "FastGradSequential", "fastgrad"]
