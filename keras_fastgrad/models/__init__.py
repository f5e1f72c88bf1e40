"""The models: `FastGradModel` (`model.py`, with its bases `readouts.py`,
`training_hooks.py` and `saving_hooks.py`), `FastGradSequential`
(`sequential.py`), `fastgrad(model)` for a model you have (`adapt.py`), a
plain model's `fit` given the step by the callbacks (`attachment.py`), and
where they meet Keras' own machinery (`_keras_hooks.py`)."""

from keras_fastgrad.models.adapt import fastgrad
from keras_fastgrad.models.model import FastGradModel
from keras_fastgrad.models.sequential import FastGradSequential

__all__ = ["FastGradModel", "FastGradSequential", "fastgrad"]
