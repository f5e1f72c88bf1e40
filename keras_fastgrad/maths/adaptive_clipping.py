"""Adaptive gradient clipping (AGC) of dense gradients, in `keras.ops`.

Brock, De, Smith, Simonyan (2021), "High-Performance Large-Scale Image
Recognition Without Normalization" (https://arxiv.org/abs/2102.06171),
section 4.1. For every unit `i` of a weight `W` with gradient `G`:

    G_i <- G_i * min(1, lambda * max(||W_i||, eps) / ||G_i||)

with Frobenius norms over the unit (`unit_axes`): a kernel's output unit
(every axis but the last), an embedding table's row (every axis but the
first), a vector or scalar whole. `min(1, ...)` is exact: a zero unit's
factor is `min(1, inf) = 1`. A finite gradient whose unit norm overflows
float32 would get the factor 0 (a silently zero unit): `all_finite` is then
false, and the step drops the update, as it drops a non-finite one.

Backend-neutral (the JAX step's, `keras_fastgrad.backend.jax.step`); the
TensorFlow unit (`keras_fastgrad.step.adaptive_clipping`) keeps its own
sparse (`tf.IndexedSlices`) path and its fused norm.
"""

import collections

from keras import ops

# The paper's and optax's default: weights initialised to zero (biases,
# some gains) may still move by `lambda * eps` per unit.
DEFAULT_EPSILON = 1e-3


class Clipped(
    collections.namedtuple("Clipped", ["grads", "all_finite", "clipped_units", "num_units"])
):
    """What `clip_unitwise` returns.

    Fields:
        grads: The clipped gradients (`None` kept; the TensorFlow unit
            keeps a sparse one sparse).
        all_finite: Boolean scalar: every unit's gradient norm is finite
            (so every gradient is finite, and none overflowed).
        clipped_units: float32 scalar, how many units were clipped
            (`None` when not counted).
        num_units: Python int, how many units the weights have (a unit
            of a table row not in a sparse gradient counts, unclipped).
    """


def unit_axes(rank, rows=False):
    """The axes a unit's norm runs over (`None`: the whole weight).

    Args:
        rank: Python int, the weight's rank.
        rows: Python bool, the units are the first axis' entries (an
            embedding table) rather than the last's (a kernel).

    Returns:
        A tuple of axes, or `None`.

    Example:

    >>> unit_axes(2), unit_axes(4), unit_axes(2, rows=True), unit_axes(1)
    ((0,), (0, 1, 2), (1,), None)
    """
    if rank <= 1:
        return None
    return tuple(range(1, rank)) if rows else tuple(range(rank - 1))


def l2_norm(x, axes):
    """The L2 norm over `axes` (kept, size 1), of everything for `None`.

    Example:

    >>> float(l2_norm(ops.convert_to_tensor([3.0, 4.0]), None))
    5.0
    """
    if axes is None:
        return ops.sqrt(ops.sum(ops.square(x)))
    return ops.sqrt(ops.sum(ops.square(x), axis=axes, keepdims=True))


def clip_weight(g, w, rows, clipping, eps=DEFAULT_EPSILON, norm=l2_norm):
    """One weight's dense gradient clipped unit-wise (the equation above).

    Args:
        g: The weight's gradient (dense).
        w: The weight's current value.
        rows: Python bool, the units are rows (an embedding table).
        clipping: `lambda` (Python float > 0, or a scalar tensor).
        eps: The smallest weight norm (Python float > 0, or a scalar).
        norm: `norm(x, axes)`, the L2 norm over `axes` kept (`None`: of
            everything); `l2_norm`, or a backend's fused one.

    Returns:
        `(clipped, g_norm, max_norm, units)`: the clipped gradient, the
        units' gradient and bound norms, and the number of units.

    Example:

    >>> g, g_norm, bound, units = clip_weight(
    ...     ops.convert_to_tensor([0.0, 4.0]), ops.convert_to_tensor([0.0, 1.0]), False, 2.0)
    >>> [float(v) for v in g], float(g_norm), float(bound), units
    ([0.0, 2.0], 4.0, 2.0, 1)
    """
    w = ops.cast(w, "float32")
    g = ops.cast(g, "float32")
    axes = unit_axes(len(w.shape), rows)
    units = 1 if axes is None else w.shape[0 if rows else -1]
    g_norm = norm(g, axes)
    max_norm = clipping * ops.maximum(norm(w, axes), eps)
    # `max_norm > 0`: a zero unit's factor is `min(1, inf) = 1`. An
    # overflowing or non-finite norm gives 0 or NaN here (the step's flag).
    return g * ops.minimum(1.0, max_norm / g_norm), g_norm, max_norm, units


def clip_unitwise(
    grads,
    weights,
    rows,
    clipping,
    eps=DEFAULT_EPSILON,
    count=True,
    clip_one=clip_weight,
    add_n=None,
):
    """Adaptive gradient clipping of each weight's dense gradient, unit-wise.

    Args:
        grads: List of float32 gradients (or `None`), the update's final
            gradient.
        weights: List of the weights' current values, in the same order.
        rows: List of Python bools: the units are rows (an embedding table).
        clipping: Python float > 0, `lambda`: the largest ratio of a
            unit's gradient norm to its weight norm.
        eps: Python float > 0, the smallest weight norm a unit is
            measured by (zero-initialised weights can still move).
        count: Python bool, whether to count the clipped units.
        clip_one: `clip_one(g, w, rows, clipping, eps)` -> `(clipped,
            g_norm, max_norm, units)`: one weight (`clip_weight`, or a
            backend's own: TensorFlow's keeps a sparse gradient sparse).
        add_n: Optional `add_n(list)`, the sum of a list of scalars (a
            backend's one op); Python's `sum` by default.

    Returns:
        A `Clipped`.

    Example:

    >>> # One Dense unit: ||w|| = 5, lambda = 0.1: at most 0.5; ||g|| = 10.
    >>> out = clip_unitwise([ops.convert_to_tensor([[6.0], [8.0]])],
    ...                     [ops.convert_to_tensor([[3.0], [4.0]])], [False], 0.1)
    >>> [round(float(v), 6) for v in ops.reshape(out.grads[0], [-1])]
    [0.3, 0.4]
    >>> float(out.clipped_units), out.num_units
    (1.0, 1)
    """
    add_n = add_n or (lambda xs: sum(xs[1:], xs[0]))
    clipped, norms, counts, num_units = [], [], [], 0
    for g, w, row_units in zip(grads, weights, rows):
        if g is None:
            clipped.append(None)
            continue
        g, g_norm, max_norm, units = clip_one(g, w, row_units, clipping, eps)
        clipped.append(g)
        num_units += units
        norms.append(g_norm if len(g_norm.shape) == 0 else ops.sum(g_norm))
        if count:
            counts.append(ops.sum(ops.cast(g_norm > max_norm, "float32")))
    if not norms:
        zero = ops.zeros((), "float32")
        return Clipped(clipped, ops.convert_to_tensor(True), zero if count else None, 0)
    # Unit norms are >= 0 and at most ~1.8e19 when finite: their sum is
    # finite iff each one is.
    all_finite = ops.isfinite(add_n(norms))
    return Clipped(clipped, all_finite, add_n(counts) if count else None, num_units)
