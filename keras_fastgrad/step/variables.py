"""The state variables of the step's units whose value is global.

Under a `tf.distribute` strategy every replica computes the same value for
these (counters, measurements, the window's normaliser): replica 0's write
is kept (`aggregation="only_first_replica"`). They are never autocast to a
mixed-precision compute dtype and never trained.
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

    >>> count = global_variable(0, "micro_step", dtype="int64")
    >>> count.dtype, count.trainable
    ('int64', False)
    """
    return keras.Variable(
        value,
        dtype=dtype,
        trainable=False,
        autocast=False,
        aggregation="only_first_replica",
        name=name,
    )


def increment(variable, amount=1):
    """`variable += amount` as one op (`AssignAddVariableOp`): Keras'
    `assign_add` reads, adds and assigns (three ops), which shows on the
    short steps the counters run in.

    Args:
        variable: A `keras.Variable` (`global_variable`).
        amount: Python number or scalar tensor of the variable's dtype.

    Example:

    >>> count = global_variable(0.0, "count")
    >>> increment(count, 2.0)
    >>> float(count.numpy())
    2.0
    """
    variable.value.assign_add(amount, read_value=False)
