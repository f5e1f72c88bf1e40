"""The gradient noise scale in the TensorFlow step: how the step reads and
writes `NoiseScale`'s variables (the rules, the estimators and the keys:
`keras_fastgrad.step.noise_scale`).

TensorFlow's part: squared norms of sparse gradients (`IndexedSlices`, on
their rows) as one fused `l2_loss` each, the slices' `tf.cond`, the small
batches summed over the replicas of a `tf.distribute` strategy, and the
window's sums added with one `AssignAdd`.
"""

from keras_fastgrad._tf_startup import tf
from keras_fastgrad.backend.tensorflow.clipping import half_squares
from keras_fastgrad.backend.tensorflow.gradients import summed_rows
from keras_fastgrad.backend.tensorflow.replicas import replica_sum
from keras_fastgrad.backend.tensorflow.variables import increment
from keras_fastgrad.step import noise_scale as core


def _sum_of_squares(grads):
    # one fused `l2_loss` per gradient (sparse: its rows, duplicates summed)
    return 2.0 * half_squares([tf.cast(summed_rows(g), tf.float32) for g in grads])


def squared_norm(grads):
    """`core.squared_norm` of `grads` (`None` for no gradients)."""
    return core.squared_norm(grads, _sum_of_squares)


def small_batch(grads, rows, normaliser):
    """One small batch's measures, `[|g|^2, 1/n, 1, D^2/n, D]`
    (`core.small_batch`).

    Args:
        grads: Its gradients times `normaliser` (as the step weights them).
        rows: float32 scalar, its number of (real) rows `n`.
        normaliser: float32 scalar, its loss normaliser `D`.
    """
    return core.small_batch_of(grads, rows, normaliser, _sum_of_squares)


def slice_measure():
    """The `measure` pair `slicing.sliced_gradients` takes
    (`core.slice_measure`, with `tf.cond`)."""
    return core.slice_measure(tf.cond, _sum_of_squares)


def record_small(noise, measures, include):
    """Adds this replica's small batch(es) (`small_batch`, summed if
    several) to the window of `noise` (a `core.NoiseScale`): summed over
    the replicas, left out unless `include`. Runs in replica context,
    outside any `cond` (the variables are written once for all)."""
    (measures,) = replica_sum([measures])
    increment(noise.window, core.included(measures, include))


def record_window(noise, grads):
    """At the update, with the window's (global, unscaled, unclipped)
    gradient: `noise`'s variables after the window (`core.after_window`)."""
    big_sq = squared_norm(grads)
    state = core.Estimates(*(tf.convert_to_tensor(v.value) for v in noise.state()))
    new = core.after_window(state, big_sq)
    for variable, value in zip(noise.state()[:4], new[:4]):  # (the decay kept)
        variable.assign(value)
