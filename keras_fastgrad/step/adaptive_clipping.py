"""Adaptive gradient clipping (AGC), unit by unit, relative to the weights.

Brock, De, Smith, Simonyan (2021), "High-Performance Large-Scale Image
Recognition Without Normalization" (https://arxiv.org/abs/2102.06171),
section 4.1; optax's `adaptive_grad_clip`. For every unit `i` of a
weight `W` with gradient `G`:

    G_i <- G_i * min(1, lambda * max(||W_i||, eps) / ||G_i||)

with Frobenius norms over the unit. What a unit is, for Keras' weights:

- a kernel (rank >= 2, output axis last: `Dense` `(in, out)`, `Conv1D/2D/3D`
  `(..., in, out)`): one output unit, the norm over every axis but the
  last (the paper's "row of a weight matrix"; for `Dense` and `Conv2D`
  kernels what optax's `unitwise_norm` computes);
- an embedding table (`keras.layers.Embedding`'s `embeddings`, `(vocab,
  dim)`): one token's vector, the norm over every axis but the first. A
  sparse gradient (`tf.IndexedSlices`) is clipped on its rows only,
  duplicate rows added up first: the table is never made dense;
- a vector or a scalar (biases, BatchNorm's `gamma`/`beta`): the whole
  weight is one unit (optax too).

Where optax differs: it squeezes unit axes away first (a `Dense(out)` on a
single input, kernel `(1, out)`, is one unit there, `out` units here) and
takes the norm over the first axis only for rank-3 weights (multi-head
linear layers; here a `Conv1D` kernel `(width, in, out)` has `out` units).
It divides by `max(||G_i||, 1e-6)`; here `min(1, ...)` is exact (a zero
unit's factor is `min(1, inf) = 1`).

A finite gradient whose unit norm overflows float32 (above ~1.8e19) would
get the factor `max_norm / inf = 0`, a silently zero unit: the step drops
such an update instead (`Clipped.all_finite` is false), as it drops a
non-finite one. A NaN or Inf gradient stays non-finite.

The dense maths is `keras_fastgrad.maths.adaptive_clipping` (`keras.ops`,
shared with the JAX step; here with the fused norm, the same op count as
before); the sparse path (`tf.IndexedSlices`) is TensorFlow's own.
"""

import keras

from keras_fastgrad import _compat as compat
from keras_fastgrad._tf_startup import tf
from keras_fastgrad.maths import adaptive_clipping as agc_maths
from keras_fastgrad.maths.adaptive_clipping import (
    DEFAULT_EPSILON,
    unit_axes,
)
from keras_fastgrad.step.gradients import summed_slices
from keras_fastgrad.step.telemetry import AGC_CLIPPED_FRACTION
from keras_fastgrad.step.verdict import COUNT_KEYS


def row_unit_variables(model):
    """The ids of `model`'s embedding tables (units are their rows): a
    trace-time fact read off the layers."""
    return {
        id(w)
        for layer in compat.flatten_layers(model)
        if isinstance(layer, keras.layers.Embedding)
        for w in layer.trainable_weights
        if w.name == "embeddings"
    }


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
        state.telemetry.record_adaptive_clipping(out.clipped_units / max(out.num_units, 1))
    return out.grads, out.all_finite


def before_gate(model, state, grads, divisor):
    """AGC computed before the update's `cond` (a `Clipped`), where the
    update's gradient is the micro-batch's own as it is: one replica, no
    accumulation (the step's single `cond`), no `divisor` (`micro_batches`),
    no noise scale or BatchNorm window in the update. Only its result is
    applied in the update's `cond` (its check too, as before), but its work
    on the last layers' gradients no longer waits for the whole gradient's
    verdict: it can overlap the backward pass of the first ones. The
    weights are read before the update, as in it. `None` otherwise, or
    with AGC off."""
    if (
        state.options.clip_adaptive is None
        or divisor is not None
        or state.noise_scale is not None
        or state.batchnorm is not None
    ):
        return None
    return _clipped(model, state, grads)


def _clipped(model, state, grads):
    variables = model.trainable_variables
    tables = row_unit_variables(model)
    return clip_unitwise(
        grads,
        [v.value for v in variables],
        [id(v) in tables for v in variables],
        state.options.clip_adaptive,
        state.options.clip_adaptive_eps,
        count=AGC_CLIPPED_FRACTION in state.log_keys,
    )


def counted_at_verdict(state):
    """Whether a non-finite update was already counted in
    `nonfinite_count` at its micro-batches' verdict: `skip_nonfinite=False`
    without loss scaling applies non-finite micro-batches and counts them
    while a `nonfinite_*` key is requested; AGC's check then drops their
    update, which counts only if its gradient was finite (an overflow).
    A trace-time Python bool."""
    return (
        state.options.clip_adaptive is not None
        and not state.drops_nonfinite()
        and bool(state.log_keys & COUNT_KEYS)
    )


def both_finite(finite_update, agc_finite):
    """The update's finite check with AGC's (`None`: no check needed).

    AGC's flag is needed even where the gradient was checked before the
    update (one replica, no accumulation): an overflowing unit norm is
    caught only there. It covers every gradient (a unit's norm is finite
    iff the unit is, and AGC keeps a finite unit finite), so the step
    needs no other check without `clip_norm`; with it, `clip_norm`'s own
    (its norm's limit) is kept beside it."""
    if agc_finite is None:
        return finite_update
    if finite_update is None:
        return agc_finite
    return tf.logical_and(finite_update, agc_finite)
