"""BatchNorm window statistics: moments pooled over a window, one step.

Written once in `keras.ops` (explicit inputs, no variables) for the JAX
step (`keras_fastgrad.backend.jax_batchnorm`); the TensorFlow unit
(`keras_fastgrad.step.batchnorm`) keeps its own `tf` form of the same
equations (see its module docstring for the contract).

Each layer's per-feature moments are a `[3, features]` stack `(n, mean,
M2)`, `M2 = n * variance` (biased variance; `n` the positions reduced over,
or the mask's weights). Two stacks combine with Chan, Golub and LeVeque's
parallel formula, exact with `n = 0` on either side:

    n     = n_a + n_b
    delta = mean_b - mean_a
    mean  = mean_a + delta * n_b / n
    M2    = M2_a + M2_b + delta**2 * n_a * n_b / n

and the moving statistics take one momentum step from the pooled `mean`
and `M2 / n` (features without samples keep theirs).
"""

from keras import ops


def combined(a, b):
    """Chan's combination of two `[3, features]` moment stacks.

    Args:
        a, b: `(n, mean, M2)` stacks, float32.

    Returns:
        The stack of the union's moments.

    Example:

    >>> x = np.array([1.0, 2.0, 4.0, 7.0], "float32")
    >>> def stack(p):
    ...     return np.array([[len(p)], [p.mean()], [((p - p.mean()) ** 2).sum()]], "float32")
    >>> n, mean, m2 = np.asarray(combined(stack(x[:2]), stack(x[2:])))[:, 0]
    >>> float(mean), float(m2 / n), float(x.var())
    (3.5, 5.25, 5.25)
    """
    n_a, mean_a, m2_a = a[0], a[1], a[2]
    n_b, mean_b, m2_b = b[0], b[1], b[2]
    n = n_a + n_b
    delta = mean_b - mean_a
    mean = mean_a + delta * ops.divide_no_nan(n_b, n)
    m2 = m2_a + m2_b + ops.square(delta) * ops.divide_no_nan(n_a * n_b, n)
    return ops.stack([n, mean, m2])


def counts(inputs, mask, axis):
    """The samples behind each feature's moments: the positions reduced
    over, or (masked, as Keras weighs them) the mask's weights.

    Args:
        inputs: The layer's input (static rank).
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
    features = inputs.shape[axis]
    if mask is None:
        total = 1
        for a, size in enumerate(inputs.shape):
            total = total if a == axis else total * size
        return ops.full((features,), float(total), "float32")
    weights = ops.broadcast_to(ops.expand_dims(ops.cast(mask, "float32"), -1), inputs.shape)
    return ops.sum(weights, axis=[a for a in range(rank) if a != axis])


def moments_stack(n, mean, variance):
    """`[3, features]` float32 `(n, mean, M2)` from a layer's batch moments
    (`mean`, `variance` of any shape holding `features` values)."""
    mean = ops.reshape(ops.cast(mean, "float32"), (-1,))
    variance = ops.reshape(ops.cast(variance, "float32"), (-1,))
    return ops.stack([n, mean, variance * n])


def moved(moving, pooled, momentum):
    """The moving statistics after one momentum step from the window.

    Args:
        moving: `(moving_mean, moving_variance)` values of a layer.
        pooled: The layer's `[3, features]` window moments.
        momentum: Python float, the layer's momentum.

    Returns:
        `(moving_mean, moving_variance)`: `moving * momentum + pooled *
        (1 - momentum)` with the pooled mean and `M2 / n`; where `n = 0`,
        as they were.

    Example:

    >>> pooled = np.array([[4.0, 0.0], [2.0, 9.0], [8.0, 0.0]], "float32")
    >>> mean, var = moved((np.zeros(2), np.ones(2)), pooled, 0.75)
    >>> [float(v) for v in mean], [float(v) for v in var]
    ([0.5, 0.0], [1.25, 1.0])
    """
    n, mean, m2 = pooled[0], pooled[1], pooled[2]
    has_samples = n > 0
    out = []
    for old, new in zip(moving, (mean, ops.divide_no_nan(m2, n))):
        old = ops.convert_to_tensor(old)
        step = old * momentum + ops.cast(new, old.dtype) * (1.0 - momentum)
        out.append(ops.where(has_samples, step, old))
    return tuple(out)
