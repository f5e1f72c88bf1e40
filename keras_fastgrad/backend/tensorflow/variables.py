"""How the TensorFlow step adds into its state variables: `increment` (a
scalar, one op) and `add_into` (a gradient-sized sum, a read, an `AddV2` and
an `Assign`), into any variable, global or per replica (the accumulation's
sums); `run_time_zeros` starts or empties a gradient-sized sum. The
variables themselves are made by `keras_fastgrad.step.variables`."""

from keras_fastgrad._tf_startup import tf


def increment(variable, amount=1):
    """`variable += amount` as one op (`AssignAddVariableOp`): Keras'
    `assign_add` reads, adds and assigns (three ops).

    Args:
        variable: A `keras.Variable` (`step.variables.global_variable`).
        amount: Python number or scalar tensor of the variable's dtype.

    Example:

    >>> from keras_fastgrad.step.variables import global_variable
    >>> count = global_variable(0.0, "count")
    >>> increment(count, 2.0)
    >>> float(count.numpy())
    2.0
    """
    variable.value.assign_add(amount, read_value=False)


def add_into(variable, amount):
    """`variable = variable + amount` as a read, an `AddV2` and an
    `AssignVariableOp` (Keras' own accumulation does the same): for a
    gradient-sized sum, cheaper than `increment`'s one `AssignAddVariableOp`
    (`docs/benchmarks.md`); `increment` stays for scalars.

    Args:
        variable: A `keras.Variable`.
        amount: A tensor of the variable's shape and dtype.

    Example:

    >>> from keras_fastgrad.step.variables import global_variable
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
    started or emptied with it would hold that memory between steps.

    >>> run_time_zeros((2, 3)).numpy().tolist()
    [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    """
    return tf.raw_ops.Empty(shape=tf.TensorShape(shape).as_list(), dtype=tf.float32, init=True)
