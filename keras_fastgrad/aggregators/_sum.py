"""Sum: the plain sum of the task gradients (what `keras.Model` does)."""

import tensorflow as tf

from keras_fastgrad.aggregators._base import Aggregator, _register


@_register
class Sum(Aggregator):
    """Plain sum of the task gradients: `w = 1`.

    Example:

    >>> Sum().weights(tf.eye(3)).numpy().tolist()
    [1.0, 1.0, 1.0]
    """

    name = "sum"

    def _weights(self, gram):
        return tf.ones([gram.shape[0]], gram.dtype)
