"""The step's own state variables and the two ways it adds into them.

`global_variable` makes a variable whose value is the same on every
replica of a `tf.distribute` strategy (counters, measurements, the window's
normaliser): replica 0's write is kept (`aggregation="only_first_replica"`);
it is never autocast to a mixed-precision compute dtype and never trained.
`increment` (a scalar, one op) and `add_into` (a gradient-sized sum) add
into any variable, global or per replica (the accumulation's sums);
`run_time_zeros` starts or empties a gradient-sized sum.
"""

import keras

from keras_fastgrad._tf_startup import tf


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


def add_into(variable, amount):
    """`variable = variable + amount` as a read, an `AddV2` and an
    `AssignVariableOp` (Keras' own accumulation does the same). For a
    gradient-sized sum this is cheaper than `increment`'s one
    `AssignAddVariableOp`: on the 14 ms MLP's accumulation (2.4 M
    weights) the sums' kernels took about 1.7 ms a step as `AssignAdd`
    against 1.2 ms as `AddV2` + `Assign` (`benchmarks/op_profile.py`,
    kernel time of both threads). `increment` stays for scalars.

    Args:
        variable: A `keras.Variable`.
        amount: A tensor of the variable's shape and dtype.

    Example:

    >>> total = global_variable([1.0, 2.0], "total")
    >>> add_into(total, tf.constant([0.5, 0.5]))
    >>> total.numpy().tolist()
    [1.5, 2.5]
    """
    variable.value.assign(tf.convert_to_tensor(variable.value) + amount, read_value=False)


def run_time_zeros(shape):
    """A float32 tensor of zeros of the static `shape` (a tuple or
    `tf.TensorShape`, fully defined, as a variable's), made when the step
    runs. Grappler folds `tf.zeros` of a static shape into a constant that
    the step's graph keeps from one step to the next: a gradient-sized sum
    started or emptied with it holds that memory even between steps.

    >>> run_time_zeros((2, 3)).numpy().tolist()
    [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    """
    return tf.raw_ops.Empty(shape=tf.TensorShape(shape).as_list(), dtype=tf.float32, init=True)
