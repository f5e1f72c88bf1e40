"""Finite check: one flag per gradient, computed in the step (XLA-safe).

`tf.debugging.check_numerics` does nothing under XLA, so the check is a plain
`is_finite` reduction whose result the step uses as data. Flags are summed
over replicas, so a NaN on any replica drops the micro-batch everywhere.
"""

import tensorflow as tf


def nonfinite_vector(grads, loss):
    """float32 vector: 1 per non-finite gradient (`None`: 0), then 1 if the
    loss is non-finite. Summing it over replicas keeps its meaning."""
    finite = [
        tf.constant(True) if g is None else tf.reduce_all(tf.math.is_finite(g))
        for g in grads
    ]
    finite.append(tf.reduce_all(tf.math.is_finite(loss)))
    # One negation and one cast for the whole vector: few small ops per step.
    return tf.cast(tf.logical_not(tf.stack(finite)), tf.float32)


def summarize(bad):
    """Reads a (possibly replica-summed) `nonfinite_vector`.

    Returns:
        Tuple `(all_finite, first_bad, num_bad)`: a boolean scalar; the int32
        index of the first non-finite gradient, or -1 when every gradient is
        finite (the loss alone may then be non-finite); the int32 number of
        non-finite gradients.
    """
    grads_bad = bad[:-1] > 0
    any_grad_bad = tf.reduce_any(grads_bad)
    all_finite = tf.logical_not(tf.reduce_any(bad > 0))
    index = tf.argmax(tf.cast(grads_bad, tf.int32), output_type=tf.int32)
    first_bad = tf.where(any_grad_bad, index, tf.constant(-1, tf.int32))
    return all_finite, first_bad, tf.reduce_sum(tf.cast(grads_bad, tf.int32))


def finite_flags(grads, loss):
    """Says whether a micro-batch's loss and gradients are all finite.

    Args:
        grads: List of gradient tensors, `None` for variables without one.
        loss: Scalar loss tensor of the micro-batch.

    Returns:
        Tuple `(all_finite, first_bad, num_bad)`, see `summarize`.

    Example:

    >>> ok, first, n = finite_flags([tf.constant([1.0]), None,
    ...                              tf.constant([float("nan")])],
    ...                             tf.constant(0.5))
    >>> bool(ok), int(first), int(n)
    (False, 2, 1)
    """
    return summarize(nonfinite_vector(grads, loss))
