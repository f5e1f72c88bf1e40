"""How much each micro-batch counts: its loss's own normaliser, measured.

Written once in `keras.ops` for both backends' steps (the rule and the
table: `keras_fastgrad.step.weighting`). `Measuring` stands in for one of
`CompileLoss`'s output losses: it computes the same value as
`Loss.__call__`, step for step, and records the loss's normaliser `D` on
the side; `share_of` turns what the model's outputs recorded into the
micro-batch's `Share`. The context that puts `Measuring` in place around
the model's own loss computation is `step.weighting.LossShares`.
"""

import warnings

import keras
from keras import ops

from keras_fastgrad._compat import apply_mask, get_keras_mask, reduce_weighted_values

_MEANS = ("sum_over_batch_size", "mean", "mean_with_sample_weight")


def _size(t):
    return ops.cast(ops.size(t), "float32")


def normaliser(losses, sample_weight, mask, reduction):
    """The `D` by which Keras divides `sum(weighted losses)`.

    Args:
        losses: Per-element losses as the loss's `call` returns them.
        sample_weight: Sample weights passed to the loss, or `None`.
        mask: Boolean mask of the predictions (or of `losses`), or `None`.
        reduction: The loss's `reduction`.

    Returns:
        float32 scalar.

    Example:

    >>> losses = keras.ops.ones([2, 3])
    >>> mask = keras.ops.array([[True, True, False], [True, False, False]])
    >>> float(normaliser(losses, None, mask, "sum_over_batch_size"))
    3.0
    >>> float(normaliser(losses, keras.ops.array([2.0, 1.0]), None,
    ...                  "mean_with_sample_weight"))
    3.0
    """
    if reduction == "sum":
        return ops.convert_to_tensor(1.0)
    if reduction in ("sum_over_batch_size", "mean"):
        if mask is None:
            return _size(losses)
        # Keras weighs valid entries by size(mask) / valid, then divides by
        # size(losses): D = valid * size(losses) / size(mask).
        valid = ops.sum(ops.cast(mask, "float32"))
        # (`divide_no_nan`: a batch of no rows has no valid entry, D = 0.)
        return valid * ops.divide_no_nan(_size(losses), _size(mask))
    merged = apply_mask(sample_weight, mask, dtype="float32", reduction=reduction)
    if merged is None:
        return _size(losses)
    return ops.sum(ops.cast(merged, "float32"))


class Recorded:
    """What one output loss call contributes: `(actual, real, kind)`, and
    its reduction and masking in words (`describe`). `kind`: `"sum"`,
    `"rows"` (`D` is the rows times a constant) or `"data"`."""

    def __init__(self, actual, real, kind, describe=None):
        self.actual, self.real, self.kind = actual, real, kind
        self.describe = describe


class Measuring:
    """Stands in for one `CompileLoss` output loss: the same value as
    `Loss.__call__`, and a `Recorded` appended to `sink`.

    Args:
        loss_fn: The output's loss (any callable).
        sink: List the `Recorded` entries are appended to.
    """

    def __init__(self, loss_fn, sink):
        self.loss_fn, self.sink = loss_fn, sink
        self.name = getattr(loss_fn, "name", None)

    def __call__(self, y_true, y_pred, sample_weight=None):
        fn = self.loss_fn
        if not _standard(fn):  # unknown normaliser: counted by rows
            value = fn(y_true, y_pred, sample_weight)
            self.sink.append(Recorded(None, None, "rows"))
            return value
        # `Loss.__call__`, step for step, plus the normaliser.
        in_mask = get_keras_mask(y_pred)
        with keras.name_scope(fn.name):
            to_tensor = lambda t: ops.convert_to_tensor(t, dtype=fn.dtype)  # noqa: E731
            losses = fn.call(
                keras.tree.map_structure(to_tensor, y_true),
                keras.tree.map_structure(to_tensor, y_pred),
            )
            mask = _combined(in_mask, get_keras_mask(losses))
            value = reduce_weighted_values(
                losses,
                sample_weight=sample_weight,
                mask=mask,
                reduction=fn.reduction,
                dtype=fn.dtype,
            )
            if tuple(losses.shape) == ():  # Keras does not reduce a scalar
                self.sink.append(Recorded(None, None, "rows"))
            else:
                self.sink.append(self._recorded(losses, sample_weight, mask))
        return value

    def _recorded(self, losses, sample_weight, mask):
        """This output's `Recorded`: its normaliser (`actual`, also what it
        adds to the batch's: `real`), and its kind."""
        reduction = self.loss_fn.reduction
        actual = normaliser(losses, sample_weight, mask, reduction)
        # D = rows x a constant (what the several-output case needs)
        by_rows = (
            mask is None
            and all(d is not None for d in losses.shape[1:])
            and (reduction in ("sum_over_batch_size", "mean") or sample_weight is None)
        )
        kind = "sum" if reduction == "sum" else ("rows" if by_rows else "data")
        describe = f"reduction={reduction!r}"
        if mask is not None:
            describe += " with a mask"
        elif sample_weight is not None and reduction == "mean_with_sample_weight":
            describe += " with sample weights"
        return Recorded(actual, actual, kind, describe)


def _standard(fn):
    """A `keras.losses.Loss` with Keras' own `__call__` and a standard
    reduction: its normaliser is known."""
    reduction = getattr(fn, "reduction", None)
    return (
        isinstance(fn, keras.losses.Loss)
        and type(fn).__call__ is keras.losses.Loss.__call__
        and (reduction in _MEANS or reduction == "sum")
    )


def _combined(in_mask, out_mask):
    """The predictions' mask and the losses' own, as `Loss.__call__`
    combines them."""
    if in_mask is not None and out_mask is not None:
        return in_mask & out_mask
    return in_mask if in_mask is not None else out_mask


def share_of(recorded, num_rows):
    """The micro-batch's `Share` from its output losses' `Recorded` entries
    (a trace-time decision, tensors inside).

    One output with a known normaliser: its own. Every output `"sum"`: 1,
    not divided. Otherwise the number of rows, exact when each output's
    normaliser is its rows times a constant; else a warning says so.

    Args:
        recorded: List of `Recorded`, one per output loss called.
        num_rows: int or integer scalar, the rows of the (slice of the) batch.

    Returns:
        A `Share` (its `real` equals `actual`: a slice has no padded rows).
    """
    kinds = {r.kind for r in recorded}
    if len(recorded) == 1 and recorded[0].actual is not None:
        only = recorded[0]
        return Share(only.actual, only.real, only.kind != "sum", only.kind == "rows", only.describe)
    if recorded and kinds == {"sum"}:
        one = ops.convert_to_tensor(1.0)
        return Share(one, one, False, describe='reduction="sum"')
    if kinds - {"rows"}:
        warnings.warn(
            "FastGradModel: the model's output losses have different "
            'normalisers (masks, `reduction="sum"` or '
            "`mean_with_sample_weight` on some outputs), so no single "
            "weight per micro-batch makes accumulation, micro-batching "
            "or several replicas exact for all of them; micro-batches "
            "are weighted by their number of rows. Exact alternatives: "
            "the same reduction and masking on every output, or "
            "`accumulation_steps=1` with `micro_batches=1`.",
            stacklevel=3,
        )
    rows = ops.cast(num_rows, "float32")
    return Share(rows, rows, True)


class Share:
    """A micro-batch's share of its window (`step.weighting`'s rule).

    Args:
        actual: float32 scalar, the factor that turns the gradient of the
            micro-batch's loss into a gradient of its summed losses `S`.
        real: float32 scalar, what it adds to the window's normaliser.
        mean: Python bool, whether the window's sum is divided by its
            normaliser (`False` for `reduction="sum"`).
        by_rows: Python bool, whether the normaliser counts rows (times a
            constant): then per-row means weigh as the output losses.
        describe: The reduction (and mask or weights) in words.
    """

    def __init__(self, actual, real, mean, by_rows=True, describe="the compiled loss"):
        self.actual = ops.stop_gradient(actual)
        self.real = ops.stop_gradient(real)
        self.mean = mean
        self.by_rows = by_rows
        self.describe = describe

    def loss_weight(self, replicas):
        """What to multiply the micro-batch's loss by: `actual`, and the
        number of replicas for mean reductions (Keras divides those by it)."""
        return self.actual * (replicas if self.mean else 1)
