"""The step's own state variables (no backend imported).

`global_variable` makes a variable whose value is the same on every
replica of a `tf.distribute` strategy (counters, measurements, the window's
normaliser): replica 0's write is kept (`aggregation="only_first_replica"`);
it is never autocast to a mixed-precision compute dtype and never trained.
How the TensorFlow step adds into them (one op a scalar, a read-add-assign a
sum) is `keras_fastgrad.backend.tensorflow.variables`.
"""

import keras


def global_variable(value, name, dtype="float32"):
    """A non-trainable variable holding a value that is the same on every
    replica.

    Args:
        value: The initial value (scalar or array).
        name: String, the variable's name.
        dtype: The variable's dtype, defaults to `"float32"`.

    Returns:
        A `keras.Variable`.

    Example:

    >>> count = global_variable(0, "micro_step", dtype="int32")
    >>> count.dtype, count.trainable
    ('int32', False)
    """
    return keras.Variable(
        value,
        dtype=dtype,
        trainable=False,
        autocast=False,
        aggregation="only_first_replica",
        name=name,
    )


def sharded_as(variable):
    """The keyword arguments that give a new variable `variable`'s layout
    under a `keras.distribution` (as Keras' optimizers do for their slots):
    a buffer the shape of `variable` is then sharded exactly as it is, each
    device holding its own shard. `{}` outside a `keras.distribution`:
    the new variable's default applies.

    Args:
        variable: A `keras.Variable`.

    Returns:
        A dict, `{"layout": ...}` or `{}`, for `keras.Variable(**...)`.

    Example:

    >>> sharded_as(keras.Variable([0.0, 0.0]))
    {}
    """
    distribution = keras.distribution.distribution()
    if distribution is None:
        return {}
    # (The variable's own layout where it has one, else the distribution's
    # rule for its path: Keras' public reading of it.)
    return {"layout": distribution.get_variable_layout(variable)}
