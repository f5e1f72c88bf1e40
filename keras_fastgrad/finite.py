"""Finite check: one flag per gradient, computed in the step (XLA-safe).

`tf.debugging.check_numerics` does nothing under XLA, so the check is a plain
`is_finite` reduction whose result the step uses as data.
"""

import tensorflow as tf


def finite_flags(grads, loss):
    """Says whether a micro-batch's loss and gradients are all finite.

    Args:
        grads: List of gradient tensors, `None` for variables without one.
        loss: Scalar loss tensor of the micro-batch.

    Returns:
        Tuple `(all_finite, first_bad, num_bad)`: a boolean scalar; the int32
        index (into `grads`) of the first non-finite gradient, or -1 when
        every gradient is finite (the loss alone may then be non-finite);
        the int32 number of non-finite gradients.

    Example:

    >>> ok, first, n = finite_flags([tf.constant([1.0]), None,
    ...                              tf.constant([float("nan")])],
    ...                             tf.constant(0.5))
    >>> bool(ok), int(first), int(n)
    (False, 2, 1)
    """
    flags = [
        tf.constant(True) if g is None else tf.reduce_all(tf.math.is_finite(g))
        for g in grads
    ]
    flags = tf.stack(flags) if flags else tf.ones([0], tf.bool)
    grads_finite = tf.reduce_all(flags)
    all_finite = tf.logical_and(
        grads_finite, tf.reduce_all(tf.math.is_finite(loss))
    )
    bad = tf.cast(tf.logical_not(flags), tf.int32)
    first_bad = tf.where(
        grads_finite,
        tf.constant(-1, tf.int32),
        tf.argmax(bad, output_type=tf.int32) if grads else -1,
    )
    return all_finite, first_bad, tf.reduce_sum(bad)
