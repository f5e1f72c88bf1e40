"""How much each micro-batch counts, on JAX: the TensorFlow step's own
`keras_fastgrad.step.weighting.LossShares` (its maths written once in
`keras.ops`, `keras_fastgrad.maths.weighting`), its share read as the
tuple the JAX step threads through `jax.value_and_grad`'s aux."""

from keras import ops

from keras_fastgrad.step import weighting


class LossShares(weighting.LossShares):
    """`step.weighting.LossShares`, whose `share()` is `(D, mean, by_rows)`.

    Example:

    >>> inputs = keras.Input((3,))
    >>> model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    >>> model.compile(loss="mse")
    >>> x, y = keras.ops.ones([4, 3]), keras.ops.zeros([4, 2])
    >>> with LossShares(model, 4) as shares:
    ...     loss = model.compute_loss(x, y, model(x))
    >>> d, mean, by_rows = shares.share()
    >>> float(d), mean, by_rows  # 4 rows x 2 outputs, mse averages the last axis
    (4.0, True, True)
    """

    def share(self):
        """`(D, mean, by_rows)`: the float32 normaliser (gradient-free),
        whether the window divides by its sum, whether it counts rows."""
        share = super().share()
        self.describe = share.describe  # the reduction in words (for errors)
        return share.actual, share.mean, share.by_rows


def forward_with_share(model, rows, accumulating, forward, check_extra_terms):
    """`forward()` under `LossShares` when `accumulating`, the share read
    and the extra loss terms checked after: `(result, D, mean)`; without
    accumulation `(forward(), 1.0, True)` (nothing to weigh).

    Args:
        model: The model whose loss `forward` computes.
        rows: The micro-batch's rows.
        accumulating: Python bool.
        forward: Zero-argument callable, the forward pass and loss.
        check_extra_terms: `(model, mean, by_rows, describe)`, raises for
            extra loss terms the share cannot weigh.
    """
    if not accumulating:
        return forward(), ops.convert_to_tensor(1.0), True
    with LossShares(model, rows) as shares:
        result = forward()
    d, mean, by_rows = shares.share()
    check_extra_terms(model, mean, by_rows, shares.describe)
    return result, d, mean
