"""Clipping by global L2 norm, applied once to each update's final gradient.

The norm is computed without overflow: the sum of squares of finite values
can exceed float32's range (a gradient of norm 2e20 squares to 4e40); then
the norm is recomputed on the gradient divided by its largest magnitude.
Sparse gradients (`tf.IndexedSlices`) are measured on their rows, duplicate
rows added up first, so the norm is that of the dense gradient.
"""

import tensorflow as tf

from keras_fastgrad.step.gradients import scale, summed_rows


def global_norm(grads):
    """Global L2 norm of a list of gradients (`None` entries skipped).

    Args:
        grads: List of gradient tensors, `tf.IndexedSlices` or `None`.

    Returns:
        float32 scalar `sqrt(sum_i ||g_i||^2)`, finite whenever the
        gradients are and the norm itself fits in float32.

    Example:

    >>> float(global_norm([tf.constant([3.0]), None, tf.constant([4.0])]))
    5.0
    >>> float(global_norm([tf.constant([3e20, 4e20])]))  # squares overflow
    5.000000...e+20
    """
    parts = [tf.cast(summed_rows(g), tf.float32) for g in grads if g is not None]
    if not parts:
        return tf.constant(0.0, tf.float32)
    squares = tf.add_n([tf.reduce_sum(tf.square(p)) for p in parts])

    def rescaled():
        top = tf.reduce_max(tf.stack([tf.reduce_max(tf.abs(p)) for p in parts]))
        unit = tf.where(tf.logical_and(top > 0.0, tf.math.is_finite(top)), top, 1.0)
        rest = tf.add_n([tf.reduce_sum(tf.square(p / unit)) for p in parts])
        return unit * tf.sqrt(rest)

    return tf.cond(tf.math.is_finite(squares), lambda: tf.sqrt(squares), rescaled)


def clip_by_global_norm(grads, clip_norm, norm):
    """Scales `grads` so that their global norm is at most `clip_norm`.

    Args:
        grads: List of gradient tensors, `tf.IndexedSlices` or `None`.
        clip_norm: Python float > 0.
        norm: float32 scalar, the global norm of `grads` (computed once by
            the caller, which also logs it).

    Returns:
        Tuple `(clipped_grads, was_clipped)`. An infinite or NaN `norm`
        gives non-finite gradients, which the step's check before the
        update drops.

    Example:

    >>> clipped, was_clipped = clip_by_global_norm(
    ...     [tf.constant([3.0, 4.0])], 1.0, tf.constant(5.0))
    >>> clipped[0].numpy().tolist(), bool(was_clipped)
    ([0.6000000238418579, 0.800000011920929], True)
    """
    was_clipped = norm > clip_norm
    factor = tf.where(was_clipped, clip_norm / norm, 1.0)
    factor = tf.where(tf.math.is_finite(norm), factor, float("nan"))
    return [scale(g, factor) for g in grads], was_clipped
