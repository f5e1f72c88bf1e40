"""Machine constants and number checks the aggregators share."""

import tensorflow as tf


def _eps(dtype):
    return tf.constant(tf.experimental.numpy.finfo(dtype.as_numpy_dtype).eps, dtype)


def _tiny(dtype):
    return tf.constant(tf.experimental.numpy.finfo(dtype.as_numpy_dtype).tiny, dtype)


# Relative cut-off for "zero" eigenvalues in Aligned-MTL in every dtype:
# float32's eps, as the official code (`torch.finfo()`), so that a float64
# Gram of duplicated gradients drops its round-off eigenvalues too.
_RANK_EPS = 1.1920929e-07


def _max_diag(gram):
    """`max(diag G)`, or 1 when it is not positive (`G = 0`)."""
    top = tf.reduce_max(tf.linalg.diag_part(gram))
    return tf.where(top > 0, top, tf.ones_like(top))


def _finite_or_nan(gram, fn):
    """`fn` on `gram` if it is finite, else NaN weights (`fn` runs on `I`)."""
    num_tasks = gram.shape[0]
    finite = tf.reduce_all(tf.math.is_finite(gram))
    safe = tf.where(finite, gram, tf.eye(num_tasks, dtype=gram.dtype))
    return tf.where(finite, fn(safe), tf.constant(float("nan"), gram.dtype))
