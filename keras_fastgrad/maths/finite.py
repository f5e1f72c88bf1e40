"""The finite check: one reduction per gradient, a boolean for the step.

Written once in `keras.ops` for both backends' steps (TensorFlow's
`keras_fastgrad.backend.tensorflow.finite`, which passes its own element sums in, JAX's
`keras_fastgrad.backend.jax.step` and `window`, and `step.update`'s
`Shell`). A
sum is non-finite when any of its terms is (NaN and +-Inf propagate), so
one sum per gradient, a single pass with no temporary, decides. The one
false alarm: finite elements whose sum exceeds float32's range (~3.4e38), a
gradient no update could use either; it is dropped like a non-finite one.
The gradients come in dense (`None` entries allowed; a sparse gradient's
stored rows are the caller's: `step.gradients.values` on TensorFlow).
"""

import keras  # noqa: F401  (the doctests')
from keras import ops


def element_sums(grads):
    """List of float32 scalars: each gradient's element sum (`None`: 0).

    Example:

    >>> [float(s) for s in element_sums([keras.ops.ones([2, 3]), None])]
    [6.0, 0.0]
    """
    return [
        ops.convert_to_tensor(0.0) if g is None else ops.cast(ops.sum(g), "float32") for g in grads
    ]


def marks(grads, loss=None, sums=element_sums):
    """float32 vector: each gradient's element sum (`None`: 0), then the
    loss if given; an entry is non-finite exactly when its gradient (or the
    loss) holds NaN/Inf (or sums beyond float32's range).

    Example:

    `sums`: how the element sums are taken (`element_sums`; the
    TensorFlow shell passes its own, `keras_fastgrad.backend.tensorflow.finite`).

    >>> m = marks([keras.ops.array([1.0, 2.0]), None], keras.ops.array(0.5))
    >>> keras.ops.convert_to_numpy(m).tolist()
    [3.0, 0.0, 0.5]
    """
    entries = sums(grads)
    if loss is not None:
        entries.append(ops.cast(loss, "float32"))
    return ops.stack(entries)


def is_finite(marks_vector):
    """Boolean scalar: every entry of a `marks` vector is finite."""
    return ops.all(ops.isfinite(marks_vector))


def summarize(marks_vector, with_loss=True):
    """Where a micro-batch went bad, from its `marks` vector.

    Args:
        marks_vector: float32 vector from `marks` (a static length).
        with_loss: Python bool, whether its last entry is the loss's (then
            it is left out of the count, and reported by neither value).

    Returns:
        Tuple `(first_bad, num_bad)`: the int32 index of the first
        non-finite gradient, or -1 when every gradient is finite (the loss
        alone was non-finite, or the model has no trainable variables); the
        int32 number of non-finite gradients (a gradient whose element sum
        overflows float32 counts: the check drops it).

    Example:

    >>> first, n = summarize(marks(
    ...     [keras.ops.array([1.0]), None, keras.ops.array([float("nan")])],
    ...     keras.ops.array(0.5)))
    >>> int(first), int(n)
    (2, 1)
    >>> [int(v) for v in summarize(keras.ops.array([1.0, float("inf")]), with_loss=False)]
    [1, 1]
    """
    bad = ops.cast(ops.logical_not(ops.isfinite(marks_vector)), "int32")
    if with_loss:  # the loss's entry (last) weighs 0 in the count
        num_grads = marks_vector.shape[0] - 1
        num_bad = ops.sum(bad * ops.convert_to_tensor([1] * num_grads + [0], "int32"))
    else:
        num_bad = ops.sum(bad)
    # The first bad entry is a gradient's whenever one is bad (the loss's
    # entry comes last), and only then is it reported.
    first = ops.argmax(bad, axis=0)
    return ops.where(num_bad > 0, first, -1), num_bad


def all_finite(grads, sums=element_sums):
    """Boolean scalar: every element of every gradient is finite (`True`
    for none); `sums` as in `marks`.

    Example:

    >>> bool(all_finite([keras.ops.array([1.0, 2.0]), None]))
    True
    >>> bool(all_finite([keras.ops.array([1.0, float("inf")])]))
    False
    """
    if not any(g is not None for g in grads):
        return ops.convert_to_tensor(True)
    return is_finite(marks(grads, sums=sums))
