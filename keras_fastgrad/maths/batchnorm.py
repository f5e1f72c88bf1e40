"""BatchNorm window statistics: moments pooled over a window, one step.

Written once in `keras.ops` (explicit inputs, no variables) for both
backends' steps (the unit's contract and rules:
`keras_fastgrad.step.batchnorm`).

Each layer's per-feature moments are a `[3, features]` stack `(n, mean,
M2)`, `M2 = n * variance` (biased variance; `n` the positions reduced over,
or the mask's weights). Two stacks combine with Chan, Golub and LeVeque's
parallel formula, exact with `n = 0` on either side:

    n     = n_a + n_b
    delta = mean_b - mean_a
    mean  = mean_a + delta * n_b / n
    M2    = M2_a + M2_b + delta**2 * n_a * n_b / n

and the moving statistics take one momentum step from the pooled `mean`
and `M2 / n` (`pooled`, `momentum_step`; features without samples keep
theirs).
"""

from keras import ops


def chan_combine(a, b):
    """Chan et al.'s parallel combination of two `(n, mean, M2)` triples
    (per-feature tensors); `n = 0` on either side is exact.

    Example:

    >>> x = np.array([1.0, 2.0, 4.0, 7.0], "float32")
    >>> def moments(p):
    ...     return np.float32(len(p)), p.mean(), ((p - p.mean()) ** 2).sum()
    >>> n, mean, m2 = chan_combine(moments(x[:2]), moments(x[2:]))
    >>> float(mean), float(m2 / n), float(x.var())
    (3.5, 5.25, 5.25)
    """
    n_a, mean_a, m2_a = a
    n_b, mean_b, m2_b = b
    n = n_a + n_b
    delta = mean_b - mean_a
    mean = mean_a + delta * ops.divide_no_nan(n_b, n)
    m2 = m2_a + m2_b + ops.square(delta) * ops.divide_no_nan(n_a * n_b, n)
    return n, mean, m2


def combined(a, b):
    """`chan_combine` of two `[3, features]` moment stacks (float32)."""
    return ops.stack(chan_combine(ops.unstack(a, 3), ops.unstack(b, 3)))


def counts(inputs, mask, axis):
    """The samples behind each feature's moments: the positions reduced
    over, or (masked, as Keras weighs them) the mask's weights.

    Args:
        inputs: The layer's input (static rank and feature axis).
        mask: `None`, or the mask Keras passes the layer (rank one less).
        axis: Int, the layer's feature axis.

    Returns:
        Float32 `[features]`.

    Example:

    >>> [float(c) for c in counts(np.ones((4, 3, 2)), None, -1)]
    [12.0, 12.0]
    """
    rank = len(inputs.shape)
    axis = axis % rank
    features = inputs.shape[axis]  # (static: the layer is built)
    if mask is None:  # (the other sizes may be known only when the step runs)
        count = ops.cast(ops.size(inputs) // features, "float32")
        return ops.full((features,), count, "float32")
    weights = ops.expand_dims(ops.cast(mask, "float32"), -1)
    weights = ops.broadcast_to(weights, ops.shape(inputs))
    return ops.sum(weights, axis=[a for a in range(rank) if a != axis])


def moments_stack(n, mean, variance):
    """`[3, features]` float32 `(n, mean, M2)` from a layer's batch moments
    (`mean`, `variance` of any shape holding `features` values)."""
    mean = ops.reshape(ops.cast(mean, "float32"), (-1,))
    variance = ops.reshape(ops.cast(variance, "float32"), (-1,))
    return ops.stack([n, mean, variance * n])


def pooled(window):
    """`(has_samples, mean, variance)` per feature of a `[3, features]`
    window: `n > 0`, the pooled mean and `M2 / n` (0 where `n = 0`)."""
    n, mean, m2 = ops.unstack(window, 3)
    return n > 0, mean, ops.divide_no_nan(m2, n)


def momentum_step(moving, new, has_samples, momentum):
    """`moving * momentum + new * (1 - momentum)` where `has_samples`,
    `moving` elsewhere (in `moving`'s dtype).

    Example:

    >>> new, has_samples = np.array([2.0, 9.0]), np.array([True, False])
    >>> out = momentum_step(np.zeros(2, "float32"), new, has_samples, 0.75)
    >>> [float(v) for v in out]
    [0.5, 0.0]
    """
    moving = ops.convert_to_tensor(moving)
    step = moving * momentum + ops.cast(new, moving.dtype) * (1.0 - momentum)
    return ops.where(has_samples, step, moving)
