"""Clipping by global L2 norm, applied once to each update's final gradient.

One pass: `tf.nn.l2_loss` per gradient (one fused op: half its sum of
squares), then scalar maths. The norm is computed without overflow: the
sum of squares of finite values can exceed float32's range (a gradient of
norm 2e20 squares to 4e40); only then (a `cond` whose common branch is one
`sqrt`) the sum is recomputed on the gradient times 2**-80, an exact
power of two: the squares of finite float32 values then fit, and values
small enough to underflow weigh nothing against a norm above 2**64. The
maths is `keras_fastgrad.maths.norms`, shared with the JAX step. Sparse gradients (`tf.IndexedSlices`) are measured on their rows,
duplicate rows added up first, so the norm is that of the dense gradient.
A clipped sparse gradient comes out with each row once (still sparse):
Keras' Adam, RMSprop and Adagrad square an `IndexedSlices`' values row by
row, so a repeated id would add its parts' squares, not the square of its
row (the dense gradient's); Keras' own `global_clipnorm` hands them a dense
gradient (its `v * scale` makes the `IndexedSlices` dense), and so the
clipped update is that dense step, as under accumulation and on JAX.
"""

from keras_fastgrad._tf_startup import tf
from keras_fastgrad.backend.tensorflow.gradients import scale, summed_rows, summed_slices
from keras_fastgrad.maths import norms


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
    unit, root = scaled_norm(grads)
    return unit * root


def scaled_norm(grads):
    """The global norm as `unit * root` (`unit` is 1, or 2**80 when the
    squares overflow: `maths.norms.scaled_norm`), sparse gradients measured
    on their summed rows."""
    parts = [tf.cast(summed_rows(g), tf.float32) for g in grads if g is not None]
    return norms.scaled_norm(parts, half_squares=half_squares)


def half_squares(parts):
    """Half of `maths.norms.sum_squares`, in TensorFlow's fused ops: one `L2Loss`
    per gradient and one `AddN` for the total (what the step's traced op
    count is held to)."""
    return tf.add_n([tf.nn.l2_loss(p) for p in parts])


def clip_by_global_norm(grads, clip_norm, norm, checked=False):
    """Scales `grads` so that their global norm is at most `clip_norm`.

    Args:
        grads: List of gradient tensors, `tf.IndexedSlices` or `None`.
        clip_norm: Python float > 0.
        norm: float32 scalar, the global norm of `grads` (computed once by
            the caller, which also logs it), or a pair `(unit, root)` from
            `scaled_norm` (then the factor never overflows).
        checked: Python bool, whether the caller applies the result only
            when the norm is finite (the step gates its update on that):
            then a non-finite norm needs no guard here.

    Returns:
        Tuple `(clipped_grads, was_clipped)`, a sparse gradient with each
        row once (duplicates added up: the dense gradient's rows, which
        the optimizer then applies as Keras applies the dense one). A NaN
        norm gives non-finite gradients (unless `checked`), which the
        step's check before the update drops.

    Example:

    >>> clipped, was_clipped = clip_by_global_norm(
    ...     [tf.constant([3.0, 4.0])], 1.0, tf.constant(5.0))
    >>> clipped[0].numpy().tolist(), bool(was_clipped)
    ([0.6000000238418579, 0.800000011920929], True)
    """
    clipping = norms.clip(
        clip_norm, checked=checked, scaled=norm if isinstance(norm, tuple) else (1.0, norm)
    )
    return scaled_by(grads, clipping.factor), clipping.was_clipped


def scaled_by(grads, factor):
    """Each gradient times `factor` (a float32 scalar), a sparse one with
    each row once (`gradients.summed_slices`: the dense gradient's rows,
    which the optimizer then applies as Keras applies the dense one)."""
    return [
        scale(summed_slices(g) if isinstance(g, tf.IndexedSlices) else g, factor) for g in grads
    ]
