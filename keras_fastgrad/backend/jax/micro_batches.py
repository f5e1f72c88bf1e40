"""`micro_batches` on JAX: the slices' scans (the rules:
`keras_fastgrad.step.slicing`, `keras_fastgrad.step.splitting`).

How, on JAX: the batch's shape is static under `jit`, so the split is too
(`splitting.static_groups`): the slices of each size run in one
`jax.lax.scan` (at most two scans, the model traced once per slice size).
A scan runs its body one slice after the other, so only one slice's
activations are live at a time (a Python loop would put every slice's
forward and backward in one graph, which XLA may schedule side by side).
Each slice's gradient comes from `jax.value_and_grad` of its loss
(`slicing.slice_loss`, on Keras' stateless forward) times its `D_i`
(`jax.vjp` per task with `multitask`), the sums and the layers' and
metrics' state are the scan's carry (`slicing.SliceTotals`,
`slicing.hand_off`); the batch's loss, sums and normaliser come from
`slicing.after_slices` (the weight penalty's gradient by
`jax.value_and_grad`). BatchNorm: each slice
normalised by its own moments, the moving statistics one step per slice
(`batchnorm_statistics="micro_batch"`) or pooled over the slices
(`"window"`, `jax_batchnorm.forward`).
"""

import jax
import keras
from keras import ops

from keras_fastgrad import _compat as compat
from keras_fastgrad.backend.jax import batchnorm as jax_batchnorm
from keras_fastgrad.backend.jax import forward as jax_forward
from keras_fastgrad.backend.jax import multitask as jax_multitask
from keras_fastgrad.step import slicing, splitting
from keras_fastgrad.step.compile_loss import LossTerms, regularized_variables
from keras_fastgrad.step.splitting import first_input
from keras_fastgrad.step.task_losses import task_names
from keras_fastgrad.step.weighting import weighed_loss


def gradient(model, slots, state, batch, weighed, batch_rows=None):
    """One micro-batch's (or slice's) gradient: Keras' stateless forward on
    `state`'s values, the loss (`slicing.slice_terms`) weighed by its share
    `D` and its terms checked where `weighed` (`weighting.weighed_loss`),
    a slice's `"sum"` rules applied under `batch_rows`
    (`slicing.slice_loss`), and `jax.value_and_grad` of it times `D` (or
    the loss scale, then unscaled).

    Args:
        model: The `FastGradModel`.
        slots: The step's `jax_state.Slots`.
        state: `(trainable, non_trainable, optimizer, metrics)` values.
        batch: `(x, y, sample_weight)`.
        weighed: Python bool, whether micro-batches are combined (the
            gradient carries `D`).
        batch_rows: For a slice, the batch's rows; `None` for a batch.

    Returns:
        `(grads, D, mean, aux)`: the float32 unscaled gradient (times `D`
        where weighed), `D` (1 where not), whether the window divides by
        its sum, and `(loss, y_pred, non_trainable, metrics)`.

    Raises:
        ValueError: (trace time) for loss terms a weighed micro-batch
            cannot weight exactly (`compile_loss.check_extra_terms`).
    """
    tv, ntv, ov, mv = state
    scale = slots.loss_scale(ov)
    rows = first_input(batch[0]).shape[0]
    options = model.fastgrad_step_state.options.combining()
    found = {}

    def loss_of(terms_of):
        if batch_rows is not None:
            return slicing.slice_loss(model, terms_of, rows, batch_rows, options)
        if not weighed:
            return terms_of()[0], None
        losses, _, share = weighed_loss(model, terms_of, rows, options)
        return losses, share

    def compute(trainable, layer_values, metric_values, *batch):
        values = (trainable, layer_values, metric_values, ov)
        ((loss,), found["share"]), y_pred, new_ntv, new_mv = _stateless_loss(
            model, values, batch, loss_of
        )
        return loss, (loss, y_pred, new_ntv, new_mv)

    def loss_fn(trainable):
        loss, aux = jax_batchnorm.forward(  # (BatchNorm moments pooled)
            model, compute, trainable, ntv, mv, *batch
        )
        share = found["share"]
        d = ops.convert_to_tensor(1.0) if share is None else share.actual
        (loss,) = jax_forward.scaled(
            [loss], d, scale, share is not None
        )  # (scaled: `D` after, in float32)
        return loss, (aux, d)

    (_, (aux, d)), grads = jax.value_and_grad(loss_fn, has_aux=True)(tv)
    share = found.pop("share")
    mean = True if share is None else share.mean
    return jax_forward.unscaled(grads, d, scale), d, mean, aux


def sliced_gradients(model, slots, state, x, y, sample_weight, accumulating):
    """The batch's gradient from its `micro_batches` slices (each by
    `gradient`).

    Args:
        model: The `FastGradModel`.
        slots: The step's `jax_state.Slots`.
        state: `(trainable, non_trainable, optimizer, metrics)` values.
        x, y, sample_weight: The batch.
        accumulating: Python bool, `accumulation_steps` > 1.

    Returns:
        `(grads, D, mean, aux)` as `gradient`, of the whole batch: the
        gradient times the share `D` when `accumulating`, else the batch's
        own.
    """
    tv, _, ov, _ = state
    batch_rows = first_input(x).shape[0]
    facts = {}

    def one_slice(layer_state, metric_state, px, py, psw):
        piece = (tv, layer_state, ov, metric_state)
        grads, d, facts["mean"], aux = gradient(
            model, slots, piece, (px, py, psw), True, batch_rows
        )
        return [grads], d, aux

    totals, aux = scan_slices(model, state, (x, y, sample_weight), one_slice, 1)
    batch = slicing.after_slices(
        totals, facts["mean"], ops.convert_to_tensor(1.0), lambda: _penalty_gradient(model, tv)
    )
    return _per_batch(batch.sums[0], totals, batch, facts["mean"], accumulating, aux)


def sliced_task_gradients(
    model, slots, state, x, y, sample_weight, accumulating, check_extra_terms
):
    """With `multitask` (parameter space): each task's gradient summed over
    the slices on its own (the whole batch's task gradients, times
    `sum_i D_i`), merged ONCE after the slices (`step.slicing`'s rule):
    the same update as the un-split step.

    Args and returns as `sliced_gradients`, and `check_extra_terms` as
    `jax_multitask.gradients`'; `aux` has a fifth entry, the task
    telemetry logs.
    """
    tv, ntv, _, _ = state
    num_tasks = len(task_names(model))
    facts = {"reaching": []}

    def one_slice(layer_state, metric_state, px, py, psw):
        piece = (tv, layer_state, state[2], metric_state)
        rows, reaching, losses, (aux, d), facts["mean"] = jax_multitask.task_gradients(
            model, slots, piece, (px, py, psw), True, check_extra_terms
        )  # (each row times `D_i`)
        facts["reaching"].append(reaching)
        facts["regularized"] = len(losses) > num_tasks
        if len(rows) == num_tasks:  # (no regularisation: its row stays zero)
            rows.append([ops.zeros(t.shape, "float32") for t in tv])
        return rows, d, aux

    totals, aux = scan_slices(model, state, (x, y, sample_weight), one_slice, num_tasks + 1)
    mean = facts["mean"]
    batch = slicing.after_slices(totals, mean, None, lambda: _penalty_gradient(model, tv))
    reaching = [  # (every slice's trace reaches the same; united, never fewer)
        tuple(sorted(set().union(*ts))) for ts in zip(*facts["reaching"])
    ]
    merged, updates, gram = jax_multitask.merge_tasks(  # the sums carry `sum_i D_i`
        model,
        batch.sums[:num_tasks],
        reaching,
        ntv,
        batch.normaliser,
        batch.sums[num_tasks] if facts["regularized"] else None,
        ops.isfinite(batch.loss_sum),
    )
    grads, d, mean, aux = _per_batch(merged, totals, batch, mean, accumulating, aux)
    return grads, d, mean, jax_multitask.with_updates(model, aux, updates, gram)


def scan_slices(model, state, batch, one_slice, num_rows):
    """Runs `one_slice` on each slice of `batch`, in order, the layers'
    and metrics' state handed from slice to slice (`slicing.hand_off`).

    Args:
        model: The `FastGradModel`.
        state: `(trainable, non_trainable, optimizer, metrics)` values.
        batch: `(x, y, sample_weight)`.
        one_slice: `(layer_state, metric_state, x, y, sample_weight) ->
            (rows, D_i, (unscaled_loss, y_pred, layer_state, metric_state))`,
            `rows` `num_rows` lists of float32 gradients (times `D_i`).
        num_rows: int, how many gradient lists `one_slice` returns.

    Returns:
        `(totals, (None, y_pred, non_trainable, metrics))`: the
        `slicing.SliceTotals` of the slices, and the whole batch's predictions and the state
        after the last slice.
    """
    tv, ntv, _, mv = state
    n = first_input(batch[0]).shape[0]
    split = splitting.plan(n, model.fastgrad_step_state.options.micro_batches)
    structure = []

    def body(carry, piece):
        totals, layer_state, metric_state = carry
        rows, d, aux = one_slice(layer_state, metric_state, *piece)
        unscaled, y_pred, new_layer_state, new_metric_state = aux
        flat = keras.tree.flatten(y_pred)
        structure[:] = [y_pred]
        sums = [[s + g for s, g in zip(total, row)] for total, row in zip(totals.sums, rows)]
        carry = (
            slicing.add_slice(totals, sums, [unscaled], d),
            slicing.hand_off(new_layer_state, layer_state),
            slicing.hand_off(new_metric_state, metric_state),
        )
        return carry, (flat, [compat.get_keras_mask(p) for p in flat])

    zero = ops.zeros((), "float32")
    carry = (
        slicing.SliceTotals(
            [[ops.zeros(t.shape, "float32") for t in tv] for _ in range(num_rows)], zero, zero
        ),
        list(ntv),
        list(mv),
    )
    outputs = []
    for group in splitting.static_groups(n, split.count):
        count = group.end - group.first
        first = split.start(group.first)

        def take(t, first=first, count=count, size=group.size):
            return ops.reshape(t[first : first + count * size], (count, size, *t.shape[1:]))

        pieces = tuple(None if s is None else keras.tree.map_structure(take, s) for s in batch)
        carry, (flat, masks) = jax.lax.scan(body, carry, pieces)
        outputs.append((_rows_first(flat), _rows_first(masks)))
    totals, new_ntv, new_mv = carry
    y_pred = slicing.whole_batch(outputs, structure[0])
    return totals, (None, y_pred, new_ntv, new_mv)


def _per_batch(grads, totals, batch, mean, accumulating, aux):
    """`(grads, D, mean, aux)` from the slices' totals and `batch`
    (`slicing.after_slices`): the batch's loss, gradient and normaliser."""
    d = slicing.batch_normaliser(totals, mean, ops.convert_to_tensor(1.0))
    grads = slicing.batch_gradient(grads, d, mean, accumulating)
    return grads, d, mean, (batch.loss, *aux[1:])


def _stateless_loss(model, values, batch, loss_of):
    """Keras' JAX forward and loss on the state's `values` (`(trainable,
    non_trainable, metrics, optimizer)`, `jax_forward.stateless_loss`), the
    loss computed by `loss_of(terms_of)`, `terms_of()` giving
    `slicing.slice_terms` of the forward (its `model.losses` split into
    terms), as `compute_loss_and_updates` computes its own. A subclass's
    own `compute_loss_and_updates` is called instead (its unscaled loss,
    its terms unknown: `compile_loss.check_extra_terms` refuses where they
    cannot be weighted). Returns `(loss_of's result, y_pred,
    non_trainable, metrics)`."""
    x, y, sample_weight = batch
    if type(model).compute_loss_and_updates is not keras.Model.compute_loss_and_updates:
        found = {}

        def own_terms():
            _, found["aux"] = jax_forward.keras_loss(model, values, batch)
            loss = found["aux"][0]
            return [loss], LossTerms(loss, None, None, None, False)

        result = loss_of(own_terms)
        return (result, *found["aux"][1:])
    return jax_forward.stateless_loss(
        model,
        values[:3],
        x,
        lambda y_pred, forward: loss_of(
            lambda: slicing.slice_terms(model, x, y, y_pred, sample_weight, False, forward)
        ),
    )


def _penalty_gradient(model, tv):
    """`(penalty, grads)`: the weight penalty (`slicing.weight_penalty`) at
    the trainable values `tv` and its float32 gradient; `None` without a
    regularised variable."""
    if not regularized_variables(model):
        return None

    def penalty(trainable):
        mapping = list(zip(model.trainable_variables, trainable))
        with keras.StatelessScope(state_mapping=mapping):
            return slicing.weight_penalty(model)

    value, grads = jax.value_and_grad(penalty)(list(tv))
    return value, [ops.cast(g, "float32") for g in grads]


def _rows_first(tensors):
    """`[slices, rows, ...]` tensors (`None` kept) as `[slices * rows, ...]`."""
    return [None if t is None else ops.reshape(t, (-1, *t.shape[2:])) for t in tensors]
