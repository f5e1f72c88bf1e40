"""`micro_batches` in the JAX step: one batch, `m` slices, one gradient.

The batch of n rows is split as `numpy.array_split` splits it
(`keras_fastgrad.step.splitting.slice_sizes`: the first `n mod k` slices
of `ceil(n / k)` rows, the others of `floor(n / k)`). On JAX the batch's
shape is static under `jit`, so the split is too: the slices of each size
run in one `jax.lax.scan` (at most two scans, the model traced once per
slice size). A scan runs its body one slice after the other, so only one
slice's activations are live at a time (a Python loop would put every
slice's forward and backward in one graph, which XLA may schedule side by
side). Each slice's loss is multiplied by its normaliser `D_i`
(`jax_weighting.LossShares`, as `keras_fastgrad.step.weighting` on
TensorFlow), so the summed gradients are those of the summed losses;
divided by `sum_i D_i` (`reduction="sum"`: not divided) they are exactly
the whole batch's gradient, masks and sample weights included. Under
`accumulation_steps` the batch is one micro-step whose share is
`sum_i D_i`.

The layers' state (BatchNorm's moving statistics, seeds) is carried from
slice to slice: BatchNorm normalises each slice by its own moments and its
moving statistics take one step per slice, as TensorFlow's
`batchnorm_statistics="micro_batch"`; with the default `"window"` the
slices' moments are pooled instead (`jax_batchnorm.forward`). The loss
tracker and the metrics see the whole batch: its loss (the slices' losses
weighted by their `D_i`) and its predictions (the slices' concatenated,
with their masks). Terms beyond the output losses (regularisers,
`add_loss`) are exact only where the slices are weighted by their rows
under a mean reduction; otherwise refused by name, as under accumulation.
"""

import jax
import keras
from keras import ops

from keras_fastgrad import _compat as compat
from keras_fastgrad.backend.jax import batchnorm as jax_batchnorm
from keras_fastgrad.backend.jax import multitask as jax_multitask
from keras_fastgrad.backend.jax import reaching as jax_reaching
from keras_fastgrad.backend.jax import weighting as jax_weighting
from keras_fastgrad.step.splitting import first_input, slice_sizes
from keras_fastgrad.step.task_losses import task_names


def sliced_gradients(model, slots, state, x, y, sample_weight, accumulating, check_extra_terms):
    """The batch's gradient from its `micro_batches` slices.

    Args:
        model: The `FastGradModel`.
        slots: The step's `jax_state.Slots`.
        state: `(trainable, non_trainable, optimizer, metrics)` values.
        x, y, sample_weight: The batch.
        accumulating: Python bool, `accumulation_steps` > 1.
        check_extra_terms: `check(model, mean, by_rows)`, refusing loss
            terms the slices cannot weight exactly (trace time).

    Returns:
        `(grads, D, mean, aux)` as the JAX step's `_gradients`: the float32
        unscaled gradient (times the share `D` when `accumulating`, else
        the batch's own), `D`, whether the window divides by its sum, and
        `(unscaled_loss, y_pred, non_trainable, metrics)` of the batch.
    """
    tv, ntv, ov, mv = state
    facts = {}

    def one_slice(layer_state, metric_state, px, py, psw):
        rows = keras.tree.flatten(px)[0].shape[0]

        def loss_fn(trainable):
            (loss, aux), d, facts["mean"] = jax_weighting.forward_with_share(
                model,
                rows,
                True,  # (every slice is weighed)
                lambda: jax_batchnorm.forward(  # (BatchNorm moments pooled)
                    model,
                    model.compute_loss_and_updates,
                    trainable,
                    layer_state,
                    metric_state,
                    px,
                    py,
                    psw,
                    training=True,
                    optimizer_variables=ov,
                ),
                check_extra_terms,
            )
            if slots.scaler is None:  # (scaled: `D_i` after, in float32)
                loss = loss * ops.cast(d, loss.dtype)
            return loss, (aux, d)

        (_, (aux, d)), grads = jax.value_and_grad(loss_fn, has_aux=True)(tv)
        grads = [ops.cast(g, "float32") for g in grads]
        if slots.scaler is not None:  # the scaled loss times `D_i` could overflow
            grads = [g * d for g in grads]
        return [grads], d, aux

    (sums,), loss_sum, d_sum, aux = scan_slices(model, state, (x, y, sample_weight), one_slice, 1)
    grads = sums
    if slots.scaler is not None:
        inverse = 1.0 / ops.cast(ov[slots.ov["scale"]], "float32")
        grads = [g * inverse for g in grads]
    return _per_batch(grads, loss_sum, d_sum, facts["mean"], accumulating, aux)


def sliced_task_gradients(
    model, slots, state, x, y, sample_weight, accumulating, check_extra_terms
):
    """With `multitask` (parameter space): each task's gradient summed over
    the slices on its own (the whole batch's task gradients, times
    `sum_i D_i`), merged ONCE after the slices, as TensorFlow's
    `step.slicing` merges them: the same update as the un-split step.

    Args and returns as `sliced_gradients`; `aux` has a fifth entry, the
    task telemetry logs (`jax_multitask.gradients`').
    """
    tv, ntv, _, _ = state
    num_tasks = len(task_names(model))
    facts = {"reaching": []}

    def one_slice(layer_state, metric_state, px, py, psw):
        program, found, scale = jax_multitask.losses_program(
            model,
            slots,
            (tv, layer_state, state[2], metric_state),
            px,
            py,
            psw,
            True,
            check_extra_terms,
        )
        closed, traced = jax_reaching.traced_program(program, list(tv))
        facts["reaching"].append(jax_multitask.reaching_tasks(closed, num_tasks, len(tv)))
        losses, pullback, (aux, d) = jax.vjp(traced, *tv, has_aux=True)
        facts["mean"], facts["regularized"] = found["mean"], len(losses) > num_tasks
        rows = [  # one backward pass per task (and the regularisation): times `D_i`
            jax_multitask.unscaled(pullback(jax_multitask.one_hot(losses, i)), d, scale)
            for i in range(len(losses))
        ]
        if len(rows) == num_tasks:  # (no regularisation: its row stays zero)
            rows.append([ops.zeros(t.shape, "float32") for t in tv])
        return rows, d, aux

    sums, loss_sum, d_sum, aux = scan_slices(
        model, state, (x, y, sample_weight), one_slice, num_tasks + 1
    )
    mean = facts["mean"]
    per_task, regularization = sums[:num_tasks], sums[num_tasks]
    reaching = [  # (every slice's trace reaches the same; united, never fewer)
        tuple(sorted(set().union(*ts))) for ts in zip(*facts["reaching"])
    ]
    merged, updates, gram = jax_multitask.merge_tasks(  # the sums carry `sum_i D_i`
        model,
        per_task,
        reaching,
        ntv,
        d_sum if mean else None,
        regularization if facts["regularized"] else None,
        ops.isfinite(loss_sum),
    )
    grads, d, mean, aux = _per_batch(merged, loss_sum, d_sum, mean, accumulating, aux)
    return grads, d, mean, jax_multitask.with_updates(model, aux, updates, gram)


def scan_slices(model, state, batch, one_slice, num_rows):
    """Runs `one_slice` on each slice of `batch`, in order, the layers'
    and metrics' state carried from slice to slice.

    Args:
        model: The `FastGradModel`.
        state: `(trainable, non_trainable, optimizer, metrics)` values.
        batch: `(x, y, sample_weight)`.
        one_slice: `(layer_state, metric_state, x, y, sample_weight) ->
            (rows, D_i, (unscaled_loss, y_pred, layer_state, metric_state))`,
            `rows` `num_rows` lists of float32 gradients (times `D_i`).
        num_rows: int, how many gradient lists `one_slice` returns.

    Returns:
        `(sums, loss_sum, d_sum, (None, y_pred, non_trainable, metrics))`:
        each row's gradients summed over the slices, the slices' losses
        times their `D_i` summed, the `D_i` summed, and the whole batch's
        predictions and the state after the last slice.
    """
    tv, ntv, _, mv = state
    x = batch[0]
    sizes = slice_sizes(first_input(x).shape[0], model.fastgrad_step_state.options.micro_batches)
    facts = {}

    def body(carry, piece):
        sums, loss_sum, d_sum, layer_state, metric_state = carry
        rows, d, aux = one_slice(layer_state, metric_state, *piece)
        unscaled, y_pred, new_layer_state, new_metric_state = aux
        flat = keras.tree.flatten(y_pred)
        facts["structure"] = y_pred
        masks = [compat.get_keras_mask(p) for p in flat]
        carry = (
            [[s + g for s, g in zip(total, row)] for total, row in zip(sums, rows)],
            loss_sum + ops.cast(unscaled, "float32") * d,
            d_sum + d,
            _like(new_layer_state, layer_state),
            _like(new_metric_state, metric_state),
        )
        return carry, (flat, masks)

    carry = (
        [[ops.zeros(t.shape, "float32") for t in tv] for _ in range(num_rows)],
        ops.zeros((), "float32"),
        ops.zeros((), "float32"),
        list(ntv),
        list(mv),
    )
    outputs = []
    start = 0
    for size, count in _groups(sizes):
        take = (
            lambda t, s=start, c=count, z=size: ops.reshape(  # noqa: E731
                t[s : s + c * z], (c, z, *t.shape[1:])
            )
        )
        pieces = tuple(None if s is None else keras.tree.map_structure(take, s) for s in batch)
        carry, out = jax.lax.scan(body, carry, pieces)
        outputs.append(out)
        start += count * size
    sums, loss_sum, d_sum, new_ntv, new_mv = carry
    y_pred = _whole_batch(outputs, facts["structure"])
    return sums, loss_sum, d_sum, (None, y_pred, new_ntv, new_mv)


def _per_batch(grads, loss_sum, d_sum, mean, accumulating, aux):
    """`(grads, D, mean, aux)` from the slices' sums: the batch's loss and,
    not accumulating under a mean reduction, its gradient (the sums
    divided by `sum_i D_i`)."""
    unscaled_loss = ops.divide_no_nan(loss_sum, d_sum) if mean else loss_sum
    if not accumulating and mean:
        inverse = ops.divide_no_nan(1.0, d_sum)
        grads = [g * inverse for g in grads]
    d = d_sum if mean else ops.convert_to_tensor(1.0)
    return grads, d, mean, (unscaled_loss, *aux[1:])


def _groups(sizes):
    """`[(size, count)]`: the runs of equal slice sizes, in order."""
    groups = []
    for size in sizes:
        if groups and groups[-1][0] == size:
            groups[-1] = (size, groups[-1][1] + 1)
        else:
            groups.append((size, 1))
    return groups


def _like(values, before):
    """The scan's carry keeps its dtypes (a layer may return another)."""
    return [ops.cast(v, b.dtype) for v, b in zip(values, before)]


def _whole_batch(outputs, structure):
    """The slices' predictions (`[slices, rows, ...]` per group) as the
    whole batch's, their masks set again."""
    merged = []
    for k in range(len(outputs[0][0])):
        parts = [flat[k] for flat, _ in outputs]
        p = ops.concatenate([ops.reshape(t, (-1, *t.shape[2:])) for t in parts], axis=0)
        masks = [masks[k] for _, masks in outputs]
        if masks[0] is not None:
            mask = ops.concatenate([ops.reshape(m, (-1, *m.shape[2:])) for m in masks], axis=0)
            compat.set_keras_mask(p, mask)
        merged.append(p)
    return keras.tree.pack_sequence_as(structure, merged)
