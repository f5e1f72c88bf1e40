"""Adaptive gradient clipping (`clip_adaptive`) on TensorFlow.

The decisions are the core's (`keras_fastgrad.step.adaptive_clipping`), the
dense maths `keras_fastgrad.maths.adaptive_clipping` (`keras.ops`, shared
with the JAX step); this shell adds TensorFlow's fused norm (the same op
count as before) and the sparse path: a table's `tf.IndexedSlices`
gradient clipped on its rows only, duplicate rows added up first (the
table is never made dense). A finite gradient whose unit norm overflows
float32 drops the update (`Clipped.all_finite` is false).
"""

from keras_fastgrad import _compat as compat
from keras_fastgrad._tf_startup import tf
from keras_fastgrad.backend.tensorflow.gradients import summed_slices
from keras_fastgrad.maths import adaptive_clipping as agc_maths
from keras_fastgrad.maths.adaptive_clipping import (
    DEFAULT_EPSILON,
    unit_axes,
)
from keras_fastgrad.step import adaptive_clipping as rules


def clip_unitwise(grads, weights, rows, clipping, eps=DEFAULT_EPSILON, count=True):
    """Adaptive gradient clipping of each weight's gradient, unit-wise:
    `keras_fastgrad.maths.adaptive_clipping.clip_unitwise` (its arguments,
    a `Clipped`), with TensorFlow's fused norm, and a table's sparse
    gradient (`tf.IndexedSlices`) clipped on its rows and kept sparse.

    Example:

    >>> # One Dense unit: ||w|| = 5, lambda = 0.1: at most 0.5; ||g|| = 10.
    >>> out = clip_unitwise([tf.constant([[6.0], [8.0]])],
    ...                     [tf.constant([[3.0], [4.0]])], [False], 0.1)
    >>> out.grads[0].numpy().ravel().tolist(), float(out.clipped_units)
    ([0.30000001192092896, 0.4000000059604645], 1.0)
    """
    # One constant each, shared by every weight's ops.
    bounds = (tf.constant(clipping, tf.float32), tf.constant(eps, tf.float32))
    norm = _xla_norm if compat.in_xla_context() else _fused_norm

    def clip_one(g, w, row_units, clipping, eps):
        return _clip_weight(g, w, row_units, bounds, norm)

    # The loop is the maths' (`keras_fastgrad.maths.adaptive_clipping`).
    return agc_maths.clip_unitwise(
        grads, weights, rows, clipping, eps, count, clip_one=clip_one, add_n=tf.add_n
    )


def _clip_weight(g, w, row_units, bounds, norm):
    """One weight's gradient clipped unit-wise: `(clipped, ||g_i||,
    max_norm_i, number of units)`; a table's sparse gradient on its rows."""
    clipping, eps = bounds
    sparse_rows = isinstance(g, tf.IndexedSlices) and row_units and w.shape.rank > 1
    if not sparse_rows:  # dense (units across a sparse gradient's rows: made dense)
        g = tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
        return agc_maths.clip_weight(g, w, row_units, clipping, eps, norm=norm)
    w = tf.cast(w, tf.float32)
    axes, units = unit_axes(w.shape.rank, row_units), w.shape[0]
    g = summed_slices(g)  # each row once: its norm is the dense row's
    w = tf.gather(w, g.indices)
    values = tf.cast(g.values, tf.float32)
    g_norm = norm(values, axes)
    max_norm = clipping * tf.maximum(norm(w, axes), eps)
    # `max_norm > 0` (checked options): a zero unit's factor is 1. An
    # overflowing or non-finite norm gives 0 or NaN here, and the flag.
    values = values * tf.minimum(1.0, max_norm / g_norm)
    return tf.IndexedSlices(values, g.indices, g.dense_shape), g_norm, max_norm, units


def _fused_norm(x, axes):
    """The L2 norm over `axes` (kept, size 1), of everything for `None`:
    one pass, no temporary (`EuclideanNorm`; about 23% less AGC time on
    the benchmark MLP's shapes, `benchmarks/bench_adaptive_clipping.py`).
    XLA has no kernel for it: `_xla_norm` there."""
    return tf.math.reduce_euclidean_norm(x, **_reduction(x, axes))


def _xla_norm(x, axes):
    """`_fused_norm` in three ops that XLA has (and fuses)."""
    return tf.sqrt(tf.reduce_sum(tf.square(x), **_reduction(x, axes)))


def _reduction(x, axes):
    """The norms' reduction arguments: `axes` kept, or (`None`) the whole
    weight, its axes as a constant (not a `Range`)."""
    if axes is None:
        return {"axis": list(range(x.shape.rank)), "keepdims": False}
    return {"axis": axes, "keepdims": True}


def adaptive_clip(model, state, grads, clipped=None):
    """The step's unit: the update's gradient clipped by
    the `clip_adaptive` option (unchanged when it is `None`), and whether the
    clipped update may be applied (`None`: AGC is off).

    Runs in the update branch, after accumulation, unscaling and the
    replica sum, on the global gradient; the weights are read as they are
    before this update. Records `agc_clipped_fraction` when requested.
    `clipped`: the `Clipped` of `before_gate`, computed before the update's
    `cond`.
    """
    if state.options.clip_adaptive is None:
        return grads, None
    out = _clipped(model, state, grads) if clipped is None else clipped
    if out.clipped_units is not None:
        state.telemetry.record_adaptive_clipping(rules.clipped_fraction(out))
    return out.grads, out.all_finite


def before_gate(model, state, grads, divisor):
    """AGC computed before the update's `cond` (a `Clipped`), where the
    update's gradient is the micro-batch's own as it is: one replica, no
    accumulation (the step's single `cond`), no `divisor` (`micro_batches`),
    no noise scale or BatchNorm window in the update. Only its result is
    applied in the update's `cond` (its check too, as before), but its work
    on the last layers' gradients no longer waits for the whole gradient's
    verdict (`adaptive_clipping.before_gate`, the rule). The weights are
    read before the update, as in it. `None` otherwise, or with AGC off."""
    window_work = state.noise_scale is not None or state.batchnorm is not None
    if not rules.before_gate(state.options.clip_adaptive, divisor is not None, window_work):
        return None
    return _clipped(model, state, grads)


def _clipped(model, state, grads):
    values = [v.value for v in model.trainable_variables]
    return rules.clip(model, grads, values, state.options, state.log_keys, clip_unitwise)
