"""Finite check: one fused reduction per gradient, computed in the step.

`tf.debugging.check_numerics` does nothing under XLA, so the check is data
the step uses. A sum is non-finite when any of its terms is (NaN and +-Inf
propagate), so one `reduce_sum` per gradient, a single pass with no
temporary, decides; sparse gradients (`tf.IndexedSlices`, from embedding
lookups) are summed over their rows only, never densified. The one false
alarm: finite elements whose sum exceeds float32's range (~3.4e38), a
gradient no update could use either; it is dropped like a non-finite one.
Under several replicas one flag per gradient is summed over them, so a NaN
on any replica drops the micro-batch everywhere.

The maths is `keras_fastgrad.maths.finite` (shared with the JAX step);
this module adds the sparse rows and the replicas' flags. Cost per step:
one `Sum` per gradient (gradients of the same rank share
one constant for their axes; a scalar needs none), one `Pack`, one
`IsFinite` and one `All`. Where it went bad (`summarize`) is worked out
only in the branch of a dropped micro-batch.
"""

from keras_fastgrad._tf_startup import tf
from keras_fastgrad.backend.tensorflow.gradients import values
from keras_fastgrad.maths import finite as _maths

# Written once for both backends (`keras_fastgrad.maths.finite`).
is_finite = _maths.is_finite
summarize = _maths.summarize


def _values(grads):
    return [None if g is None else values(g) for g in grads]


def element_sums(grads):
    """`maths.finite.element_sums` in TensorFlow's ops: gradients of the
    same rank share one constant for their reduction axes (`tf.reduce_sum`
    would make one per call), a scalar needs none: what the step's traced
    op count is held to. `grads`: dense (or `None`)."""
    axes = {}  # one constant per rank, shared by the sums of that rank

    def total(g):
        if g is None:
            return tf.constant(0.0)
        rank = g.shape.rank
        if rank == 0:
            return tf.cast(g, tf.float32)
        if rank is not None and rank not in axes:
            axes[rank] = tf.constant(list(range(rank)), tf.int32)
        return tf.cast(tf.reduce_sum(g, axis=axes.get(rank)), tf.float32)

    return [total(g) for g in grads]


def all_finite(grads):
    """Boolean scalar: every element of every gradient is finite.

    Example:

    >>> bool(all_finite([tf.constant([1.0, 2.0]), None]))
    True
    >>> bool(all_finite([tf.constant([1.0, float("inf")])]))
    False
    """
    return _maths.all_finite(_values(grads), sums=element_sums)


def marks(grads, loss):
    """float32 vector `[len(grads) + 1]`: each gradient's element sum
    (`None`: 0), then the loss; an entry is non-finite exactly when its
    gradient (or the loss) holds NaN/Inf. One reduction per gradient and
    one stack: the whole per-step cost of the check."""
    return _maths.marks(_values(grads), loss, sums=element_sums)


def to_flags(marks_vector):
    """float32 1/0 per entry: summed over replicas, it keeps its meaning."""
    return tf.cast(tf.logical_not(tf.math.is_finite(marks_vector)), tf.float32)


def from_flags(flags):
    """Back from replica-summed flags to a `marks` vector (NaN where any
    replica was non-finite)."""
    return tf.where(flags > 0, float("nan"), 0.0)
