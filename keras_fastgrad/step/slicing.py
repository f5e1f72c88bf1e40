"""In-step micro-batching: one batch, `m` slices, one gradient.

The batch of n samples is padded to `m * s` rows, s = ceil(n / m) (with
copies of its first rows, so the padding is as finite as the data), and a
`tf.while_loop` runs forward and backward on one slice at a time, adding the
slice's gradient to float32 loop-carried sums: activation memory is that of
one slice. Padded rows are masked out of every output loss (whatever its
rank: per-sample, per-timestep, per-pixel), and each slice's gradient is
multiplied by its loss's normaliser `D_i` (`keras_fastgrad.step.weighting`), so
the sums are gradients of the summed losses and dividing by the batch's
normaliser gives exactly the gradient of the un-split batch, masks and
sample weights included, for any n (tests: uneven splits, masked sequences,
per-pixel losses, SGD and Adam, XLA). The predictions keep their masks, so
the metrics see what they would on the whole batch. Weight regularisation
enters every slice's loss once; what the slices' shares add beyond the
batch's normaliser is taken back after the loop.

BatchNormalization normalises each slice by the slice's moments (ghost
batch norm); its moving statistics take one step per batch from the
moments pooled over the slices' real rows (`keras_fastgrad.step.batchnorm`;
`batchnorm_statistics="micro_batch"`: one step per slice, padding rows
included). Limits: other layers that mix samples see slices, not the
batch; losses added with `add_loss` inside `call` are computed per slice.
"""

import collections

import tensorflow as tf
from keras import tree

from keras_fastgrad import _compat as compat
from keras_fastgrad._compat import get_keras_mask, set_keras_mask
from keras_fastgrad.multitask.merger import regularization_loss, task_losses, task_names
from keras_fastgrad.step.batchnorm import slice_rows
from keras_fastgrad.step.forward import call_for_training, watching
from keras_fastgrad.step.replicas import num_replicas
from keras_fastgrad.step.weighting import LossShares, Share


def first_input(x):
    """The first input tensor of `x`: the step reads the batch size from it.

    Raises:
        ValueError: when `x` holds no tensor (`fit([None], y)`): without
            this, the lookup's `StopIteration` would end the epoch silently
            after zero steps. `keras.Model` raises `ValueError` here too.
    """
    for t in tree.flatten(x):
        if t is not None:
            return t
    raise ValueError(
        "`x` must hold at least one input tensor: the train step reads the "
        "batch size from the first input that is not None. Received: "
        f"x={x!r} (no tensor). Fix: pass the input data, e.g. "
        "`model.fit(x_train, y_train)` with `x_train` an array, or a "
        "list/dict of arrays with one per model input."
    )


def _pad_and_split(t, order, slices):
    """`[n, ...]` -> `[slices, s, ...]`: the rows in `order` (the batch's
    rows, then copies of its first rows as padding)."""
    t = tf.gather(tf.convert_to_tensor(t), order)
    return tf.reshape(t, tf.concat([[slices, -1], tf.shape(t)[1:]], 0))


def sliced_gradients(
    model, x, y, sample_weight, variables, scaling, slices, merger=None, measure=None
):
    """Forward and backward of `model` on `slices` slices of one batch.

    Args:
        model: The `FastGradModel` (uses its training loss and `call`).
        x, y, sample_weight: The batch, as Keras unpacks it.
        variables: The trainable variables the tape watches.
        scaling: The step's `LossScaling` unit.
        slices: Python int >= 2.
        merger: The model's `multitask.TaskMerger`, or `None`. With one,
            each task's gradient is summed over the slices on its own, and
            the sums (the task gradients of the whole batch) are merged once
            after the loop: the same update as the un-split step.
        measure: Optional pair `(fn, zero)`: `fn(grads, rows, normaliser,
            index)` returns a vector (shaped as the tensor `zero`) from
            each slice's (weighted) gradients, real rows, normaliser and
            index; the vectors are summed over the slices
            (`noise_scale.slice_measure`: slices are small batches).

    Returns:
        `(loss, y_pred, grads, share)`: the batch loss as Keras would
        compute it on the whole batch; the predictions for the whole batch
        (with their masks); the float32 gradients of the whole batch's loss
        multiplied by `share.actual` (times the replicas for mean
        reductions, as `weighting` prescribes), `None` where a variable gets
        no gradient; and the batch's share (`share.real` its normaliser,
        `share.mean` whether the window divides by it). With `measure`, a
        fifth item: the sum of its vectors.
    """
    batch = _split(x, y, sample_weight, slices)
    out_spec = model.compute_output_spec(tree.map_structure(lambda t: t[0], batch.x))
    facts = {}  # trace-time facts of the body, the same for every slice
    body = _loop_body(model, batch, variables, scaling, merger, facts, measure)
    start = _initial_loop_values(model, batch, variables, out_spec, merger)
    if measure is not None:  # the measures' sum rides along
        start += (measure[1],)
    _, sums, loss_sum, actual_sum, real_sum, outputs, masks, *measured = tf.while_loop(
        lambda i, *_: i < slices,
        body,
        start,
        maximum_iterations=slices,
    )
    sums = [
        [s if present else None for s, present in zip(row, has)]
        for row, has in zip(sums, facts["has_grad"])
    ]
    # `"sum"`: the batch's loss is the plain sum (its normaliser is 1).
    real = real_sum if facts["mean"] else tf.constant(1.0)
    # Regularisation: in the plain loss, or the last of the task losses.
    loss_sum, regularized = _take_back_extra_regularization(
        model,
        variables,
        sums[-1],
        loss_sum,
        actual_sum - real,
        num_replicas() if facts["mean"] else 1,
    )
    if merger is None:
        grads = regularized
    else:  # the whole batch's task gradients, merged once
        grads = _merged_tasks(model, merger, sums, regularized, actual_sum, loss_sum)
    y_pred = _whole_batch_predictions(outputs, masks, facts["has_mask"], out_spec, batch.n)
    share = Share(real, real, facts["mean"])
    return (loss_sum / tf.maximum(real, 1e-30), y_pred, grads, share, *measured)


class _Slices(
    collections.namedtuple(
        "_Slices",
        [
            "n",
            "size",
            "slices",
            "rows",
            "x",
            "y",
            "sample_weight",
        ],
    )
):
    """One batch as `[slices, size, ...]` tensors: `n` real rows, `rows` the
    `[slices, size]` validity of each row, `x`, `y`, `sample_weight` the
    split structures (`None` where the batch has none)."""

    def slice(self, i):
        """The `i`-th slice's `(x, y, sample_weight)`."""
        take = lambda t: t[i]  # noqa: E731
        return (
            tree.map_structure(take, self.x),
            None if self.y is None else tree.map_structure(take, self.y),
            None if self.sample_weight is None else tree.map_structure(take, self.sample_weight),
        )


def _split(x, y, sample_weight, slices):
    """The batch in `slices` slices of `ceil(n / slices)` rows."""
    n = tf.shape(first_input(x))[0]
    size = (n + slices - 1) // slices
    pad = size * slices - n
    rows = tf.reshape(tf.concat([tf.ones([n], tf.bool), tf.zeros([pad], tf.bool)], 0), [slices, -1])
    # Padding rows are copies of real rows, not zeros: a zero row can be
    # NaN in the forward pass (a fully masked sequence pools to 0/0), and
    # NaN times the mask that removes the row from the loss is still NaN.
    order = tf.math.floormod(tf.range(size * slices), n)
    split = lambda t: _pad_and_split(t, order, slices)  # noqa: E731
    return _Slices(
        n=n,
        size=size,
        slices=slices,
        rows=rows,
        x=tree.map_structure(split, x),
        y=None if y is None else tree.map_structure(split, y),
        sample_weight=None if sample_weight is None else tree.map_structure(split, sample_weight),
    )


def _initial_loop_values(model, batch, variables, out_spec, merger):
    """The loop's start: slice 0, zero sums (one row per loss), zero
    totals, empty arrays for the predictions and their masks."""
    num_losses = 1
    if merger is not None:  # one sum per task, and the regularisation's
        compile_loss = compat.compile_loss(model)
        if not compile_loss.built:  # (the task names come with its build)
            compile_loss.build(tree.map_structure(lambda t: t[0], batch.y), out_spec)
        num_losses = len(task_names(model)) + 1
    flat_spec = tree.flatten(out_spec)
    return (
        tf.constant(0),
        [[tf.zeros(v.shape, tf.float32) for v in variables] for _ in range(num_losses)],
        tf.constant(0.0),
        tf.constant(0.0),
        tf.constant(0.0),
        [tf.TensorArray(s.dtype, size=batch.slices, element_shape=None) for s in flat_spec],
        [tf.TensorArray(tf.bool, size=batch.slices, element_shape=None) for _ in flat_spec],
    )


def _loop_body(model, batch, variables, scaling, merger, facts, measure=None):
    """The `tf.while_loop` body: one slice forward and backward, its
    gradients added to the sums, its predictions kept (and, with
    `measure`, its measures added). Fills `facts` (a dict) with the body's
    trace-time facts on its first trace."""

    def body(i, sums, loss_sum, actual_sum, real_sum, outputs, masks, *measured):
        losses, share, grads, y_pred = _slice_gradients(model, batch, i, variables, scaling, merger)
        flat_pred = tree.flatten(y_pred)
        if not facts:
            facts["has_grad"] = [[g is not None for g in row] for row in grads]
            facts["mean"] = share.mean
            facts["has_mask"] = [get_keras_mask(p) is not None for p in flat_pred]
        sums = [
            [total if g is None else total + tf.cast(g, tf.float32) for total, g in zip(r, row)]
            for r, row in zip(sums, grads)
        ]
        outputs = [ta.write(i, p) for ta, p in zip(outputs, flat_pred)]
        masks = [
            ta.write(i, get_keras_mask(p) if has else tf.zeros([0], tf.bool))
            for ta, p, has in zip(masks, flat_pred, facts["has_mask"])
        ]
        loss = tf.add_n([tf.cast(l, tf.float32) for l in losses])
        if measure is not None:
            rows = tf.reduce_sum(tf.cast(batch.rows[i], tf.float32))
            measured = [measured[0] + measure[0](grads[0], rows, share.actual, i)]
        return (
            i + 1,
            sums,
            loss_sum + loss * share.actual,
            actual_sum + share.actual,
            real_sum + share.real,
            outputs,
            masks,
            *measured,
        )

    return body


def _slice_gradients(model, batch, i, variables, scaling, merger):
    """Slice `i`'s losses, share, gradients (one row per loss, unscaled,
    times the share) and predictions."""
    x, y, sample_weight = batch.slice(i)
    with watching(variables, persistent=merger is not None) as tape:
        with slice_rows(batch.rows[i]):  # padding rows: no BatchNorm moments
            y_pred = call_for_training(model, x)
        with LossShares(model, batch.size, rows=batch.rows[i]) as shares:
            losses = _slice_losses(model, x, y, y_pred, sample_weight, merger)
        share = shares.share()
        weight = share.loss_weight(num_replicas())
        scaled = [scaling.scale(loss, weight) for loss in losses]
    sources = [v.value for v in variables]
    grads = [scaling.unscale(tape.gradient(l, sources), weight) for l in scaled]
    return losses, share, grads, y_pred


def _merged_tasks(model, merger, sums, regularized, actual_sum, loss_sum):
    """The whole batch's task gradients (the sums), merged once."""
    num_tasks = len(task_names(model))
    merger.build(task_names(model))
    has_regularization = any(g is not None for g in regularized)
    grads, _ = merger.merge(
        sums[:num_tasks],
        regularized if has_regularization else None,
        share=actual_sum,
        losses_finite=tf.math.is_finite(loss_sum),
    )
    return grads


def _whole_batch_predictions(outputs, masks, has_mask, out_spec, n):
    """The slices' predictions (and masks) as the whole batch's."""
    merged = []
    for ta, mask_ta, has in zip(outputs, masks, has_mask):
        p = _merge_slices(ta.stack(), n)
        if has:
            set_keras_mask(p, _merge_slices(mask_ta.stack(), n))
        merged.append(p)
    return tree.pack_sequence_as(out_spec, merged)


def _slice_losses(model, x, y, y_pred, sample_weight, merger):
    """The slice's losses: the model's loss, or (multi-task) one per task
    and the regularisation (`model.losses`)."""
    if merger is None:
        return [compat.compute_loss(model, x, y, y_pred, sample_weight)]
    regularization = regularization_loss(model)  # (a constant if none:
    # no variable gets a gradient from it)
    return task_losses(model, y, y_pred, sample_weight) + [
        tf.constant(0.0) if regularization is None else regularization
    ]


def _merge_slices(stacked, n):
    """`[slices, s, ...]` -> `[n, ...]`."""
    flat = tf.reshape(stacked, tf.concat([[-1], tf.shape(stacked)[2:]], 0))
    return flat[:n]


def _take_back_extra_regularization(model, variables, grads, loss_sum, extra, factor):
    """Each slice's loss held the weight regularisation once, and its
    gradient was multiplied by the slice's share: `extra` (the shares'
    total beyond the batch's normaliser, times `factor`) is too much."""
    regularized = [v for v in variables if getattr(v, "regularizer", None) is not None]
    if not regularized:
        return loss_sum, grads
    with watching(regularized) as tape:
        penalty = tf.add_n([tf.cast(v.regularizer(v), tf.float32) for v in regularized])
    reg_grads = dict(
        zip((id(v) for v in regularized), tape.gradient(penalty, [v.value for v in regularized]))
    )
    surplus = extra * factor
    grads = [
        g if id(v) not in reg_grads or g is None else g - surplus * reg_grads[id(v)]
        for v, g in zip(variables, grads)
    ]
    return loss_sum - extra * penalty, grads
