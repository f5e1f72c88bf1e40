"""Clipping by global L2 norm, applied once to each update's final gradient."""

import tensorflow as tf


def global_norm(grads):
    """Global L2 norm of a list of gradients (`None` entries skipped).

    Args:
        grads: List of gradient tensors or `None`.

    Returns:
        float32 scalar `sqrt(sum_i ||g_i||^2)`.

    Example:

    >>> float(global_norm([tf.constant([3.0]), None, tf.constant([4.0])]))
    5.0
    """
    squares = [
        tf.reduce_sum(tf.square(tf.cast(g, tf.float32)))
        for g in grads
        if g is not None
    ]
    if not squares:
        return tf.constant(0.0, tf.float32)
    return tf.sqrt(tf.add_n(squares))


def clip_by_global_norm(grads, clip_norm, norm):
    """Scales `grads` so that their global norm is at most `clip_norm`.

    Unlike `tf.clip_by_global_norm`, an infinite norm gives zeros rather than
    NaN (the step's finite check has already dropped non-finite gradients,
    so this only matters for sums of squares that overflow float32).

    Args:
        grads: List of gradient tensors or `None`.
        clip_norm: Python float > 0.
        norm: float32 scalar, the global norm of `grads` (computed once by
            the caller, which also logs it).

    Returns:
        Tuple `(clipped_grads, was_clipped)`.

    Example:

    >>> clipped, was_clipped = clip_by_global_norm(
    ...     [tf.constant([3.0, 4.0])], 1.0, tf.constant(5.0))
    >>> clipped[0].numpy().tolist(), bool(was_clipped)
    ([0.6000000238418579, 0.800000011920929], True)
    """
    was_clipped = norm > clip_norm
    scale = tf.where(was_clipped, clip_norm / tf.maximum(norm, 1e-30), 1.0)
    clipped = [None if g is None else g * tf.cast(scale, g.dtype) for g in grads]
    return clipped, was_clipped
