"""`multitask` on TensorFlow: how the task gradients are taken and where
the merge's state lives; the rules are `keras_fastgrad.step.multitask`'s.
This module is the shell's `MULTITASK` entry point: the primitives
`keras_fastgrad.multitask.TaskMerger` calls (its docstring states them),
those of features space (`capture`, `merge_in_z`) from
`keras_fastgrad.backend.tensorflow.features`.

- the task gradients: one `tape.gradient` per task from one persistent
  tape (`T` backward passes), each unscaled; a variable a task's loss does
  not reach gets `None` from the tape, which is the reaching-task split;
- the telemetry of the latest merge and a stateful aggregator's state in
  variables (the step's logs read them after the step);
- `tf.distribute`: the number of replicas and their sum;
- `tf.IndexedSlices`: a sparse gradient's stored rows are what the finite
  check reads.
"""

from keras_fastgrad._tf_startup import tf
from keras_fastgrad.backend.tensorflow.finite import all_finite
from keras_fastgrad.backend.tensorflow.gradients import rows_gram, to_float32_list, values
from keras_fastgrad.backend.tensorflow.replicas import num_replicas, replica_sum
from keras_fastgrad.step import multitask as core
from keras_fastgrad.step.variables import global_variable


def task_gradients(tape, task_losses, regularization, variables, unscale=None):
    """The float32 gradients of each task loss and of the regularisation.

    Args:
        tape: A persistent `tf.GradientTape` that recorded the losses.
        task_losses: The `T` scalar losses as differentiated.
        regularization: Scalar loss or `None`.
        variables: The Keras variables to differentiate.
        unscale: `None` or a callable applied to each gradient list.

    Returns:
        `(per_task, regularization_grads)`: `T` lists aligned with
        `variables` (`None` where the loss does not reach), and the
        regularisation's list (or `None`).
    """
    sources = [v.value for v in variables]
    unscale = unscale or (lambda grads: grads)
    per_task = [to_float32_list(unscale(tape.gradient(loss, sources))) for loss in task_losses]
    reg_grads = None
    if regularization is not None:
        reg_grads = to_float32_list(unscale(tape.gradient(regularization, sources)))
    return per_task, reg_grads


def losses_finite(task_losses, regularization):
    """Boolean scalar: the task losses and the regularisation are finite."""
    return all_finite(task_losses + [r for r in [regularization] if r is not None])


def merge_tape_gradients(per_task, regularization, share, weigh, state, losses_finite=None):
    """`core.merge` of the tape's gradients (`None` = not reached), under
    the current strategy's replicas, a sparse gradient's stored rows
    checked for the aggregator's state."""
    return core.merge(
        per_task,
        core.reaching_of(per_task),
        weigh,
        regularization,
        share,
        replicas=num_replicas(),
        replica_sum=replica_sum,
        rows_gram=rows_gram,
        state=state,
        losses_finite=losses_finite,
        stored=values,
    )


def capture(model, tape, task_merger):
    """`features.capture`: the context of the step's forward pass (imported
    with the call: features space imports `keras_fastgrad.multitask`)."""
    from keras_fastgrad.backend.tensorflow import features

    return features.capture(model, tape, task_merger)


def merge_in_z(*args, **kwargs):
    """`features.merge_in_z`: the tasks merged in `Z` space."""
    from keras_fastgrad.backend.tensorflow import features

    return features.merge_in_z(*args, **kwargs)


def build(aggregator, num_tasks):
    """Builds `aggregator` for `num_tasks` tasks (a stateful one's state:
    saved with the model, its `multitask` attribute) and returns a
    `core.TaskTelemetry` of float32 variables (zeros; measurements, not
    saved), both created outside any traced function."""
    with tf.init_scope():  # may be called while tracing the step
        aggregator.build(num_tasks)
        return core.TaskTelemetry(
            global_variable(tf.zeros([num_tasks]), "task_grad_norms"),
            global_variable(tf.zeros([num_tasks] * 2), "task_cosine"),
            global_variable(tf.zeros([]), "task_conflicts"),
        )


def record(variables, telemetry):
    """Assigns a `core.TaskTelemetry` to `telemetry_variables`."""
    for variable, value in zip(variables, telemetry):
        variable.assign(value)


def read(variables):
    """The telemetry variables' values, for `core.task_logs`."""
    norms, cosine, conflicts = variables
    return core.TaskTelemetry(norms, cosine, tf.identity(conflicts.value))


def state_of(aggregator):
    """A stateful aggregator's state before the step (its variables'
    values; `()` for a stateless one)."""
    return tuple(v.value for v in aggregator.state_variables)


def assign(state_variables, state):
    """Assigns the aggregator's state after the step (`TaskMerge.new_state`)."""
    for variable, value in zip(state_variables, state):
        variable.assign(value)
