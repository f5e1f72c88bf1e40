"""`micro_batches` on TensorFlow: the slices' loop (the rules:
`keras_fastgrad.step.slicing`, `keras_fastgrad.step.splitting`).

How, on TensorFlow: a `tf.while_loop` runs forward and backward (a tape)
on one slice at a time, `parallel_iterations=1` (TensorFlow's default, 10,
would start the next slices' forward passes while one runs backward, each
holding its activations): activation memory is that of one slice. The
float32 sums are loop-carried, started from the first slice's gradients
(not from zeros written at every step). Slices of different sizes have
different shapes: outside XLA one loop takes them with a dynamic first
dimension; under XLA, which needs static shapes, one loop runs per slice
size (`SlicePlan.groups`; the model is traced twice). The predictions and
masks go through one `TensorArray` per output.
"""

from keras import tree

from keras_fastgrad import _compat as compat
from keras_fastgrad._compat import get_keras_mask
from keras_fastgrad._tf_startup import tf
from keras_fastgrad.backend.tensorflow.forward import call_for_training, watching
from keras_fastgrad.backend.tensorflow.replicas import num_replicas
from keras_fastgrad.step import slicing, splitting
from keras_fastgrad.step.task_losses import task_names
from keras_fastgrad.step.weighting import Share


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
            per row, `splitting.plan`).
        merger: The model's `multitask.TaskMerger`, or `None`. With one,
            each task's gradient is summed over the slices on its own, and
            the sums (the task gradients of the whole batch) are merged once
            after the loop.
        measure: Optional pair `(fn, zero)`: `fn(grads, rows, normaliser,
            index)` returns a vector (shaped as the tensor `zero`) from
            each slice's (weighted) gradients, rows, normaliser and index;
            the vectors are summed over the slices
            (`noise_scale.slice_measure`).
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
    n = tf.shape(splitting.first_input(x))[0]
    split = splitting.plan(n, slices, tf.minimum, tf.maximum)
    structures = (x, y, sample_weight)
    out_spec = model.compute_output_spec(x)
    facts = []  # the body's `slicing.SliceFacts` (trace time, the same for every slice)
    step = _slice_step(
        model, variables, scaling, merger, facts, measure, options or [f"micro_batches={slices}"], n
    )
    totals = _zero_totals(model, y, out_spec, variables, merger, measure)
    outputs = []
    for group, take in _loops(split, structures):
        totals, group_outputs = _run_group(group, take, step, totals, out_spec)
        outputs.append(group_outputs)
    mean = facts[0].mean
    batch = slicing.after_slices(
        totals._replace(sums=facts[0].present(totals.sums)),
        mean,
        tf.constant(1.0),
        lambda: _penalty_gradient(model, variables),
    )
    if merger is None:
        grads = batch.sums[-1]
    else:  # the whole batch's task gradients, merged once
        # (the Gram of the batch's gradients: divided by its normaliser,
        # 1 under `"sum"`, not by the slices' count of shares of 1)
        grads = _merged_tasks(task_names(model), merger, batch, batch.normaliser)
    y_pred = _whole_batch_predictions(outputs, facts[0].shapes, splitting.first_input(x), out_spec)
    share = Share(batch.normaliser, batch.normaliser, mean)
    return (batch.loss, y_pred, grads, share, *totals.measured)


def _loops(split, structures):
    """`[(group, take)]`: the loops to run, `take(i)` giving slice `i`'s
    `(x, y, sample_weight, rows)`. Outside XLA one loop over every slice
    (dynamic shapes); under XLA one per slice size (static shapes)."""
    if not compat.in_xla_context():

        def take(i):
            start, size = split.start(i, tf.minimum), split.rows(i, _indicator)
            parts = _map(lambda t: t[start : start + size], structures)
            return (*parts, size)

        return [(splitting.SliceGroup(0, split.count, None), take)]
    return [(g, _static_take(split, structures, g)) for g in split.groups()]


def _indicator(condition):
    """`condition` (a traced bool) as an int32 1 or 0."""
    return tf.cast(condition, tf.int32)


def _map(fn, structures):
    """`fn` over every tensor of the `(x, y, sample_weight)` structures."""
    return tuple(None if s is None else tree.map_structure(fn, s) for s in structures)


def _static_take(split, structures, group):
    """`take` for the group's slices, all of `group.size` rows: the rows
    reshaped to `[end - first, size, ...]` before the loop. An empty
    group is given one slice of the batch's rows that the loop never
    reaches: XLA compiles the body for it, and indexing an empty axis
    does not compile."""
    first, size = group.first, group.size
    count = tf.maximum(group.end - first, 1)
    rows = split.start(first, tf.minimum) + tf.range(count * size)
    rows = tf.minimum(rows, tf.maximum(split.n - 1, 0))

    def grouped(t):
        t = tf.gather(tf.convert_to_tensor(t), rows)
        return tf.reshape(t, tf.concat([[count, size], tf.shape(t)[1:]], 0))

    parts = _map(grouped, structures)

    def take(i):
        return (*_map(lambda t: t[i - first], parts), size)

    return take


def _zero_totals(model, y, out_spec, variables, merger, measure):
    """The loop's `SliceTotals` at the start: unset gradient sums (one
    row per loss), zero loss and normaliser (and measures)."""
    num_losses = 1
    if merger is not None:  # one sum per task, and the regularisation's
        compile_loss = compat.compile_loss(model)
        if not compile_loss.built:  # (the task names come with its build)
            compile_loss.build(y, out_spec)
        num_losses = len(task_names(model)) + 1
    return slicing.SliceTotals(
        [[_unset(v.shape) for v in variables] for _ in range(num_losses)],
        tf.constant(0.0),
        tf.constant(0.0),
        (measure[1],) if measure is not None else (),
    )


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

    def adding(add):  # `add(total, g)` where the variable gets a gradient
        return lambda: [
            [total if g is None else add(total, g) for total, g in zip(r, row)]
            for r, row in zip(sums, grads)
        ]

    first = adding(lambda total, g: _dense_float32(g, total.shape))
    later = adding(lambda total, g: total + tf.cast(g, tf.float32))
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


def _run_group(group, take, step, totals, out_spec):
    """One `tf.while_loop` over the group's slices. Returns the new totals
    and the group's predictions and masks (one `TensorArray` each per
    output, one element per slice)."""
    flat_spec = tree.flatten(out_spec)
    count = group.end - group.first
    arrays = lambda dtype: tf.TensorArray(dtype, size=count, infer_shape=False)  # noqa: E731

    def body(i, totals, outputs, masks):
        totals, flat_pred, flat_mask = step(i, take(i), totals)
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
    return totals, (outputs, masks)


def _slice_step(model, variables, scaling, merger, facts, measure, options, batch_rows):
    """One slice forward and backward: `step(i, (x, y, sample_weight,
    rows), totals)` adds its gradients to the sums and its loss, shares
    (and, with `measure`, its measures) to the `SliceTotals`; returns them
    with its flat predictions and masks. Fills `facts` (a dict) with the
    trace-time facts on its first trace."""

    def step(i, piece, totals):
        x, y, sample_weight, rows = piece
        losses, share, grads, y_pred = _slice_gradients(
            model, x, y, sample_weight, rows, variables, scaling, merger, options, batch_rows
        )
        flat_pred = tree.flatten(y_pred)
        if not facts:
            facts.append(slicing.SliceFacts.of(grads, share.mean, flat_pred))
        flat_mask = [
            tf.zeros([0], tf.bool) if mask_shape is None else get_keras_mask(p)
            for p, (_, mask_shape) in zip(flat_pred, facts[0].shapes)
        ]
        measured = None
        if measure is not None:
            measured = measure[0](grads[0], tf.cast(rows, tf.float32), share.actual, i)
        sums = _added(i, totals.sums, grads)
        totals = slicing.add_slice(totals, sums, losses, share.actual, measured, tf.add_n)
        return totals, flat_pred, flat_mask

    return step


def _slice_gradients(
    model, x, y, sample_weight, rows, variables, scaling, merger, options, batch_rows
):
    """The slice's losses, share, gradients (one row per loss, unscaled,
    times the share) and predictions."""
    merged = merger is not None
    with watching(variables, persistent=merged) as tape:
        y_pred = call_for_training(model, x)
        losses, share = slicing.slice_loss(
            model,
            lambda: slicing.slice_terms(model, x, y, y_pred, sample_weight, merged),
            rows,
            batch_rows,
            options,
            merged,
            tf.add_n,
        )
        weight = share.loss_weight(num_replicas())
        scaled = [scaling.scale(loss, weight) for loss in losses]
    sources = [v.value for v in variables]
    grads = [scaling.unscale(tape.gradient(l, sources), weight) for l in scaled]
    return losses, share, grads, y_pred


def _merged_tasks(names, merger, batch, normaliser):
    """The whole batch's task gradients (`batch.sums`, the tasks `names`,
    then the regularisation's), merged once."""
    num_tasks = len(names)
    merger.build(names)
    regularized = batch.sums[num_tasks]
    has_regularization = any(g is not None for g in regularized)
    grads, _ = merger.merge(
        batch.sums[:num_tasks],
        regularized if has_regularization else None,
        share=normaliser,
        losses_finite=tf.math.is_finite(batch.loss_sum),
    )
    return grads


def _whole_batch_predictions(outputs, shapes, first, out_spec):
    """The slices' predictions (and masks), group after group, as the
    whole batch's (`slicing.whole_batch`), of the batch's static shape
    (`first` its first input, `shapes` as `slicing.SliceFacts.shapes`)."""
    groups = [
        (
            [ta.concat() for ta in group_outputs],
            [ta.concat() if m is not None else None for ta, (_, m) in zip(group_masks, shapes)],
        )
        for group_outputs, group_masks in outputs
    ]
    y_pred = slicing.whole_batch(groups, out_spec, lambda parts: tf.concat(parts, 0))
    rows = first.shape[:1]
    for p, (shape, mask_shape) in zip(tree.flatten(y_pred), shapes):
        p.set_shape(rows.concatenate(shape))
        if mask_shape is not None:
            get_keras_mask(p).set_shape(rows.concatenate(mask_shape))
    return y_pred


def _penalty_gradient(model, variables):
    """`(penalty, grads)`: the weight penalty (`slicing.weight_penalty`)
    and its gradient, aligned with `variables` (`None` where a variable
    has no regulariser: the penalty does not reach it); `None` without a
    regularised variable."""
    if not any(getattr(v, "regularizer", None) is not None for v in variables):
        return None
    with watching(variables) as tape:
        penalty = slicing.weight_penalty(model)
    return penalty, tape.gradient(penalty, [v.value for v in variables])
