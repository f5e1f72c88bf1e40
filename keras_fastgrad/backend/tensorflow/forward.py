"""The forward pass as the step records it: a tape that watches exactly
the variables it is given (`watch_accessed_variables=False`), and the
model called as in training."""

import contextlib

from keras_fastgrad import _compat as compat
from keras_fastgrad._tf_startup import tf


@contextlib.contextmanager
def watching(variables, persistent=False):
    """A `tf.GradientTape` that watches `variables` and nothing else.

    Keras variables are watched through `v.value` (the tape does not know
    Keras' variable wrapper); differentiate with respect to
    `[v.value for v in variables]`."""
    with tf.GradientTape(watch_accessed_variables=False, persistent=persistent) as tape:
        for v in variables:
            tape.watch(v.value)
        yield tape


def call_for_training(model, x):
    """`model(x, training=True)`, or `model(x)` when its `call` takes no
    `training` argument."""
    if compat.call_has_training_arg(model):
        return model(x, training=True)
    return model(x)
