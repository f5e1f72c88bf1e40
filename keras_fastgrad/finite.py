"""Finite check: one fused reduction per gradient, computed in the step.

`tf.debugging.check_numerics` does nothing under XLA, so the check is data
the step uses. A sum is non-finite when any of its terms is (NaN and +-Inf
propagate), so one `reduce_sum` per gradient, a single pass with no
temporary, decides; sparse gradients (`tf.IndexedSlices`, from embedding
lookups) are summed over their rows only, never densified. The one false
alarm: finite elements whose sum exceeds float32's range (~3.4e38), a
gradient no update could use either; it is dropped like a non-finite one.
Flags are summed over replicas, so a NaN on any replica drops the
micro-batch everywhere.
"""

import tensorflow as tf


def _values(g):
    return g.values if isinstance(g, tf.IndexedSlices) else g


def gradient_sums(grads):
    """float32 vector: the sum of each gradient's elements (`None`: 0)."""
    return tf.stack(
        [
            tf.constant(0.0) if g is None else tf.cast(tf.reduce_sum(_values(g)), tf.float32)
            for g in grads
        ]
    )


def all_finite(grads):
    """Boolean scalar: every element of every gradient is finite.

    Example:

    >>> bool(all_finite([tf.constant([1.0, 2.0]), None]))
    True
    >>> bool(all_finite([tf.constant([1.0, float("inf")])]))
    False
    """
    if not any(g is not None for g in grads):
        return tf.constant(True)
    return tf.reduce_all(tf.math.is_finite(gradient_sums(grads)))


def nonfinite_vector(grads, loss):
    """float32 vector: 1 per non-finite gradient (`None`: 0), then 1 if the
    loss is non-finite. Summing it over replicas keeps its meaning."""
    sums = tf.concat([gradient_sums(grads), [tf.cast(loss, tf.float32)]], 0) if grads else (
        tf.reshape(tf.cast(loss, tf.float32), [1])
    )
    return tf.cast(tf.logical_not(tf.math.is_finite(sums)), tf.float32)


def summarize(bad):
    """Reads a (possibly replica-summed) `nonfinite_vector`.

    Returns:
        Tuple `(all_finite, loss_finite, first_bad, num_bad)`: boolean
        scalars (everything finite; the loss finite); the int32 index of the
        first non-finite gradient, or -1 when every gradient is finite (the
        loss alone may then be non-finite); the int32 number of non-finite
        gradients. A model without trainable variables has only the loss.

    Example:

    >>> ok, loss_ok, first, n = summarize(nonfinite_vector(
    ...     [tf.constant([1.0]), None, tf.constant([float("nan")])],
    ...     tf.constant(0.5)))
    >>> bool(ok), bool(loss_ok), int(first), int(n)
    (False, True, 2, 1)
    """
    grads_bad = bad[:-1] > 0
    loss_finite = tf.logical_not(bad[-1] > 0)
    all_ok = tf.logical_not(tf.reduce_any(bad > 0))
    bad_ints = tf.cast(grads_bad, tf.int32)
    num_bad = tf.reduce_sum(bad_ints)
    # argmax of an empty vector fails: pad with one 0 (index never chosen
    # unless no gradient is bad, and then -1 is returned).
    index = tf.argmax(tf.concat([bad_ints, [0]], 0), output_type=tf.int32)
    first_bad = tf.where(num_bad > 0, index, tf.constant(-1, tf.int32))
    return all_ok, loss_finite, first_bad, num_bad
