"""Dynamic loss scaling's rule on values: Keras' `LossScaleOptimizer`'s.

Halve the scale after a non-finite gradient, double it after
`growth_steps` finite updates in a row (and restart the count). Written
once in `keras.ops`: TensorFlow's `keras_fastgrad.step.loss_scaling`
assigns the result to the optimizer's `dynamic_scale` and `step_counter`
variables, JAX's step (`keras_fastgrad.backend.jax.units.update_scale`)
returns it in the optimizer's state.
"""

from keras import ops


def next_scale(scale, counter, finite, growth_steps, counts_growth=True):
    """The loss scale and growth counter after one micro-batch.

    Args:
        scale: float32 scalar, the loss scale.
        counter: Integer scalar, finite updates since the last change.
        finite: Boolean scalar, whether the micro-batch's gradient was.
        growth_steps: Python int, `dynamic_growth_steps`.
        counts_growth: Python bool. `False` where a finite micro-batch is
            not an update (inside an accumulation window): only an
            overflow acts (it halves and restarts the count).

    Returns:
        Tuple `(scale, counter)`, of the inputs' dtypes.

    Example:

    >>> scale, counter = next_scale(
    ...     keras.ops.array(8.0), keras.ops.array(1), keras.ops.array(True), 2)
    >>> float(scale), int(counter)  # the second finite update: doubled
    (16.0, 0)
    >>> scale, counter = next_scale(
    ...     keras.ops.array(8.0), keras.ops.array(1), keras.ops.array(False), 2)
    >>> float(scale), int(counter)
    (4.0, 0)
    """
    zero = ops.zeros((), counter.dtype)
    if not counts_growth:
        return ops.where(finite, scale, scale * 0.5), ops.where(finite, counter, zero)
    last = ops.convert_to_tensor(growth_steps - 1, counter.dtype)
    grow = ops.logical_and(finite, ops.equal(counter, last))
    scale = ops.where(finite, ops.where(grow, scale * 2.0, scale), scale * 0.5)
    counter = ops.where(finite, ops.where(grow, zero, counter + 1), zero)
    return scale, counter
