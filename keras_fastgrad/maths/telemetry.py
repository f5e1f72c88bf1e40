"""The optional telemetry keys' maths, in `keras.ops` (backend-neutral).

- `grad_norm/<layer>`: the L2 norm of one layer's part of the update's
  gradient, `sqrt(sum_v |g_v|^2)` over the layer's variables `v` (a
  variable's layer is its path without the last part: `layer_key`);
  the per-layer partial sums of the global norm.
- `update_ratio`: `||w_after - w_before|| / max(||w_before||, 1e-12)`, over
  all trainable variables together, in float32.
- `agc_clipped_fraction`: the fraction of units adaptive gradient clipping
  clipped (`keras_fastgrad.maths.adaptive_clipping` counts them).

Used by both shells (`keras_fastgrad.backend.jax.telemetry`,
`keras_fastgrad.backend.tensorflow.telemetry`, which sums a sparse
gradient's rows first and assigns the values into its variables).
"""

from keras import ops

# The smallest weight norm `update_ratio` divides by (all-zero weights).
MIN_WEIGHT_NORM = 1e-12


def layer_norms(grads, layers, wanted):
    """The L2 norm of each wanted layer's part of the gradient.

    Args:
        grads: List of gradients (`None` for a variable without one).
        layers: List of the variables' layer keys, in the same order.
        wanted: Iterable of the layer keys to measure.

    Returns:
        Dict `{layer key: float32 scalar}` in `wanted`'s order (0 for a
        layer without a gradient).

    Example:

    >>> norms = layer_norms(
    ...     [ops.convert_to_tensor([3.0]), ops.convert_to_tensor([4.0]),
    ...      ops.convert_to_tensor([1.0])], ["a", "a", "b"], ["a", "b"])
    >>> {k: float(v) for k, v in norms.items()}
    {'a': 5.0, 'b': 1.0}
    """
    wanted = list(wanted)
    squares = {}
    for layer, g in zip(layers, grads, strict=True):
        if g is not None and layer in wanted:
            sq = ops.sum(ops.square(ops.cast(g, "float32")))
            squares[layer] = squares[layer] + sq if layer in squares else sq
    zero = ops.zeros((), "float32")
    return {layer: ops.sqrt(squares.get(layer, zero)) for layer in wanted}


def update_ratio(before, after, total=None):
    """`||after - before|| / max(||before||, 1e-12)` over all the weights.

    Args:
        before: List of the weights before the update.
        after: List of the weights after it, in the same order.
        total: Optional callable adding a list of float32 scalars (the
            TensorFlow shell passes `tf.add_n`, one op); default: added
            one after another.

    Returns:
        float32 scalar.

    Example:

    >>> float(update_ratio([ops.convert_to_tensor([3.0, 4.0])],
    ...                    [ops.convert_to_tensor([3.0, 4.5])]))
    0.1
    """
    total = total or _added
    before = [ops.cast(b, "float32") for b in before]
    delta = total(
        [
            ops.sum(ops.square(ops.cast(a, "float32") - b))
            for b, a in zip(before, after, strict=True)
        ]
    )
    size = total([ops.sum(ops.square(b)) for b in before])
    return ops.sqrt(delta) / ops.maximum(ops.sqrt(size), MIN_WEIGHT_NORM)


def _added(scalars):
    out = ops.zeros((), "float32")
    for scalar in scalars:
        out = out + scalar
    return out
