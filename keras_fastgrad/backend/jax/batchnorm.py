"""BatchNorm window statistics in the JAX step (`batchnorm_statistics="window"`).

The contract of TensorFlow's `keras_fastgrad.step.batchnorm`: the forward
pass normalises each micro-batch (slice) by its own moments, and the
moving mean and variance move once per update, with the layer's momentum,
from the moments pooled over the window (`keras_fastgrad.maths.batchnorm`:
Chan's combination, weighted by rows or mask weights): what `keras.Model`
does on the concatenated batch. A dropped micro-batch (not finite) is left
out of the pool, like its gradient; the partial window at an epoch's end
moves them once more (`jax_window._flush`).

On JAX the state is values: the window's moments ride in the state tuple
as TensorFlow's variable `batchnorm_window_moments` (`[3, features]` of all
layers side by side; the step state's `WindowMoments`, so a file saved on
either backend with a window pending resumes on the other). The forward
(`compute_loss_and_updates`, run by `forward` under
`_compat.batchnorm_recording`) hands back, in that slot, the window with
this forward's moments combined in, and its moving statistics held; the
step then keeps it (`end_micro_batch`, where the micro-batch is kept) and
moves the statistics where the window completes. Under `micro_batches`
the slices' forwards chain through the same slot (Keras' layer state is
the scan's carry), so the slot ends holding every slice's moments.
"""

import jax
from keras import ops

from keras_fastgrad import _compat as compat
from keras_fastgrad.maths import batchnorm as maths
from keras_fastgrad.step import accumulation
from keras_fastgrad.step.batchnorm import _refuse_unrecorded


class Pool:
    """Where a model's pooled BatchNorm state sits in the state tuple's
    non-trainable values.

    Args:
        model: The `FastGradModel`, its step state built with
            `WindowMoments` (`batchnorm.pools_window`).
    """

    def __init__(self, model):
        unit = model.fastgrad_step_state.batchnorm
        where = {id(v): i for i, v in enumerate(model.non_trainable_variables)}
        self.layers = unit.layers
        self.sizes = unit.sizes
        self.window = where[id(unit.window)]
        self.moving = [
            (where[id(layer.moving_mean)], where[id(layer.moving_variance)])
            for layer in self.layers
        ]
        self.steps = model.fastgrad_step_state.options.accumulation_steps


def pool(model):
    """The model's `Pool`, or `None` when its moments are not pooled."""
    if model.fastgrad_step_state.batchnorm is None:
        return None
    return Pool(model)


def _scalar_loss(compute):
    """`compute` whose loss is a scalar on a batch of no rows too: Keras'
    losses leave the values of no rows unreduced (shape `(0,)`), which
    `jax.grad` refuses; their sum, 0, is what TensorFlow's tape
    differentiates there (a zero gradient; the loss logged as 0). (The
    multi-task step's losses, a tuple of task losses, pass as they are.)"""

    def scalar(*args, **kwargs):
        out = compute(*args, **kwargs)
        loss, (unscaled, *rest) = out
        if tuple(getattr(loss, "shape", ())) != (0,):
            return out
        return ops.sum(loss), (ops.sum(unscaled), *rest)

    return scalar


def forward(model, compute, trainable, ntv, *args, **kwargs):
    """`compute(trainable, ntv, *args, **kwargs)` (Keras'
    `compute_loss_and_updates` on the state's values) with each BatchNorm's moments combined into the window's slot of the
    returned non-trainable values and its moving statistics held.

    Returns:
        `compute`'s `(loss, (unscaled_loss, y_pred, ntv, metrics))`.

    Raises:
        ValueError: (trace time) for a BatchNorm that assigns its moving
            statistics without Keras' moments computation.
    """
    compute = _scalar_loss(compute)
    where = pool(model)
    if where is None:
        return compute(trainable, ntv, *args, **kwargs)
    recorded = {}

    def record(layer, inputs, mask, mean, variance):
        n = maths.counts(inputs, mask, layer.axis)
        moments = jax.lax.stop_gradient(maths.moments_stack(n, mean, variance))
        previous = recorded.get(id(layer))  # several calls of a layer: all pooled
        recorded[id(layer)] = moments if previous is None else maths.combined(previous, moments)

    def held(layer):
        if id(layer) not in recorded:
            _refuse_unrecorded(layer)

    with compat.batchnorm_recording(where.layers, record, held):
        loss, (unscaled, y_pred, new_ntv, mv) = compute(trainable, ntv, *args, **kwargs)
    stacks = [
        recorded.get(id(layer), ops.zeros((3, size), "float32"))
        for layer, size in zip(where.layers, where.sizes)
    ]
    new_ntv = list(new_ntv)
    new_ntv[where.window] = maths.combined(ntv[where.window], ops.concatenate(stacks, axis=1))
    for pair in where.moving:
        for i in pair:
            new_ntv[i] = ntv[i]
    return loss, (unscaled, y_pred, new_ntv, mv)


def end_micro_batch(model, out_ntv, ntv, keep, micro_step=None):
    """The window after a micro-batch (its moments kept where `keep`) and,
    where the window is complete (every micro-step without
    `accumulation_steps`), the moving statistics' one step from it and an
    empty window. `out_ntv`: the step's outgoing non-trainable values
    (`forward`'s slot in it), `ntv` the incoming. Returns `out_ntv`."""
    where = pool(model)
    if where is None:
        return out_ntv
    out_ntv = list(out_ntv)
    if keep is not True:
        out_ntv[where.window] = ops.where(keep, out_ntv[where.window], ntv[where.window])
    complete = None if micro_step is None else accumulation.is_complete(micro_step, where.steps)
    return _applied(where, out_ntv, complete)


def apply_window(model, ntv):
    """The pending window's step of the moving statistics, the window
    emptied (the epoch-end flush; an empty window changes nothing)."""
    where = pool(model)
    return list(ntv) if where is None else _applied(where, list(ntv), None)


def _applied(where, ntv, complete):
    window = ntv[where.window]
    has_samples, mean, variance = maths.pooled(window)
    offset = 0
    for layer, size, pair in zip(where.layers, where.sizes, where.moving):
        part = slice(offset, offset + size)
        offset += size
        for i, new in zip(pair, (mean[part], variance[part])):
            value = maths.momentum_step(ntv[i], new, has_samples[part], layer.momentum)
            ntv[i] = value if complete is None else ops.where(complete, value, ntv[i])
    empty = ops.zeros_like(window)
    ntv[where.window] = empty if complete is None else ops.where(complete, empty, window)
    return ntv
