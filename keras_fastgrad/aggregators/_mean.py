"""Mean: the mean of the task gradients."""

import tensorflow as tf

from keras_fastgrad.aggregators._base import Aggregator, _register


@_register
class Mean(Aggregator):
    """Mean of the task gradients: `w = 1/T`.

    Example:

    >>> Mean().weights(tf.eye(4)).numpy().tolist()
    [0.25, 0.25, 0.25, 0.25]
    """

    name = "mean"

    def _weights(self, gram):
        return tf.fill([gram.shape[0]], tf.constant(1.0 / gram.shape[0], gram.dtype))
