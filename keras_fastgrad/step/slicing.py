"""In-step micro-batching: one batch, `m` slices, one gradient.

The batch of n rows is split as `numpy.array_split` splits it, without
padding: `k = min(m, n)` slices (one, empty, for an empty batch), the first
`n mod k` of `ceil(n / k)` rows and the others of `floor(n / k)`. Every row
is in exactly one slice and no slice holds anything else, so every term the
model computes (output losses, `add_loss` terms, activity regularisers, the
extra terms of an overridden `compute_loss`) and every layer that mixes
samples (BatchNormalization's moments) sees real rows only. A
`tf.while_loop` runs forward and backward on one slice at a time, adding
the slice's gradient to float32 loop-carried sums: activation memory is
that of one slice (the loop runs its slices one after the other,
`parallel_iterations=1`). Each slice's gradient is multiplied by its loss's
normaliser `D_i` (`keras_fastgrad.step.weighting`), so the sums are
gradients of the summed losses and dividing by the batch's normaliser
gives exactly the gradient of the un-split batch, masks and sample weights
included (tests: uneven splits, masked sequences, per-pixel losses, SGD
and Adam, XLA). Weight regularisation enters every slice's loss once; what
the slices' shares add beyond the batch's normaliser is taken back after
the loop (`reduction="sum"`: each slice's share is 1, and the layers'
per-row losses are weighted by the slice's share of the rows).

Slices of different sizes have different shapes: outside XLA one loop
takes them with a dynamic first dimension; under XLA two loops run, one
per slice size (`keras_fastgrad.step.splitting`; the model is traced twice).

The predictions keep their masks, so the metrics see what they would on
the whole batch. BatchNormalization normalises each slice by the slice's
moments (ghost batch norm); its moving statistics take one step per batch
from the moments pooled over the slices (`keras_fastgrad.step.batchnorm`;
`batchnorm_statistics="micro_batch"`: one step per slice). Other layers
that mix samples see slices, not the batch. Terms beyond the output
losses: exact or refused (`compile_loss.check_extra_terms`).
"""

import collections

from keras import tree

from keras_fastgrad import _compat as compat
from keras_fastgrad._compat import get_keras_mask, set_keras_mask
from keras_fastgrad._tf_startup import tf
from keras_fastgrad.step.compile_loss import check_extra_terms, loss_terms, present_terms
from keras_fastgrad.step.forward import call_for_training, watching
from keras_fastgrad.step.replicas import num_replicas
from keras_fastgrad.step.splitting import first_input, groups, split
from keras_fastgrad.step.task_losses import regularization_loss, task_losses, task_names
from keras_fastgrad.step.weighting import LossShares, Share


def sliced_gradients(
    model, x, y, sample_weight, variables, scaling, slices, merger=None, measure=None, options=()
):
    """Forward and backward of `model` on `slices` slices of one batch.

    Args:
        model: The `FastGradModel` (uses its training loss and `call`).
        x, y, sample_weight: The batch, as Keras unpacks it.
        variables: The trainable variables the tape watches.
        scaling: The step's `LossScaling` unit.
        slices: Python int >= 2 (a batch with fewer rows runs one slice
            per row, `splitting.slice_sizes`).
        merger: The model's `multitask.TaskMerger`, or `None`. With one,
            each task's gradient is summed over the slices on its own, and
            the sums (the task gradients of the whole batch) are merged once
            after the loop: the same update as the un-split step.
        measure: Optional pair `(fn, zero)`: `fn(grads, rows, normaliser,
            index)` returns a vector (shaped as the tensor `zero`) from
            each slice's (weighted) gradients, rows, normaliser and index;
            the vectors are summed over the slices
            (`noise_scale.slice_measure`: slices are small batches).
        options: The options that combine micro-batches, as set (e.g.
            `["micro_batches=3"]`), named where the loss's terms beyond
            the output losses cannot be weighted exactly
            (`compile_loss.check_extra_terms`).

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
    batch = split(x, y, sample_weight, slices)
    out_spec = model.compute_output_spec(x)
    facts = {}  # trace-time facts of the body, the same for every slice
    context = _Context(options or [f"micro_batches={slices}"], tf.shape(first_input(x))[0])
    step = _slice_step(model, batch, variables, scaling, merger, facts, measure, context)
    totals = _zero_totals(model, y, out_spec, variables, merger, measure)
    outputs, masks = [], []
    for group in groups(batch):
        totals, group_outputs, group_masks = _run_group(group, step, totals, out_spec)
        outputs.append(group_outputs)
        masks.append(group_masks)
    sums, loss_sum, actual_sum, real_sum, *measured = totals
    sums = [
        [s if present else None for s, present in zip(row, has)]
        for row, has in zip(sums, facts["has_grad"])
    ]
    # `"sum"`: the batch's loss is the plain sum (its normaliser is 1).
    real = real_sum if facts["mean"] else tf.constant(1.0)
    # Regularisation: in the plain loss, or the last of the task losses.
    loss_sum, regularized = _take_back_extra_regularization(
        variables,
        sums[-1],
        loss_sum,
        actual_sum - real,
        num_replicas() if facts["mean"] else 1,
    )
    if merger is None:
        grads = regularized
    else:  # the whole batch's task gradients, merged once
        names = task_names(model)
        # (the Gram of the batch's gradients: divided by its normaliser,
        # 1 under `"sum"`, not by the slices' count of shares of 1)
        grads = _merged_tasks(names, merger, sums, regularized, real, loss_sum)
    rows = first_input(x).shape[:1]
    y_pred = _whole_batch_predictions(outputs, masks, facts["shapes"], rows, out_spec)
    share = Share(real, real, facts["mean"])
    return (loss_sum / tf.maximum(real, 1e-30), y_pred, grads, share, *measured)


def _zero_totals(model, y, out_spec, variables, merger, measure):
    """The loop's running totals at the start: zero gradient sums (one
    row per loss), zero loss, actual and real normalisers (and measures)."""
    num_losses = 1
    if merger is not None:  # one sum per task, and the regularisation's
        compile_loss = compat.compile_loss(model)
        if not compile_loss.built:  # (the task names come with its build)
            compile_loss.build(y, out_spec)
        num_losses = len(task_names(model)) + 1
    totals = (
        [[_unset(v.shape) for v in variables] for _ in range(num_losses)],
        tf.constant(0.0),
        tf.constant(0.0),
        tf.constant(0.0),
    )
    return totals + ((measure[1],) if measure is not None else ())


def _unset(shape):
    """A float32 sum's place before the first slice, not written (zeroing
    a gradient's memory at every step costs time; `_added` replaces it).
    `tf.zeros` would be folded into a constant that the step's graph
    holds between steps."""
    return tf.raw_ops.Empty(shape=tf.TensorShape(shape).as_list(), dtype=tf.float32)


def _added(i, sums, grads):
    """The sums after slice `i`: its float32 gradients for the first slice
    (`i == 0`), then the sums plus them. Where a variable gets no gradient
    the sum stays unset: it is dropped after the loop (`has_grad`)."""

    def first():
        return [
            [total if g is None else _dense_float32(g, total.shape) for total, g in zip(r, row)]
            for r, row in zip(sums, grads)
        ]

    def later():
        return [
            [total if g is None else total + tf.cast(g, tf.float32) for total, g in zip(r, row)]
            for r, row in zip(sums, grads)
        ]

    return tf.cond(tf.equal(i, 0), first, later)


def _dense_float32(gradient, shape):
    """`gradient` (a tensor or `tf.IndexedSlices`) as a dense float32
    tensor of its variable's static `shape`, as adding it to a sum makes
    it (an `IndexedSlices` made dense has an open first dimension)."""
    dense = tf.cast(tf.convert_to_tensor(gradient), tf.float32)
    dense.set_shape(shape)
    return dense


# One slice in flight at a time: TensorFlow's default (10) lets the
# executor start the next slices' forward passes while one runs backward,
# each holding its activations.
_PARALLEL_ITERATIONS = 1


def _run_group(group, step, totals, out_spec):
    """One `tf.while_loop` over the group's slices. Returns the new totals
    and the group's predictions and masks (one `TensorArray` each per
    output, one element per slice)."""
    flat_spec = tree.flatten(out_spec)
    count = group.end - group.first
    arrays = lambda dtype: tf.TensorArray(dtype, size=count, infer_shape=False)  # noqa: E731

    def body(i, totals, outputs, masks):
        totals, flat_pred, flat_mask = step(i, group.take(i), totals)
        outputs = [ta.write(i - group.first, p) for ta, p in zip(outputs, flat_pred)]
        masks = [ta.write(i - group.first, m) for ta, m in zip(masks, flat_mask)]
        return i + 1, totals, outputs, masks

    _, totals, outputs, masks = tf.while_loop(
        lambda i, *_: i < group.end,
        body,
        (
            group.first,
            totals,
            [arrays(s.dtype) for s in flat_spec],
            [arrays(tf.bool) for _ in flat_spec],
        ),
        parallel_iterations=_PARALLEL_ITERATIONS,
    )
    return totals, outputs, masks


def _slice_step(model, batch, variables, scaling, merger, facts, measure=None, context=None):
    """One slice forward and backward: `step(i, (x, y, sample_weight,
    rows), totals)` adds its gradients to the sums and its loss, shares
    (and, with `measure`, its measures) to the totals; returns them with
    its flat predictions and masks. Fills `facts` (a dict) with the
    trace-time facts on its first trace."""

    def step(i, piece, totals):
        x, y, sample_weight, rows = piece
        sums, loss_sum, actual_sum, real_sum, *measured = totals
        losses, share, grads, y_pred = _slice_gradients(
            model, x, y, sample_weight, rows, variables, scaling, merger, context
        )
        flat_pred = tree.flatten(y_pred)
        if not facts:
            facts["has_grad"] = [[g is not None for g in row] for row in grads]
            facts["mean"] = share.mean
            facts["has_mask"] = [get_keras_mask(p) is not None for p in flat_pred]
            # (the shapes past the batch axis: the concatenation loses them)
            facts["shapes"] = [
                (p.shape[1:], get_keras_mask(p).shape[1:] if has else None)
                for p, has in zip(flat_pred, facts["has_mask"])
            ]
        sums = _added(i, sums, grads)
        flat_mask = [
            get_keras_mask(p) if has else tf.zeros([0], tf.bool)
            for p, has in zip(flat_pred, facts["has_mask"])
        ]
        loss = tf.add_n([tf.cast(l, tf.float32) for l in losses])
        if measure is not None:
            rows = tf.cast(rows, tf.float32)
            measured = [measured[0] + measure[0](grads[0], rows, share.actual, i)]
        totals = (
            sums,
            loss_sum + loss * share.actual,
            actual_sum + share.actual,
            real_sum + share.real,
            *measured,
        )
        return totals, flat_pred, flat_mask

    return step


# What every slice's loss needs: the combining options (named by refusals)
# and the batch's rows.
_Context = collections.namedtuple("_Context", ["options", "batch_rows"])


def _slice_gradients(model, x, y, sample_weight, rows, variables, scaling, merger, context):
    """The slice's losses, share, gradients (one row per loss, unscaled,
    times the share) and predictions."""
    with watching(variables, persistent=merger is not None) as tape:
        y_pred = call_for_training(model, x)
        with LossShares(model, rows) as shares:
            losses, terms = _slice_losses(model, x, y, y_pred, sample_weight, merger)
        share = shares.share()
        check_extra_terms(model, share, context.options, terms, merged=merger is not None)
        if merger is None and not share.mean and terms.rows is not None:
            # `"sum"`: the batch's per-row means are the slices' weighted
            # by their share of the rows (the slices' weight is 1).
            fraction = tf.math.divide_no_nan(
                tf.cast(rows, tf.float32), tf.cast(context.batch_rows, tf.float32)
            )
            dtype = terms.total.dtype
            parts = [
                terms.compiled,
                terms.weights,
                terms.rows * tf.cast(fraction, terms.rows.dtype),
            ]
            losses = [tf.add_n([tf.cast(p, dtype) for p in parts if p is not None])]
        weight = share.loss_weight(num_replicas())
        scaled = [scaling.scale(loss, weight) for loss in losses]
    sources = [v.value for v in variables]
    grads = [scaling.unscale(tape.gradient(l, sources), weight) for l in scaled]
    return losses, share, grads, y_pred


def _merged_tasks(names, merger, sums, regularized, actual_sum, loss_sum):
    """The whole batch's task gradients (the sums, the tasks `names`),
    merged once."""
    num_tasks = len(names)
    merger.build(names)
    has_regularization = any(g is not None for g in regularized)
    grads, _ = merger.merge(
        sums[:num_tasks],
        regularized if has_regularization else None,
        share=actual_sum,
        losses_finite=tf.math.is_finite(loss_sum),
    )
    return grads


def _whole_batch_predictions(outputs, masks, shapes, rows, out_spec):
    """The slices' predictions (and masks), group after group, as the
    whole batch's: `shapes` their shapes past the batch axis (`None`: no
    mask), `rows` the batch's static `[n]` shape."""
    merged = []
    for k, (shape, mask_shape) in enumerate(shapes):
        p = tf.concat([group[k].concat() for group in outputs], 0)
        p.set_shape(rows.concatenate(shape))
        if mask_shape is not None:
            mask = tf.concat([group[k].concat() for group in masks], 0)
            mask.set_shape(rows.concatenate(mask_shape))
            set_keras_mask(p, mask)
        merged.append(p)
    return tree.pack_sequence_as(out_spec, merged)


def _slice_losses(model, x, y, y_pred, sample_weight, merger):
    """The slice's losses: the model's loss, or (multi-task) one per task
    and the regularisation (`model.losses`)."""
    if merger is None:
        terms = loss_terms(model, x, y, y_pred, sample_weight)
        return [terms.total], terms
    regularization = regularization_loss(model)  # (a constant if none:
    # no variable gets a gradient from it)
    return task_losses(model, y, y_pred, sample_weight) + [
        tf.constant(0.0) if regularization is None else regularization
    ], present_terms(model)


def _take_back_extra_regularization(variables, grads, loss_sum, extra, factor):
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
