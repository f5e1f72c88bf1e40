"""BatchNorm window statistics in the JAX step (`batchnorm_statistics="window"`).

The contract and the rules: `keras_fastgrad.step.batchnorm` (the moments
recorded, kept, pooled and applied; Chan's combination:
`keras_fastgrad.maths.batchnorm`). The forward pass normalises each
micro-batch (slice) by its own moments, and the moving mean and variance
move once per update from the moments pooled over the window; the partial
window at an epoch's end moves them once more (`jax_window._flush`).

On JAX the state is values: the window's moments ride in the state tuple
as TensorFlow's variable `batchnorm_window_moments` (`[3, features]` of all
layers side by side; the step state's `WindowMoments`, so a file saved on
either backend with a window pending resumes on the other). The forward
(`compute_loss_and_updates`, run by `forward` under
`_compat.batchnorm_recording`) hands back, in that slot, the window with
this forward's moments combined in, and its moving statistics held; the
step then keeps it (`end_micro_batch`, where the micro-batch is kept) and
moves the statistics where the window completes. What is JAX's here:
where the values sit in the state tuple (`Pool`), and a loss of no rows
made a scalar for `jax.grad`. Under `micro_batches`
the slices' forwards chain through the same slot (Keras' layer state is
the scan's carry), so the slot ends holding every slice's moments.
"""

from typing import NamedTuple

from keras import ops

from keras_fastgrad.maths.batchnorm import combined
from keras_fastgrad.step import batchnorm as core


class Pool(NamedTuple):
    """Where a model's pooled BatchNorm state sits in the state tuple's
    non-trainable values (`pool`).

    Fields:
        layers: The pooled `BatchNormalization` layers.
        sizes: Their feature counts.
        window: Int, the window moments' position.
        moving: Per layer, the positions of `(moving_mean, moving_variance)`.
        steps: Int, `accumulation_steps`.
    """

    layers: list
    sizes: list
    window: int
    moving: list
    steps: int


def pool(model):
    """The model's `Pool`, or `None` when its moments are not pooled (its
    step state built with `WindowMoments`: `core.pools_window`)."""
    unit = model.fastgrad_step_state.batchnorm
    if unit is None:
        return None
    where = {id(v): i for i, v in enumerate(model.non_trainable_variables)}
    return Pool(
        layers=unit.layers,
        sizes=unit.sizes,
        window=where[id(unit.window)],
        moving=[
            (where[id(layer.moving_mean)], where[id(layer.moving_variance)])
            for layer in unit.layers
        ],
        steps=model.fastgrad_step_state.options.accumulation_steps,
    )


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
    `compute_loss_and_updates` on the state's values) with each BatchNorm's
    moments combined into the window's slot of the returned non-trainable
    values and its moving statistics held (`core.Recorder`).

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
    recorder = core.Recorder(where.layers)
    with recorder.recording():
        loss, (unscaled, y_pred, new_ntv, mv) = compute(trainable, ntv, *args, **kwargs)
    new_ntv = list(new_ntv)
    new_ntv[where.window] = combined(ntv[where.window], recorder.stacked(where.sizes))
    for pair in where.moving:
        for i in pair:
            new_ntv[i] = ntv[i]
    return loss, (unscaled, y_pred, new_ntv, mv)


def end_micro_batch(model, out_ntv, ntv, keep, micro_step=None):
    """The window after a micro-batch (its moments kept where `keep`,
    `core.kept`) and, where the window is complete
    (`core.completes_window`), the moving statistics' one step from it and
    an empty window. `out_ntv`: the step's outgoing non-trainable values
    (`forward`'s slot in it), `ntv` the incoming. Returns `out_ntv`."""
    where = pool(model)
    if where is None:
        return out_ntv
    out_ntv = list(out_ntv)
    out_ntv[where.window] = core.kept(keep, out_ntv[where.window], ntv[where.window])
    return _applied(where, out_ntv, core.completes_window(micro_step, where.steps))


def apply_window(model, ntv):
    """The pending window's step of the moving statistics, the window
    emptied (the epoch-end flush; an empty window changes nothing)."""
    where = pool(model)
    return list(ntv) if where is None else _applied(where, list(ntv), None)


def _applied(where, ntv, complete):
    moving = [tuple(ntv[i] for i in pair) for pair in where.moving]
    window = ntv[where.window]
    new, ntv[where.window] = core.moved(window, where.layers, where.sizes, moving, complete)
    for pair, values in zip(where.moving, new):
        for i, value in zip(pair, values):
            ntv[i] = value
    return ntv
