"""`multitask` on Keras' JAX backend: the task gradients of one micro-batch,
merged (parameter space), as the TensorFlow step merges them
(`keras_fastgrad.multitask.merger`, `step.backward._merged_task_gradients`).

1. One forward pass gives the task losses (the model's own `CompileLoss`,
   recording each output loss times its loss weight: `step.task_losses`)
   and the regularisation (`model.losses`, not a task), each scaled by the
   loss scale (or, accumulating, by the micro-batch's share `D_j`).
2. The program is traced once (`jax.make_jaxpr`); the reaching-task split
   is read from it (`jax_reaching`): a variable one task reaches keeps its
   plain gradient and stays outside the Gram matrix, as on TensorFlow
   (where the tape's `None` says it).
3. One forward and `T` backward passes (`jax.vjp`, one pullback per task,
   as TensorFlow's persistent tape), plus one for the regularisation;
   each unscaled.
4. The Gram matrix over the shared variables (divided by `D_j^2`:
   the true gradients'), the aggregator's weights and next state
   (`weights_and_state`), the merge, the regularisation's gradient added
   (`keras_fastgrad.maths.multitask`).

The rest of the chain (finite check, accumulation, clipping, the gated
update) is `jax_step`'s, on the merged gradient.

The aggregator's variables ride in the state tuple (`jax_state`:
`multitask_variables`): a stateful aggregator's state (GradVac's targets)
moves only where the merged gradient and the task losses are finite, as
on TensorFlow; a seed generator (PCGrad's orders) moves every step, so each
step draws new orders under `jit`. The task telemetry
(`task_grad_norm/<task>`, `task_cosine/<a>/<b>`, `task_conflicts`, the
names of TensorFlow's) comes from the micro-batch's Gram matrix whenever
any telemetry key is requested.
"""

import jax
import keras
from jax.extend import core as jax_core
from keras import ops

from keras_fastgrad import _compat as compat
from keras_fastgrad.aggregators import gram_telemetry
from keras_fastgrad.backend import jax_batchnorm, jax_reaching, jax_weighting
from keras_fastgrad.backend.jax_state import multitask_variables
from keras_fastgrad.maths import multitask as maths
from keras_fastgrad.maths.finite import all_finite
from keras_fastgrad.step.task_losses import task_losses, task_names
from keras_fastgrad.step.telemetry import CONFLICTS, COSINE_PREFIX, NORM_PREFIX


def gradients(model, slots, state, x, y, sample_weight, accumulating, check_extra_terms):
    """The merged gradient of one micro-batch (see the module docstring).

    Args:
        model: The `FastGradModel` (with `multitask`).
        slots: The step's `jax_state.Slots`.
        state: `(trainable, non_trainable, optimizer, metrics)` values.
        x, y, sample_weight: The micro-batch.
        accumulating: Python bool, whether micro-batches are combined.
        check_extra_terms: `jax_step`'s check of the loss terms a window
            cannot weight, called as `(model, mean, by_rows)`.

    Returns:
        `(grads, D, mean, aux)` as `jax_step._gradients`, `aux` with a
        fifth entry: the task telemetry logs (`{}` without telemetry).
    """
    tv, ntv, ov, mv = state
    rows = keras.tree.flatten(x)[0].shape[0]
    scale = ov[slots.ov["scale"]] if slots.scaler is not None else None
    found = {"mean": True}

    def program(trainable):
        shares = jax_weighting.LossShares(model, rows) if accumulating else None
        if shares is not None:
            shares.__enter__()
        try:
            (tasks, regularization), aux = jax_batchnorm.forward(
                model, _compute(model), trainable, ntv, mv, x, y, sample_weight
            )
        finally:
            if shares is not None:
                shares.__exit__(None, None, None)
        d = ops.convert_to_tensor(1.0)
        if shares is not None:
            d, found["mean"], by_rows = shares.share()
            check_extra_terms(model, found["mean"], by_rows)
        factor = d if scale is None else scale
        losses = tasks + ([] if regularization is None else [regularization])
        if accumulating or scale is not None:
            losses = [loss * ops.cast(factor, loss.dtype) for loss in losses]
        return tuple(losses), (aux, d)

    closed, shapes = jax.make_jaxpr(program, return_shape=True)(list(tv))
    num_tasks = len(task_names(model))
    reaching = _reaching_tasks(closed, num_tasks, len(tv))
    run = jax_core.jaxpr_as_fun(closed)
    structure = jax.tree_util.tree_structure(shapes)

    def traced(*trainable):
        return jax.tree_util.tree_unflatten(structure, run(*trainable))

    losses, pullback, (aux, d) = jax.vjp(traced, *tv, has_aux=True)
    unscale = d / ops.cast(scale, "float32") if scale is not None else None
    per_loss = []
    for i in range(len(losses)):  # one backward pass per task (and regularisation)
        cotangent = tuple(
            ops.ones_like(v) if j == i else ops.zeros_like(v) for j, v in enumerate(losses)
        )
        grads = [ops.cast(g, "float32") for g in pullback(cotangent)]
        per_loss.append(grads if unscale is None else [g * unscale for g in grads])
    per_task, regularization = per_loss[:num_tasks], per_loss[num_tasks:]
    merged, gram, updates = _merge(
        model, per_task, reaching, d if accumulating else None, ntv, all_finite(list(losses))
    )
    if regularization:
        merged = [m + r for m, r in zip(merged, regularization[0])]
    unscaled_loss, y_pred, new_ntv, new_mv = aux
    new_ntv = list(new_ntv)
    for i, value in updates.items():
        new_ntv[i] = value
    aux = (unscaled_loss, y_pred, new_ntv, new_mv, _logs(model, gram))
    return merged, d, found["mean"], aux


def _compute(model):
    """Keras' `compute_loss_and_updates` (JAX trainer) with the task losses
    and the regularisation apart: `(tasks, regularization), (unscaled_loss,
    y_pred, non_trainable, metrics)` on the state's values."""

    def compute(trainable, ntv, mv, x, y, sample_weight):
        kwargs = {"training": True} if compat.call_has_training_arg(model) else {}
        y_pred, new_ntv, losses = model.stateless_call(
            trainable, ntv, x, return_losses=True, **kwargs
        )
        mapping = [
            *zip(model.trainable_variables, trainable),
            *zip(model.non_trainable_variables, new_ntv),
            *zip(model.metrics_variables, mv),
        ]
        with keras.StatelessScope(state_mapping=mapping) as scope:
            tasks = task_losses(model, y, y_pred, sample_weight)  # the `<name>_loss` metrics
            extra = [compat.additional_loss(model, loss) for loss in losses]
        new_mv = [_current(scope, v) for v in model.metrics_variables]
        regularization = None
        if extra:
            regularization = extra[0] if len(extra) == 1 else ops.sum(ops.stack(extra))
        unscaled = ops.sum(ops.stack(tasks + extra))
        return (tasks, regularization), (unscaled, y_pred, new_ntv, new_mv)

    return compute


def _reaching_tasks(closed, num_tasks, num_trainable):
    """Per trainable variable, the tuple of tasks whose loss reaches it
    (read from the traced program; its first inputs are the trainable
    values, its first outputs the task losses)."""
    reached = jax_reaching.reaching_inputs(closed, num_tasks)
    return [tuple(t for t in range(num_tasks) if k in reached[t]) for k in range(num_trainable)]


def _merge(model, per_task, reaching, share, ntv, losses_finite):
    """The merged task gradient (zeros where no task reaches a variable),
    the Gram matrix of the true gradients, and `{ntv position: value}` of
    the aggregator's variables after the step."""
    aggregator = model.fastgrad_step_state.merger.aggregator
    own, groups = maths.split_by_reaching_tasks(reaching)
    gram, stacked = maths.gram(per_task, groups, len(per_task))
    if share is not None:  # the true gradients' (the merge keeps D_j)
        gram = gram / ops.square(ops.cast(share, "float32"))
    where = {id(v): i for i, v in enumerate(model.non_trainable_variables)}
    variables = multitask_variables(model)
    mapping = [(v, ntv[where[id(v)]]) for v in variables]
    with keras.StatelessScope(state_mapping=mapping) as scope:
        weights, new_state = aggregator.weights_and_state(gram)
    weights = ops.cast(weights, "float32")
    by_index = maths.merge(per_task, own, groups, stacked, weights)
    merged = [by_index.get(k, ops.zeros_like(g)) for k, g in enumerate(per_task[0])]
    updates = {where[id(v)]: _current(scope, v) for v in variables}  # seeds: every step
    if new_state:  # moved only where the merge is finite (as on TensorFlow)
        keep = all_finite(merged) & losses_finite
        for variable, value in zip(aggregator.state_variables, new_state):
            i = where[id(variable)]
            updates[i] = ops.where(keep, ops.cast(value, ntv[i].dtype), ntv[i])
    return merged, gram, updates


def _logs(model, gram):
    """The task telemetry keys (TensorFlow's `TaskMerger.logs`), while any
    telemetry key is requested."""
    if not model.fastgrad_step_state.log_keys:
        return {}
    names = task_names(model)
    info = gram_telemetry(gram)
    logs = {f"{NORM_PREFIX}{name}": info["norms"][i] for i, name in enumerate(names)}
    for i in range(len(names)):
        for j in range(i + 1, len(names)):
            logs[f"{COSINE_PREFIX}{names[i]}/{names[j]}"] = info["cosine"][i, j]
    logs[CONFLICTS] = ops.cast(info["num_conflicts"], "float32")
    return {k: ops.cast(v, "float32") for k, v in logs.items()}


def _current(scope, variable):
    value = scope.get_current_value(variable)
    return variable.value if value is None else value
