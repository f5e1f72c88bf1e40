"""Mean: the mean of the task gradients."""

from keras import ops

from keras_fastgrad.aggregators._base import Aggregator, _register


@_register
class Mean(Aggregator):
    """Mean of the task gradients: `w = 1/T`.

    Example:

    >>> ops.convert_to_numpy(Mean().weights(np.eye(4))).tolist()
    [0.25, 0.25, 0.25, 0.25]
    """

    name = "mean"

    def _weights(self, gram):
        return ops.full([gram.shape[0]], 1.0 / gram.shape[0], dtype=gram.dtype)
