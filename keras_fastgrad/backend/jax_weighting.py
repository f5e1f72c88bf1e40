"""How much each micro-batch counts, in `keras.ops` (the JAX step's).

The same rule as `keras_fastgrad.step.weighting` (read its docstring): a
Keras loss is `S / D`, and the window's gradient is
`sum_j D_j g_j / sum_j D_j` (`sum_j g_j` for `reduction="sum"`). This
module records each output loss's `D` while the model's own `CompileLoss`
runs inside the JAX step (`LossShares`), with `keras.ops` instead of
TensorFlow ops, and decides the micro-batch's `Share` the same way.
"""

import warnings

import keras
from keras import ops

from keras_fastgrad import _compat as compat
from keras_fastgrad.step.compile_loss import wrapped_output_losses
from keras_fastgrad.step.weighting import _combined, _standard


def _size(t):
    return ops.cast(ops.size(t), "float32")


def normaliser(losses, sample_weight, mask, reduction):
    """The `D` by which Keras divides `sum(weighted losses)`
    (`keras_fastgrad.step.weighting.normaliser`, in `keras.ops`).

    Example:

    >>> losses = keras.ops.ones([2, 3])
    >>> mask = keras.ops.convert_to_tensor([[True, True, False], [True, False, False]])
    >>> float(normaliser(losses, None, mask, "sum_over_batch_size"))
    3.0
    """
    if reduction == "sum":
        return ops.convert_to_tensor(1.0)
    if reduction in ("sum_over_batch_size", "mean"):
        if mask is None:
            return _size(losses)
        valid = ops.sum(ops.cast(mask, "float32"))
        return valid * ops.divide_no_nan(_size(losses), _size(mask))
    merged = compat.apply_mask(sample_weight, mask, dtype="float32", reduction=reduction)
    if merged is None:
        return _size(losses)
    return ops.sum(ops.cast(merged, "float32"))


class _Measuring:
    """One `CompileLoss` output loss: `Loss.__call__`'s value, and its
    normaliser and kind recorded on the side (`(D, kind)`)."""

    def __init__(self, loss_fn, sink):
        self.loss_fn, self.sink = loss_fn, sink
        self.name = getattr(loss_fn, "name", None)

    def __call__(self, y_true, y_pred, sample_weight=None):
        fn = self.loss_fn
        if not _standard(fn):  # unknown normaliser: counted by rows
            self.sink.append((None, "rows"))
            return fn(y_true, y_pred, sample_weight)
        in_mask = compat.get_keras_mask(y_pred)
        with keras.name_scope(fn.name):
            to_tensor = lambda t: ops.convert_to_tensor(t, dtype=fn.dtype)  # noqa: E731
            losses = fn.call(
                keras.tree.map_structure(to_tensor, y_true),
                keras.tree.map_structure(to_tensor, y_pred),
            )
            mask = _combined(in_mask, compat.get_keras_mask(losses))
            value = compat.reduce_weighted_values(
                losses,
                sample_weight=sample_weight,
                mask=mask,
                reduction=fn.reduction,
                dtype=fn.dtype,
            )
        if tuple(losses.shape) == ():
            self.sink.append((None, "rows"))
            return value
        reduction = fn.reduction
        by_rows = mask is None and (
            reduction in ("sum_over_batch_size", "mean") or sample_weight is None
        )
        kind = "sum" if reduction == "sum" else ("rows" if by_rows else "data")
        self.sink.append((normaliser(losses, sample_weight, mask, reduction), kind))
        return value


class LossShares:
    """Context manager: records each output loss's normaliser while the
    model computes its loss; `share()` then gives `(D, mean, by_rows)`."""

    def __init__(self, model, num_rows):
        self.model, self.num_rows = model, num_rows
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
        """`(D, mean, by_rows)`: the float32 normaliser (gradient-free),
        whether the window divides by its sum, whether it counts rows."""
        recorded = self.recorded
        kinds = {kind for _, kind in recorded}
        if len(recorded) == 1 and recorded[0][0] is not None:
            actual, kind = recorded[0]
            return ops.stop_gradient(actual), kind != "sum", kind == "rows"
        if recorded and kinds == {"sum"}:
            return ops.convert_to_tensor(1.0), False, True
        if kinds - {"rows"}:
            warnings.warn(
                "FastGradModel: the model's output losses have different "
                "normalisers, so micro-batches are weighted by their number "
                "of rows (see `keras_fastgrad.step.weighting`).",
                stacklevel=2,
            )
        return ops.convert_to_tensor(float(self.num_rows)), True, True
