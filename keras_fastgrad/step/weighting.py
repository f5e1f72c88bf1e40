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

The maths (`normaliser`, the measuring loss, `Share`) is written once in
`keras.ops` in `keras_fastgrad.maths.weighting`, for both backends' steps;
this module puts it in place around the model's own `CompileLoss`.
"""

from keras import ops

from keras_fastgrad.maths.weighting import (  # noqa: F401  (re-exported)
    Measuring,
    Share,
    normaliser,
    share_of,
)
from keras_fastgrad.step.compile_loss import check_extra_terms, wrapped_output_losses


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
            self.model, lambda entry: Measuring(entry.loss, self.recorded)
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
        return share_of(self.recorded, self.num_rows)


def forward_with_share(model, rows, accumulating, forward, check_extra_terms):
    """`forward()` under `LossShares` when `accumulating`, the share read
    and the extra loss terms checked after: `(result, D, mean)`; without
    accumulation `(forward(), 1.0, True)` (nothing to weigh). The JAX step's
    form (its `jax.value_and_grad` carries `D` out in its aux).

    Args:
        model: The model whose loss `forward` computes.
        rows: The micro-batch's rows.
        accumulating: Python bool.
        forward: Zero-argument callable, the forward pass and loss.
        check_extra_terms: `(model, share)`, raises for extra loss terms
            the share cannot weigh (`compile_loss.check_present_terms`).

    Example:

    >>> inputs = keras.Input((3,))
    >>> model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    >>> model.compile(loss="mse")
    >>> x, y = keras.ops.ones([4, 3]), keras.ops.zeros([4, 2])
    >>> forward = lambda: model.compute_loss(x, y, model(x))
    >>> _, d, mean = forward_with_share(model, 4, True, forward, lambda *a: None)
    >>> float(d), mean  # 4 rows x 2 outputs, mse averages the last axis
    (4.0, True)
    """
    if not accumulating:
        return forward(), ops.convert_to_tensor(1.0), True
    with LossShares(model, rows) as shares:
        result = forward()
    share = shares.share()
    check_extra_terms(model, share)
    return result, share.actual, share.mean


def weighed_loss(model, terms_of, rows, options=None, merged=False):
    """`terms_of()` under `LossShares`, the share read and, with `options`,
    the loss's terms beyond the output losses checked: `(losses, terms,
    share)` (the step's form where the forward sums the terms itself).

    Args:
        model: The model whose loss `terms_of` computes.
        terms_of: `() -> (losses, terms)`: the list of losses the gradient
            is taken of and their `compile_loss.LossTerms`.
        rows: The micro-batch's (or slice's) rows.
        options: The combining options as set (e.g.
            `["accumulation_steps=4"]`), or `None`: not checked (trace time,
            `compile_loss.check_extra_terms`).
        merged: Python bool, the multi-task step.
    """
    with LossShares(model, rows) as shares:
        losses, terms = terms_of()
    share = shares.share()
    if options is not None:
        check_extra_terms(model, share, options, terms, merged=merged)
    return losses, terms, share
