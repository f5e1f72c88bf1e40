"""ConFIG (Liu et al., ICLR 2025): the direction with equal cosines to
every task gradient."""

import tensorflow as tf

from keras_fastgrad.aggregators import _base as aggregators
from keras_fastgrad.aggregators._utils.numerics import (
    _eps,
    _finite_or_nan,
    _tiny,
)


@aggregators._register
class ConFIG(aggregators.Aggregator):
    """ConFIG (Liu et al., 2024), as the official `ConFIG_update` / torchjd.

    "ConFIG: Towards Conflict-free Training of Physics Informed Neural
    Networks", Equation 2: with the unit task gradients `U = D^-1 J`
    (`D = diag ||g_i||`; a zero gradient gives a zero row),
    `g_c = pinv(U) 1` has the same inner product with every unit gradient;
    the update is `(sum_i g_i . u) u` with `u = g_c / ||g_c||`. In Gram
    space `pinv(U) 1 = J^T x`, `x = D^-1 (D^-1 G D^-1)^+ 1`, so
    `w = x (1^T G x) / (x^T G x)` (0 when `g_c = 0`). The pseudo-inverse
    cuts eigenvalues of the normalised Gram below `T eps(dtype)` relative
    (torch's `pinv(U)` cuts singular values of `U` at `max(T, P) eps`
    relative; both keep every direction of well-conditioned gradients).
    The preference vector is all ones (the official default; any constant
    vector gives the same update). A non-finite `G` gives NaN weights.

    Example:

    >>> gram = tf.constant([[4.0, 0.0], [0.0, 1.0]], tf.float64)
    >>> ConFIG().weights(gram).numpy().round(4).tolist()
    [0.75, 1.5]
    """

    name = "config"

    def _weights(self, gram):
        return _finite_or_nan(gram, config_weights)


def config_weights(gram):
    """ConFIG task weights from the Gram matrix (see `ConFIG`)."""
    num_tasks, dtype = gram.shape[0], gram.dtype
    norms = tf.sqrt(tf.maximum(tf.linalg.diag_part(gram), 0.0))
    positive = norms > tf.sqrt(_tiny(dtype))
    inv = tf.where(positive, 1.0 / tf.where(positive, norms, 1.0), 0.0)
    unit_gram = gram * inv[:, None] * inv[None, :]
    pinv = tf.linalg.pinv(unit_gram, rcond=num_tasks * _eps(dtype))
    ones = tf.ones([num_tasks], dtype)
    y = tf.linalg.matvec(pinv, ones)
    # One refinement step: XLA's SVD stops near 1e-7 relative, even in float64.
    y += tf.linalg.matvec(pinv, ones - tf.linalg.matvec(unit_gram, y))
    x = inv * y  # D^-1 (D^-1 G D^-1)^+ 1
    gx = tf.linalg.matvec(gram, x)
    norm_sq = tf.reduce_sum(x * gx)
    flat = norm_sq <= _tiny(dtype) * tf.reduce_max(tf.abs(gram))
    weights = x * tf.reduce_sum(gx) / tf.where(flat, tf.ones_like(norm_sq), norm_sq)
    return tf.where(flat, tf.zeros_like(weights), weights)
