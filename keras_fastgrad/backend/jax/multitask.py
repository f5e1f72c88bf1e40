"""`multitask` on Keras' JAX backend: how the task gradients of one
micro-batch are taken and the aggregator's state threaded; the merge's
rules are `keras_fastgrad.step.multitask`'s (as on TensorFlow).

1. One forward pass gives the task losses (`step.task_losses`) and the
   regularisation (`model.losses`, not a task), each scaled by the loss
   scale (or, accumulating, by the micro-batch's share `D_j`).
2. The program is traced once (`jax.make_jaxpr`); which tasks reach each
   variable is read from it (`jax_reaching`: JAX returns zeros where
   TensorFlow's tape returns `None`).
3. One forward and `T` backward passes (`jax.vjp`, one pullback per task),
   plus one for the regularisation; each unscaled.
4. `core.merge`: the Gram matrix, the aggregator's weights, the merge, the
   regularisation added; a variable nothing reaches gets zeros.

The aggregator's variables ride in Keras' state tuple (`jax_state`:
`multitask_variables`): a seed generator (PCGrad's orders) moves every
step, a stateful aggregator's state as `core.merge` says
(`core.next_state`). The
task telemetry (`core.task_logs`) comes from the micro-batch's Gram matrix
whenever any telemetry key is requested.
"""

import jax
import keras
from keras import ops

from keras_fastgrad import _compat as compat
from keras_fastgrad.backend.jax import batchnorm as jax_batchnorm
from keras_fastgrad.backend.jax import forward as jax_forward
from keras_fastgrad.backend.jax import reaching as jax_reaching
from keras_fastgrad.backend.jax.state import multitask_variables, positions
from keras_fastgrad.maths.finite import all_finite
from keras_fastgrad.step import multitask as core
from keras_fastgrad.step.splitting import first_input
from keras_fastgrad.step.task_losses import task_losses, task_names
from keras_fastgrad.step.weighting import forward_with_share


def gradients(model, slots, state, x, y, sample_weight, accumulating, check_extra_terms):
    """The merged gradient of one micro-batch (see the module docstring).

    Args:
        model: The `FastGradModel` (with `multitask`).
        slots: The step's `jax_state.Slots`.
        state: `(trainable, non_trainable, optimizer, metrics)` values.
        x, y, sample_weight: The micro-batch.
        accumulating: Python bool, whether micro-batches are combined.
        check_extra_terms: The check of the loss terms a window cannot
            weight, called as `(model, share)`
            (`compile_loss.check_present_terms`).

    Returns:
        `(grads, D, mean, aux)` as `jax_step._gradients`, `aux` with a
        fifth entry: the task telemetry logs (`{}` without telemetry).
    """
    per_loss, reaching, losses, (aux, d), mean = task_gradients(
        model, slots, state, (x, y, sample_weight), accumulating, check_extra_terms
    )
    num_tasks = len(task_names(model))
    divisor = ops.cast(d, "float32") if accumulating else None  # the merge keeps D_j
    merged, updates, gram = merge_tasks(
        model,
        per_loss[:num_tasks],
        reaching,
        state[1],
        divisor,
        per_loss[num_tasks] if len(per_loss) > num_tasks else None,
        all_finite(list(losses)),
    )
    return merged, d, mean, with_updates(model, aux, updates, gram)


def task_gradients(model, slots, state, batch, accumulating, check_extra_terms):
    """One forward (`losses_program`, traced once) and one backward pass
    per loss (`jax.vjp`); shared with `jax_micro_batches`' slices.

    Args:
        model, slots, state, accumulating, check_extra_terms: As
            `gradients`'.
        batch: `(x, y, sample_weight)`.

    Returns:
        `(per_loss, reaching, losses, (aux, D), mean)`: per loss (the
        tasks, then the regularisation if any) its float32 unscaled
        gradients (times `D`, accumulating), per trainable variable the
        tasks reaching it (`reaching_tasks`), the losses as differentiated,
        Keras' `aux` with the share, and whether the window divides by
        its sum.
    """
    tv = state[0]
    program, found, scale = losses_program(
        model, slots, state, *batch, accumulating, check_extra_terms
    )
    closed, traced = jax_reaching.traced_program(program, list(tv))
    reaching = reaching_tasks(closed, len(task_names(model)), len(tv))
    losses, pullback, (aux, d) = jax.vjp(traced, *tv, has_aux=True)
    per_loss = [  # one backward pass per task (and the regularisation)
        jax_forward.unscaled(pullback(one_hot(losses, i)), d, scale) for i in range(len(losses))
    ]
    return per_loss, reaching, losses, (aux, d), found["mean"]


def losses_program(model, slots, state, x, y, sample_weight, accumulating, check_extra_terms):
    """`(program, found, scale)`: `program(trainable)` is `(losses, (aux,
    D))`, the task losses then the regularisation (if any) as
    differentiated (times the loss scale, or accumulating, the share `D`),
    Keras' `aux` and the share; `found["mean"]` is set when it is traced;
    `scale` the loss scale's value (`None` without loss scaling)."""
    _, ntv, ov, mv = state
    rows = first_input(x).shape[0]
    scale = slots.loss_scale(ov)
    found = {"mean": True}

    def program(trainable):
        ((tasks, regularization), aux), d, found["mean"] = forward_with_share(
            model,
            rows,
            accumulating,
            lambda: jax_batchnorm.forward(
                model, _compute(model), trainable, ntv, mv, x, y, sample_weight
            ),
            check_extra_terms,
        )
        losses = tasks + ([] if regularization is None else [regularization])
        return tuple(jax_forward.scaled(losses, d, scale, accumulating)), (aux, d)

    return program, found, scale


def one_hot(values, i):
    """The cotangent that picks `values[i]` (a tuple like `values`)."""
    return tuple(ops.ones_like(v) if j == i else ops.zeros_like(v) for j, v in enumerate(values))


def with_updates(model, aux, updates, gram):
    """Keras' `aux` with the aggregator's variables' new values in its
    non-trainable values and the task telemetry as a fifth entry."""
    unscaled_loss, y_pred, new_ntv, new_mv = aux
    new_ntv = list(new_ntv)
    for i, value in updates.items():
        new_ntv[i] = value
    return unscaled_loss, y_pred, new_ntv, new_mv, _logs(model, gram)


def _compute(model):
    """Keras' `compute_loss_and_updates` (JAX trainer) with the task losses
    and the regularisation apart (`jax_forward.stateless_loss`; Keras'
    own, never a subclass's): `(tasks, regularization), (unscaled_loss,
    y_pred, non_trainable, metrics)` on the state's values."""

    def compute(trainable, ntv, mv, x, y, sample_weight):
        def losses_of(y_pred, losses):
            tasks = task_losses(model, y, y_pred, sample_weight)  # the `<name>_loss` metrics
            return tasks, [compat.additional_loss(model, loss) for loss in losses]

        (tasks, extra), y_pred, new_ntv, new_mv = jax_forward.stateless_loss(
            model, (trainable, ntv, mv), x, losses_of
        )
        regularization = None
        if extra:
            regularization = extra[0] if len(extra) == 1 else ops.sum(ops.stack(extra))
        unscaled = ops.sum(ops.stack(tasks + extra))
        return (tasks, regularization), (unscaled, y_pred, new_ntv, new_mv)

    return compute


def reaching_tasks(closed, num_tasks, num_trainable):
    """Per trainable variable, the tuple of tasks whose loss reaches it
    (read from the traced program; its first inputs are the trainable
    values, its first outputs the task losses)."""
    reached = jax_reaching.reaching_inputs(closed, num_tasks)
    return [tuple(t for t in range(num_tasks) if k in reached[t]) for k in range(num_trainable)]


def merge_tasks(model, per_task, reaching, ntv, divisor, regularization, losses_finite):
    """The merged gradient of the task gradients (`core.merge`; shared
    with `jax_micro_batches`), the aggregator's state threaded through
    Keras' state tuple.

    Args:
        model: The `FastGradModel`.
        per_task: Per task, its float32 gradients (one per trainable).
        reaching: Per trainable variable, the tasks reaching it.
        ntv: The non-trainable values (the aggregator's state among them).
        divisor: `None`, or the share the gradients carry (`D`).
        regularization: `None` or the regularisation's gradients.
        losses_finite: Boolean scalar, whether the losses are finite.

    Returns:
        `(merged, updates, gram)`: the merged gradients (zeros where
        nothing reaches), the aggregator's `{ntv position: value}` after
        the step and the Gram matrix.
    """
    weigh, state, updates = weighing(model, ntv)
    result = core.merge(
        per_task, reaching, weigh, regularization, divisor, state=state, losses_finite=losses_finite
    )
    merged = [ops.zeros_like(g) if m is None else m for m, g in zip(result.grads, per_task[0])]
    return merged, updates(result.new_state), result.gram


def weighing(model, ntv):
    """The aggregator on Keras' state tuple: `(weigh, state, updates)`.

    `weigh(gram) -> (weights, new_state)` calls it on its variables' values
    read from `ntv`; `state` is a stateful aggregator's state before the
    step (its `state_variables`' values in `ntv`); `updates(state_after)`
    is `{ntv position: value}` of its variables after the step (a seed
    generator's as `weigh` moved it, the state as given:
    `core.TaskMerge.new_state`)."""
    aggregator = model.fastgrad_step_state.merger.aggregator
    where = positions(model.non_trainable_variables)
    variables = multitask_variables(model)
    state_at = [where[id(v)] for v in aggregator.state_variables]
    moved = {}

    def weigh(gram):
        mapping = [(v, ntv[where[id(v)]]) for v in variables]
        with keras.StatelessScope(state_mapping=mapping) as scope:
            weights, new_state = aggregator.weights_and_state(gram)
        moved.update({where[id(v)]: jax_forward.current(scope, v) for v in variables})
        return weights, new_state

    def updates(state_after):
        return {**moved, **dict(zip(state_at, state_after))}

    return weigh, tuple(ntv[i] for i in state_at), updates


def _logs(model, gram):
    """The task telemetry keys the step logs (`core.logged_task_keys`),
    from the micro-batch's Gram matrix."""
    return core.logged_task_keys(
        model.fastgrad_step_state.log_keys,
        lambda: core.task_logs(task_names(model), core.task_telemetry(gram)),
    )
