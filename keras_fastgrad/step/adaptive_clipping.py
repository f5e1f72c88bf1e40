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

This module holds AGC's decisions in the step, backend-neutral: which
weights have row units (`row_unit_variables`), the update's gradient
clipped and what is counted of it (`clip`, `clipped_fraction`), when AGC
runs before the update's `cond` (`before_gate`), whether a non-finite
update was counted already (`counted_at_verdict`; `telemetry.counted_once`), the
update's check with AGC's (`both_finite`). The dense maths is `keras_fastgrad.maths.adaptive_clipping`;
the shells apply it: TensorFlow's `keras_fastgrad.backend.tensorflow.adaptive_clipping`
(its fused norm, and the sparse path for `tf.IndexedSlices`), JAX's
`keras_fastgrad.backend.jax.agc`.
"""

import keras
from keras import ops

from keras_fastgrad import _compat as compat
from keras_fastgrad.maths import adaptive_clipping as maths
from keras_fastgrad.maths.adaptive_clipping import DEFAULT_EPSILON, unit_axes
from keras_fastgrad.step.telemetry import AGC_CLIPPED_FRACTION
from keras_fastgrad.step.verdict import COUNT_KEYS

__all__ = [
    "DEFAULT_EPSILON",
    "unit_axes",
    "row_unit_variables",
    "clip",
    "clipped_fraction",
    "before_gate",
    "counted_at_verdict",
    "both_finite",
]


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


def clip(model, grads, values, options, log_keys, clip_unitwise=maths.clip_unitwise):
    """The update's gradient clipped by the `clip_adaptive` option, each
    weight's units read off `model` (`row_unit_variables`).

    Args:
        model: The `FastGradModel` (its `trainable_variables`' order).
        grads: The update's float32 gradients, in that order.
        values: The trainable variables' values before the update.
        options: The step's `StepOptions` (`clip_adaptive`, its `eps`).
        log_keys: The keys measured: the clipped units are counted only
            for `agc_clipped_fraction`.
        clip_unitwise: `maths.adaptive_clipping.clip_unitwise`, or a
            shell's (TensorFlow's: its fused norm, sparse rows kept sparse).

    Returns:
        A `maths.adaptive_clipping.Clipped`.
    """
    tables = row_unit_variables(model)
    return clip_unitwise(
        grads,
        values,
        [id(v) in tables for v in model.trainable_variables],
        options.clip_adaptive,
        options.clip_adaptive_eps,
        count=AGC_CLIPPED_FRACTION in log_keys,
    )


def clipped_fraction(clipped):
    """float32 scalar, the `agc_clipped_fraction` key: the fraction of the
    weights' units that a `Clipped` clipped (`clipped_units` counted).

    Example:

    >>> from keras_fastgrad.maths.adaptive_clipping import Clipped
    >>> clipped_fraction(Clipped(None, True, 3.0, 4))
    0.75
    """
    return clipped.clipped_units / max(clipped.num_units, 1)


def before_gate(clip_adaptive, divided, window_work):
    """Whether AGC is computed before the update's `cond` (a Python bool),
    where the update's gradient is the micro-batch's own as it is: no
    division (`divided`: `micro_batches`), no noise scale or BatchNorm
    window in the update (`window_work`). Only its result is applied in
    the update's `cond` (its check too), but its work on the last layers'
    gradients no longer waits for the whole gradient's verdict: it can
    overlap the backward pass of the first ones.

    Example:

    >>> before_gate(0.01, False, False), before_gate(0.01, True, False)
    (True, False)
    """
    return clip_adaptive is not None and not divided and not window_work


def counted_at_verdict(clip_adaptive, drops_nonfinite, log_keys):
    """Whether a non-finite update was already counted in
    `nonfinite_count` at its micro-batches' verdict (a Python bool):
    `skip_nonfinite=False` without loss scaling applies non-finite
    micro-batches and counts them while a `nonfinite_*` key is requested;
    AGC's check then drops their update, which counts only if its gradient
    was finite (an overflow).

    Example:

    >>> counted_at_verdict(0.01, False, {"nonfinite_count"})
    True
    >>> counted_at_verdict(0.01, True, {"nonfinite_count"})
    False
    """
    return clip_adaptive is not None and not drops_nonfinite and bool(set(log_keys) & COUNT_KEYS)


def both_finite(finite_update, agc_finite):
    """The update's finite check with AGC's (`None`: no check needed).

    AGC's flag is needed even where the gradient was checked before the
    update (one replica, no accumulation): an overflowing unit norm is
    caught only there. It covers every gradient (a unit's norm is finite
    iff the unit is, and AGC keeps a finite unit finite), so the step
    needs no other check without `clip_norm`; with it, `clip_norm`'s own
    (its norm's limit) is kept beside it.

    Example:

    >>> both_finite(None, None) is None
    True
    >>> bool(both_finite(ops.convert_to_tensor(True), ops.convert_to_tensor(False)))
    False
    """
    if agc_finite is None:
        return finite_update
    if finite_update is None:
        return agc_finite
    return ops.logical_and(finite_update, agc_finite)
