"""Finite check: one fused reduction per gradient, computed in the step.

`tf.debugging.check_numerics` does nothing under XLA, so the check is data
the step uses. A sum is non-finite when any of its terms is (NaN and +-Inf
propagate), so one `reduce_sum` per gradient, a single pass with no
temporary, decides; sparse gradients (`tf.IndexedSlices`, from embedding
lookups) are summed over their rows only, never densified. The one false
alarm: finite elements whose sum exceeds float32's range (~3.4e38), a
gradient no update could use either; it is dropped like a non-finite one.
Under several replicas one flag per gradient is summed over them, so a NaN
on any replica drops the micro-batch everywhere.
"""

import tensorflow as tf

from keras_fastgrad.step.gradients import values


def gradient_sums(grads):
    """float32 vector: the sum of each gradient's elements (`None`: 0)."""
    return tf.stack(
        [
            tf.constant(0.0) if g is None else tf.cast(tf.reduce_sum(values(g)), tf.float32)
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
    return is_finite(gradient_sums(grads))


def marks(grads, loss):
    """float32 vector `[len(grads) + 1]`: each gradient's element sum
    (`None`: 0), then the loss; an entry is non-finite exactly when its
    gradient (or the loss) holds NaN/Inf. One reduction per gradient and
    one stack: the whole per-step cost of the check."""
    return (
        tf.concat([gradient_sums(grads), [tf.cast(loss, tf.float32)]], 0)
        if grads
        else (tf.reshape(tf.cast(loss, tf.float32), [1]))
    )


def is_finite(marks_vector):
    """Boolean scalar: every entry of a `marks` vector is finite."""
    return tf.reduce_all(tf.math.is_finite(marks_vector))


def to_flags(marks_vector):
    """float32 1/0 per entry: summed over replicas, it keeps its meaning."""
    return tf.cast(tf.logical_not(tf.math.is_finite(marks_vector)), tf.float32)


def from_flags(flags):
    """Back from replica-summed flags to a `marks` vector (NaN where any
    replica was non-finite)."""
    return tf.where(flags > 0, float("nan"), 0.0)


def summarize(marks_vector):
    """Where a micro-batch went bad, from its `marks` vector.

    Returns:
        Tuple `(first_bad, num_bad)`: the int32 index of the first
        non-finite gradient, or -1 when every gradient is finite (the loss
        alone was non-finite, or the model has no trainable variables); the
        int32 number of non-finite gradients.

    Example:

    >>> first, n = summarize(marks(
    ...     [tf.constant([1.0]), None, tf.constant([float("nan")])],
    ...     tf.constant(0.5)))
    >>> int(first), int(n)
    (2, 1)
    """
    bad_ints = tf.cast(tf.logical_not(tf.math.is_finite(marks_vector[:-1])), tf.int32)
    num_bad = tf.reduce_sum(bad_ints)
    # argmax of an empty vector fails: pad with one 0 (never chosen unless
    # no gradient is bad, and then -1 is returned).
    index = tf.argmax(tf.concat([bad_ints, [0]], 0), output_type=tf.int32)
    first_bad = tf.where(num_bad > 0, index, tf.constant(-1, tf.int32))
    return first_bad, num_bad
