"""ConFIG (Liu et al., ICLR 2025): the direction with equal cosines to
every task gradient."""

import numpy as np
from keras import ops

from keras_fastgrad.aggregators import _base as aggregators
from keras_fastgrad.aggregators._utils.linalg import symmetric_pinv
from keras_fastgrad.aggregators._utils.numerics import (
    _compiled,
    _dtype,
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

    >>> gram = np.array([[4.0, 0.0], [0.0, 1.0]])
    >>> keras.ops.convert_to_numpy(ConFIG().weights(gram)).round(4).tolist()
    [0.75, 1.5]
    """

    name = "config"

    def _weights(self, gram):
        return _finite_or_nan(gram, config_weights)


@_compiled()
def config_weights(gram):
    """ConFIG task weights from the Gram matrix (see `ConFIG`)."""
    num_tasks, dtype = gram.shape[0], _dtype(gram.dtype)
    norms = ops.sqrt(ops.maximum(ops.diagonal(gram), 0.0))
    positive = norms > ops.sqrt(_tiny(dtype))
    inv = ops.where(positive, 1.0 / ops.where(positive, norms, 1.0), 0.0)
    inv_col = ops.expand_dims(inv, 1)  # vectors are columns here
    unit_gram = gram * inv_col * inv
    pinv = symmetric_pinv(unit_gram, num_tasks * _eps(dtype))
    ones = np.ones([num_tasks, 1], dtype)
    y = ops.matmul(pinv, ones)
    # One refinement step: XLA's SVD stops near 1e-7 relative, even in float64.
    y = y + ops.matmul(pinv, ones - ops.matmul(unit_gram, y))
    x = inv_col * y  # D^-1 (D^-1 G D^-1)^+ 1
    gx = ops.matmul(gram, x)
    norm_sq = ops.sum(x * gx)
    flat = norm_sq <= _tiny(dtype) * ops.max(ops.abs(gram))
    weights = ops.squeeze(x, 1) * ops.sum(gx) / ops.where(flat, 1.0, norm_sq)
    return ops.where(flat, 0.0, weights)
