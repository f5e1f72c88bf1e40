"""Keras' `loss` tracker in the step: what a kept micro-batch adds to it,
on both backends (a dropped one adds nothing: the shells leave the
tracker and the compiled metrics as they were, by a `cond` on TensorFlow,
a selection of values on JAX)."""

import numpy as np

# The smallest normal float32: the weight of a kept batch of no rows.
TINY = float(np.finfo(np.float32).tiny)


def tracked_weight(rows, maximum=None):
    """The weight a kept micro-batch's loss gets in the `loss` tracker: its
    rows, as Keras' `train_step` weights it. A batch of no rows adds
    nothing to Keras' mean (weight 0, and its logged mean of nothing is
    0.0); here it adds its loss (0: Keras' reductions divide by a zero
    normaliser as `divide_no_nan`) with the smallest normal float32
    weight, which leaves every other mean as it is but marks the period
    as having kept something (`TrainingLoss`: a period with nothing kept
    logs NaN).

    Args:
        rows: The micro-batch's rows (a Python number or a float32 scalar).
        maximum: The backend's `maximum(x, y)`, or `None` (Python's
            `max`, for a number known when the step is traced).

    >>> tracked_weight(32.0), tracked_weight(0.0) == TINY
    (32.0, True)
    """
    return (maximum or max)(rows, TINY)
