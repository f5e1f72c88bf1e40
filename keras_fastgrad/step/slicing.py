"""In-step micro-batching: one batch, `m` slices, one gradient (the rules).

The batch is split as `numpy.array_split` splits it, without padding
(`keras_fastgrad.step.splitting`): every term the model computes (output
losses, `add_loss` terms, activity regularisers, the extra terms of an
overridden `compute_loss`) and every layer that mixes samples sees real
rows only. The slices run one after the other, forward and backward, and
their gradients are summed in float32 (`SliceTotals`, `add_slice`):

- Each slice's loss is multiplied by its normaliser `D_i`
  (`keras_fastgrad.step.weighting`), so the sums are the gradients of the
  summed losses. The batch's normaliser is `sum_i D_i` under a mean reduction, 1
  under `reduction="sum"` (`batch_normaliser`); the batch's loss is the
  summed losses divided by it (`batch_loss`), its gradient the sums divided
  by it (`batch_gradient`; under `accumulation_steps` the window divides
  instead): exactly the un-split batch's, masks and sample weights
  included.
- Under `reduction="sum"` each slice's share is 1 and the layers' per-row
  losses are weighted by the slice's share of the rows (`rows_fraction`);
  the weight regularisation, in every slice's loss once, is taken back
  after the loop to once per batch (`surplus_regularization`).
- A non-finite slice makes the sums, hence the batch's gradient,
  non-finite: the whole batch is dropped by the step's finite verdict, as
  the un-split batch would be (no slice is dropped on its own).
- The layers' state (BatchNorm's moving statistics, seeds) is handed from
  one slice to the next, each value keeping its dtype (`hand_off`);
  BatchNorm normalises each slice by the slice's moments (ghost batch norm)
  and its statistics are pooled or stepped per slice by the BatchNorm unit.
- The predictions are the slices' concatenated, masks kept
  (`whole_batch`), so the metrics see what they would on the whole batch.
- With multi-task merging, each task's gradient is summed over the slices
  on its own and the sums merged once after the loop: the same update as
  the un-split step (the merge is not linear).

Refused, where the options and the loss are checked: `micro_batches` not
an integer >= 1, or with `multitask_space="features"` (`option_checks`);
terms beyond the output losses a slice cannot weight exactly
(`compile_loss.check_extra_terms`); a synchronized BatchNorm
(`batchnorm`).

Written once for both backends, importing neither: one slice's losses
and share (`slice_loss`), what it adds to the totals (`add_slice`), the
batch after the loop (`after_slices`). The loops (a `tf.while_loop` with
one slice in memory / `jax.lax.scan`), how the forward pass runs (the
model's call / Keras' stateless call) and the gradients (tape /
`value_and_grad`, the weight penalty's too) are the shells'
(`keras_fastgrad.backend.tensorflow.slicing`,
`keras_fastgrad.backend.jax.micro_batches`); they call these rules.
"""

import functools
import operator
import typing

from keras import ops, tree

from keras_fastgrad import _compat as compat
from keras_fastgrad.step.compile_loss import (
    loss_terms,
    present_terms,
    regularized_variables,
)
from keras_fastgrad.step.splitting import first_input, slice_sizes  # noqa: F401  (re-exported)
from keras_fastgrad.step.task_losses import regularization_loss, task_losses
from keras_fastgrad.step.weighting import weighed_loss


class SliceTotals(typing.NamedTuple):
    """The running totals of the slices' loop.

    Fields:
        sums: One list of float32 gradient sums per loss (one loss, or one
            per task and the regularisation's), each gradient times its
            slice's share `D_i`.
        loss: float32, the slices' losses times their `D_i`, summed.
        normaliser: float32, the `D_i` summed. (A slice's `actual` and
            `real` shares are equal, `maths.weighting.share_of`: a slice
            has no padded rows; one sum serves both.)
        measured: `()` or a one-tuple, the sum of a per-slice measure
            (`noise_scale.slice_measure`).
    """

    sums: typing.Any
    loss: typing.Any
    normaliser: typing.Any
    measured: tuple = ()


class SliceFacts(typing.NamedTuple):
    """What a slice's trace tells, the same for every slice: which
    variables get a gradient (per loss), whether the reduction is a mean,
    and each output's shape past the batch axis with its mask's (`None`:
    no mask).

    A variable no slice's loss reaches gets no gradient for the batch
    (`present`): its sum is dropped, not a zero."""

    has_grad: list
    mean: bool
    shapes: list

    @classmethod
    def of(cls, grads, mean, flat_pred):
        """The facts of a slice's gradients (one list per loss), reduction
        and flat predictions."""
        masks = [compat.get_keras_mask(p) for p in flat_pred]
        return cls(
            [[g is not None for g in row] for row in grads],
            mean,
            [(p.shape[1:], None if m is None else m.shape[1:]) for p, m in zip(flat_pred, masks)],
        )

    def present(self, sums):
        """`sums` with `None` where no slice gives the variable a gradient."""
        return [
            [s if has else None for s, has in zip(row, hases)]
            for row, hases in zip(sums, self.has_grad)
        ]


def add_slice(totals, sums, losses, share, measure=None, add_n=None):
    """The totals after one slice.

    Args:
        totals: The `SliceTotals` before the slice.
        sums: The gradient sums with the slice's gradients added (the
            shell adds them: its own how, e.g. started from the first
            slice's gradients). A non-finite slice makes them non-finite:
            the step's finite verdict then drops the whole batch.
        losses: The slice's (unscaled) losses as differentiated
            (`slice_loss`), any float dtype: their float32 sum is added.
        share: The slice's `D_i` (float32).
        measure: The slice's measure to add, or `None`.
        add_n: The shell's sum of a list of tensors, or `None` (`+`).
    """
    measured = totals.measured
    if measure is not None:
        measured = (measured[0] + measure,)
    losses = [ops.cast(l, "float32") for l in losses]
    loss = add_n(losses) if add_n is not None else functools.reduce(operator.add, losses)
    return SliceTotals(sums, totals.loss + loss * share, totals.normaliser + share, measured)


def slice_terms(model, x, y, y_pred, sample_weight, merged=False, forward=None):
    """`(losses, terms)`: the losses a slice's gradient is taken of, before
    the `"sum"` rules (`slice_loss`), and its `compile_loss.LossTerms`.

    One loss, the model's (`compile_loss.loss_terms`); merged (multi-task),
    one per task and the regularisation (`model.losses`; a zero if none:
    no variable gets a gradient from it). `forward`: a stateless forward's
    `model.losses` (JAX), or `None` (the layers hold them).
    """
    if not merged:
        terms = loss_terms(model, x, y, y_pred, sample_weight, forward)
        return [terms.total], terms
    regularization = regularization_loss(model)
    if regularization is None:
        regularization = ops.convert_to_tensor(0.0)
    return task_losses(model, y, y_pred, sample_weight) + [regularization], present_terms(model)


def slice_loss(model, terms_of, rows, batch_rows, options, merged=False, add_n=None):
    """One slice's losses as differentiated, and its share `D_i`: the loss
    weighed and its terms checked (`weighting.weighed_loss`, `terms_of()`
    e.g. `slice_terms`), the `"sum"` rules applied (`slice_losses`).

    Args:
        model: The `FastGradModel`, its forward pass on the slice done or
            done inside `terms_of`.
        terms_of: `() -> (losses, terms)`, the slice's losses and terms.
        rows: The slice's rows; batch_rows: the batch's.
        options: The combining options as set (e.g. `["micro_batches=3"]`).
        merged: Python bool, the multi-task step.
        add_n: The shell's sum of a list of tensors, or `None` (`+`).

    Returns:
        `(losses, share)`: the list of losses (unscaled; the gradient is
        taken of each times `share.loss_weight(...)`), a `weighting.Share`.
    """
    losses, terms, share = weighed_loss(model, terms_of, rows, options, merged)
    return slice_losses(losses, terms, share.mean, merged, rows, batch_rows, add_n), share


def batch_normaliser(totals, mean, one):
    """The batch's normaliser: `sum_i D_i` under a mean reduction, `one`
    under `"sum"` (the shell's float32 1; `None` for a consumer that
    takes "no normaliser", as the JAX shell's merge)."""
    return totals.normaliser if mean else one


def batch_loss(totals, mean):
    """The batch's loss as the un-split batch's: the slices' weighted
    losses summed, divided by `sum_i D_i` under a mean reduction (0 where
    it is 0: no weighted element), plain under `"sum"`."""
    if not mean:
        return totals.loss
    return ops.divide_no_nan(totals.loss, totals.normaliser)


def batch_gradient(grads, normaliser, mean, accumulating):
    """The batch's gradient from the sums: divided by the batch's
    normaliser under a mean reduction, unless a window of
    `accumulation_steps` divides (then the sums, times the batch's share,
    are the micro-step's contribution)."""
    if accumulating or not mean:
        return grads
    inverse = ops.divide_no_nan(1.0, normaliser)
    return [g * inverse for g in grads]


def rows_fraction(rows, batch_rows, dtype):
    """A slice's share of the batch's rows (`rows / batch_rows`, 0 for an
    empty batch) in `dtype`: under `reduction="sum"` the layers' per-row
    losses (their mean over the rows) are weighted by it, the slice's own
    share being 1."""
    fraction = ops.divide_no_nan(ops.cast(rows, "float32"), ops.cast(batch_rows, "float32"))
    return ops.cast(fraction, dtype)


def sum_reduction_loss(terms, rows, batch_rows, add_n=None):
    """A slice's loss under `reduction="sum"` with per-row layer losses:
    the compiled loss and the weight penalty as they are, the per-row
    losses times the slice's `rows_fraction` (`terms` a
    `compile_loss.LossTerms`), summed in the total's dtype by `add_n`
    (the shell's; default `+`)."""
    dtype = terms.total.dtype
    parts = [
        terms.compiled,
        terms.weights,
        terms.rows * rows_fraction(rows, batch_rows, terms.rows.dtype),
    ]
    parts = [ops.cast(p, dtype) for p in parts if p is not None]
    return add_n(parts) if add_n is not None else functools.reduce(operator.add, parts)


def slice_losses(losses, terms, mean, merged, rows, batch_rows, add_n=None):
    """The losses a slice's gradient is taken of: its own `losses`, except
    a single loss under `reduction="sum"` with per-row layer losses
    (`terms.rows`), which is `sum_reduction_loss`. Merged (multi-task)
    losses stay as they are (`compile_loss.check_extra_terms` refuses
    per-row terms under `"sum"` there)."""
    if merged or mean or terms.rows is None:
        return losses
    return [sum_reduction_loss(terms, rows, batch_rows, add_n)]


def surplus_regularization(totals, mean):
    """How many weight penalties too many the summed losses hold: each
    slice's loss held the penalty once, weighted by its `D_i`. Under a
    mean reduction that is the batch's penalty weighted by `sum_i D_i`:
    exact, `None`. Under `"sum"` (each `D_i` 1) the batch holds it once
    and the sum `slices` times: `sum_i D_i - 1` too many, in the loss and
    (the replicas' factor being 1) in the gradient."""
    if mean:
        return None
    return totals.normaliser - 1.0


def take_back(grads, penalty_grads, surplus):
    """`grads` less `surplus` times the penalty's gradient, where a
    variable has both (`penalty_grads`: a gradient or `None` per
    variable, aligned with `grads`)."""
    return [g if p is None or g is None else g - surplus * p for g, p in zip(grads, penalty_grads)]


def weight_penalty(model):
    """The weight regularisation of `model`'s trainable variables, float32
    (`None` without a regularised variable): what `surplus_regularization`
    counts. Call it where the shell takes its gradient."""
    penalties = [ops.cast(v.regularizer(v), "float32") for v in regularized_variables(model)]
    return functools.reduce(operator.add, penalties) if penalties else None


class SlicedBatch(typing.NamedTuple):
    """The batch after its slices' loop (`after_slices`).

    Fields:
        loss: The batch's loss, as the un-split batch's (`batch_loss`).
        sums: The gradient sums (one list per loss), the last less the
            surplus weight penalties (`surplus_regularization`).
        normaliser: The batch's normaliser (`batch_normaliser`).
        loss_sum: float32, the slices' weighted losses summed, less the
            surplus penalties (the multi-task merge's finite check).
    """

    loss: typing.Any
    sums: list
    normaliser: typing.Any
    loss_sum: typing.Any


def after_slices(totals, mean, one, penalty_gradient):
    """The batch's loss, sums and normaliser from the slices' totals: under
    `reduction="sum"` the weight penalty counted once per batch, not once
    per slice (its loss and its gradient taken back `surplus` times from
    the last row of sums: the model's loss, or the regularisation's).

    Args:
        totals: The loop's `SliceTotals` (the sums unscaled, `None` where
            no slice gives a variable a gradient).
        mean: Python bool, a mean reduction.
        one: The shell's float32 1 (the normaliser under `"sum"`).
        penalty_gradient: The shell's `() -> (penalty, grads)`: the value
            of `weight_penalty` and its gradient (aligned with the sums, a
            gradient or `None` per variable), or `None` without a
            regularised variable; called only under `"sum"`.

    Returns:
        A `SlicedBatch`.
    """
    loss_sum, sums = totals.loss, list(totals.sums)
    surplus = surplus_regularization(totals, mean)
    found = None if surplus is None else penalty_gradient()
    if found is not None:
        penalty, penalty_grads = found
        loss_sum = loss_sum - surplus * penalty
        sums[-1] = take_back(sums[-1], penalty_grads, surplus)
    loss = batch_loss(totals._replace(loss=loss_sum), mean)
    return SlicedBatch(loss, sums, batch_normaliser(totals, mean, one), loss_sum)


def hand_off(values, before):
    """The layers' state handed to the next slice: the new values, each in
    the dtype it had before (a layer may return another)."""
    return [ops.cast(v, b.dtype) for v, b in zip(values, before)]


def whole_batch(groups, structure, concatenate=None):
    """The whole batch's predictions from the slices'.

    Args:
        groups: One `(flat_predictions, flat_masks)` per group of slices,
            in order, each tensor with the group's rows on its first axis
            (a mask `None` where the output has none).
        structure: The predictions' structure (`tree.pack_sequence_as`).
        concatenate: `fn(tensors)` joining the groups along the first axis
            (the shell's; default `keras.ops.concatenate`).

    Returns:
        The predictions of every row, in order, with their masks set.
    """
    join = concatenate or (lambda parts: ops.concatenate(parts, axis=0))
    merged = []
    for k in range(len(groups[0][0])):
        p = join([flat[k] for flat, _ in groups])
        if groups[0][1][k] is not None:
            compat.set_keras_mask(p, join([masks[k] for _, masks in groups]))
        merged.append(p)
    return tree.pack_sequence_as(structure, merged)
