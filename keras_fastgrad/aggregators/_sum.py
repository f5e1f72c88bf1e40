"""Sum: the plain sum of the task gradients (what `keras.Model` does)."""

from keras import ops

from keras_fastgrad.aggregators._base import Aggregator, _register


@_register
class Sum(Aggregator):
    """Plain sum of the task gradients: `w = 1`.

    Example:

    >>> ops.convert_to_numpy(Sum().weights(np.eye(3))).tolist()
    [1.0, 1.0, 1.0]
    """

    name = "sum"

    def _weights(self, gram):
        return ops.ones([gram.shape[0]], dtype=gram.dtype)
