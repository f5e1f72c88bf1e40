"""How much each micro-batch counts: its loss's own normaliser.

Keras reduces a loss as `S / D`: the weighted sum `S` of the per-element
losses over the normaliser `D` that the loss's `reduction` defines (see
`reduce_weighted_values` in keras/src/losses/loss.py):

| reduction | `D` |
|---|---|
| `"sum_over_batch_size"` (default), `"mean"` | number of loss elements (`[B]`, `[B, T]`, `[B, H, W]`, ...); with a mask: the number of valid ones |
| `"mean_with_sample_weight"` | sum of the (masked) sample weights; number of elements without weights |
| `"sum"` | 1 (no normalisation) |

The loss of the concatenation of micro-batches j is `sum_j S_j / sum_j D_j`
(`sum_j S_j` for `"sum"`), so its gradient is

    g = sum_j D_j g_j / sum_j D_j        (g = sum_j g_j for "sum"),

exact for masks, per-pixel / per-timestep losses, sample and class weights
and uneven batches. The step folds `D_j` into the micro-batch's loss (no pass
over the gradients), adds `D_j` to the window's normaliser and divides once
at the update (`mean=True`), or does not divide (`mean=False`, `"sum"`).

`LossShares` records `D` for every output loss while the model's own
`CompileLoss` runs (the per-element losses are computed once, exactly as
`Loss.__call__` does). With several outputs the micro-batch weight must be
common to all of them; the number of rows is used, exact when each output's
normaliser is its rows times a constant (no masks, no data-dependent
weights); otherwise a warning says the window is weighted by rows.
"""

import warnings

import keras
import tensorflow as tf

from keras_fastgrad._compat import (
    apply_mask,
    get_keras_mask,
    reduce_weighted_values,
)
from keras_fastgrad.step.compile_loss import wrapped_output_losses

_MEANS = ("sum_over_batch_size", "mean", "mean_with_sample_weight")


def _size(t):
    return tf.cast(tf.size(t), tf.float32)


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

    >>> losses = tf.ones([2, 3])
    >>> mask = tf.constant([[True, True, False], [True, False, False]])
    >>> float(normaliser(losses, None, mask, "sum_over_batch_size"))
    3.0
    >>> float(normaliser(losses, tf.constant([2.0, 1.0]), None,
    ...                  "mean_with_sample_weight"))
    3.0
    """
    if reduction == "sum":
        return tf.constant(1.0)
    if reduction in ("sum_over_batch_size", "mean"):
        if mask is None:
            return _size(losses)
        # Keras weighs valid entries by size(mask) / valid, then divides by
        # size(losses): D = valid * size(losses) / size(mask).
        valid = tf.reduce_sum(tf.cast(mask, tf.float32))
        # (`divide_no_nan`: a batch of no rows has no valid entry, D = 0.)
        return valid * tf.math.divide_no_nan(_size(losses), _size(mask))
    merged = apply_mask(sample_weight, mask, dtype=tf.float32, reduction=reduction)
    if merged is None:
        return _size(losses)
    return tf.reduce_sum(tf.cast(merged, tf.float32))


class _Recorded:
    """What one output loss call contributes: `(actual, real, kind)`, and
    its reduction and masking in words (`describe`)."""

    def __init__(self, actual, real, kind, describe=None):
        self.actual, self.real, self.kind = actual, real, kind
        self.describe = describe


class _Measuring:
    """Stands in for one `CompileLoss` output loss: the same value as
    `Loss.__call__`, and the loss's normaliser recorded on the side."""

    def __init__(self, loss_fn, sink):
        self.loss_fn, self.sink = loss_fn, sink
        self.name = getattr(loss_fn, "name", None)

    def __call__(self, y_true, y_pred, sample_weight=None):
        fn = self.loss_fn
        if not _standard(fn):  # unknown normaliser: counted by rows
            return self._unknown_normaliser(y_true, y_pred, sample_weight)
        # `Loss.__call__`, step for step, plus the normaliser.
        in_mask = get_keras_mask(y_pred)
        with keras.name_scope(fn.name):
            to_tensor = lambda t: keras.ops.convert_to_tensor(t, dtype=fn.dtype)  # noqa: E731
            losses = fn.call(
                tf.nest.map_structure(to_tensor, y_true), tf.nest.map_structure(to_tensor, y_pred)
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
                self.sink.append(_Recorded(None, None, "rows"))
            else:
                self.sink.append(self._recorded(losses, sample_weight, mask))
        return value

    def _unknown_normaliser(self, y_true, y_pred, sample_weight):
        """A loss whose normaliser is unknown: as Keras computes it,
        weighted by rows."""
        value = self.loss_fn(y_true, y_pred, sample_weight)
        self.sink.append(_Recorded(None, None, "rows"))
        return value

    def _recorded(self, losses, sample_weight, mask):
        """This output's `_Recorded`: its normaliser (`actual`, also what it
        adds to the batch's: `real`), and its kind."""
        reduction = self.loss_fn.reduction
        actual = normaliser(losses, sample_weight, mask, reduction)
        # D = rows x a constant (what the several-output case needs)
        by_rows = (
            mask is None
            and losses.shape[1:].is_fully_defined()
            and (reduction in ("sum_over_batch_size", "mean") or sample_weight is None)
        )
        kind = "sum" if reduction == "sum" else ("rows" if by_rows else "data")
        describe = f"reduction={reduction!r}"
        if mask is not None:
            describe += " with a mask"
        elif sample_weight is not None and reduction == "mean_with_sample_weight":
            describe += " with sample weights"
        return _Recorded(actual, actual, kind, describe)


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


class LossShares:
    """Context manager: records each output loss's normaliser while the
    model computes its loss, then gives the micro-batch's share.

    Args:
        model: A compiled `keras.Model`.
        num_rows: int or int32 scalar, the rows of the (slice of the) batch.

    Example:

    >>> inputs = keras.Input((5, 2))  # 5 timesteps, a loss per timestep
    >>> model = keras.Model(inputs, keras.layers.Dense(3)(inputs))
    >>> model.compile(loss="mse")  # mse averages the last axis: [4, 5]
    >>> x, y = tf.ones([4, 5, 2]), tf.zeros([4, 5, 3])
    >>> with LossShares(model, 4) as shares:
    ...     loss = model.compute_loss(x, y, model(x))
    >>> share = shares.share()
    >>> float(share.actual), float(share.real), share.mean  # 4 x 5 elements
    (20.0, 20.0, True)
    """

    def __init__(self, model, num_rows):
        self.model = model
        self.num_rows = num_rows
        self.recorded = []
        self._context = None

    def __enter__(self):
        self._context = wrapped_output_losses(
            self.model, lambda entry: _Measuring(entry.loss, self.recorded)
        )
        self._context.__enter__()
        return self

    def __exit__(self, *exc):
        return self._context.__exit__(*exc)

    def share(self):
        """The micro-batch's share (a trace-time decision, tensors inside).

        Returns:
            A `Share` (its `real` equals `actual`: a slice has no padded rows).
        """
        recorded = self.recorded
        rows = tf.cast(self.num_rows, tf.float32)
        kinds = {r.kind for r in recorded}
        if len(recorded) == 1 and recorded[0].actual is not None:
            only = recorded[0]
            return Share(
                only.actual, only.real, only.kind != "sum", only.kind == "rows", only.describe
            )
        if recorded and kinds == {"sum"}:
            return Share(tf.constant(1.0), tf.constant(1.0), False, describe='reduction="sum"')
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
                stacklevel=2,
            )
        return Share(rows, rows, True)


class Share:
    """A micro-batch's share of its window (see the module docstring).

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
        self.actual = tf.stop_gradient(actual)
        self.real = tf.stop_gradient(real)
        self.mean = mean
        self.by_rows = by_rows
        self.describe = describe

    def loss_weight(self, replicas):
        """What to multiply the micro-batch's loss by: `actual`, and the
        number of replicas for mean reductions (Keras divides those by it)."""
        return self.actual * (replicas if self.mean else 1)
