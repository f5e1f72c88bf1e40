"""The multi-task merge's rules, written once for both backends.

A multi-task step hands this module `T` task gradients (each a list over
the trainable variables, already unscaled and float32) and which tasks
reach each variable (a trace-time fact: the tape's `None` on TensorFlow,
the traced program on JAX). The rules:

- a variable one task reaches keeps that task's plain gradient; a variable
  no task reaches gets none (`None`); the variables two or more tasks
  reach (the *shared* ones) are merged;
- over the shared variables: the Gram matrix `G = J J^T`
  (`maths.multitask.gram`), divided by `share^2` where the gradients carry
  the micro-batch's share of its window (the aggregator and the telemetry
  see the true gradients' Gram); under several replicas the shared task
  gradients and the share are summed over the replicas first (one sum of
  the shell's), and each replica returns its share of the merged gradient
  (the weights divided by the replicas);
- the aggregator's weights `w` (float32) and next state; a shared
  variable's merged gradient is `sum_t w_t g_t` over its reaching tasks;
- the regularisation's gradient (`model.losses`: not a task) is added
  after merging;
- a non-finite task gradient is merged as it is (its Gram entries, the
  weights and the merged shared gradient turn non-finite, and the step's
  finite check drops the micro-batch); a stateful aggregator's next state
  is kept only where the merged gradient and the losses are finite
  (`next_state`): a micro-batch the step drops leaves it unchanged;
- the task telemetry comes from `G`: `task_grad_norm/<task>`,
  `task_cosine/<a>/<b>` (`a` before `b`) and `task_conflicts`
  (`task_logs`), logged while any telemetry key is requested
  (`logged_task_keys`).

The merge in representation space (`multitask_space="features"`) is here
too (`merge_features`: `features_gram`, the aggregator, the trunk's
cotangents `features_cotangents`, the state kept as above); the shell
passes its trunk pass in.

The shells say how the gradients are taken and where the state lives:
`keras_fastgrad.multitask.TaskMerger` with
`keras_fastgrad.backend.tensorflow.multitask` (a persistent tape,
variables, `tf.distribute`), `keras_fastgrad.backend.jax.multitask`
(`jax.vjp`, Keras' state tuple).
"""

from typing import Any, NamedTuple

from keras import ops

from keras_fastgrad.aggregators import gram_telemetry
from keras_fastgrad.maths import finite
from keras_fastgrad.maths import multitask as maths
from keras_fastgrad.step.telemetry import CONFLICTS, COSINE_PREFIX, NORM_PREFIX


class TaskMerge(NamedTuple):
    """What one merge produced.

    Fields:
        grads: The merged float32 gradients, aligned with the variables
            (`None` where neither a task nor the regularisation reaches).
        gram: float32 `[T, T]`, the true gradients' Gram matrix.
        weights: float32 `[T]`, the aggregator's task weights.
        new_state: A stateful aggregator's state after the step (aligned
            with its `state_variables`; empty otherwise): its next state
            where `keep_state` keeps it, else the `state` given.
    """

    grads: list
    gram: Any
    weights: Any
    new_state: tuple


class TaskTelemetry(NamedTuple):
    """The task telemetry of one Gram matrix (float32).

    Fields:
        norms: `[T]`, each task gradient's norm over the shared variables.
        cosine: `[T, T]`, the pairwise cosine similarities.
        conflicts: Scalar, the number of pairs with a negative inner
            product.
    """

    norms: Any
    cosine: Any
    conflicts: Any


def check_num_tasks(num_tasks):
    """Refuses fewer than two task losses (nothing to merge)."""
    if num_tasks < 2:
        raise ValueError(
            "`task_losses` must hold at least two losses. "
            f"Received: {num_tasks} loss(es). Fix: compile one loss per output."
        )


def names_or_default(task_names, num_tasks):
    """The task names for the log keys: `task_names`, else `task_<i>`.

    >>> names_or_default(None, 2)
    ['task_0', 'task_1']
    """
    if task_names:
        return list(task_names)
    return [f"task_{i}" for i in range(num_tasks)]


def reaching_of(per_task):
    """Per variable, the tuple of tasks whose gradient is not `None`.

    Args:
        per_task: `T` gradient lists, `None` where the task's loss does not
            reach the variable.

    Returns:
        A list over the variables of increasing task tuples.

    Example:

    >>> reaching_of([[1.0, None, 2.0], [3.0, None, None]])
    [(0, 1), (), (0,)]
    """
    return [
        tuple(t for t, row in enumerate(per_task) if row[k] is not None)
        for k in range(len(per_task[0]))
    ]


def merge(
    per_task,
    reaching,
    weigh,
    regularization=None,
    share=None,
    replicas=1,
    replica_sum=None,
    rows_gram=maths.rows_gram,
    state=(),
    losses_finite=None,
    stored=None,
):
    """Merges `T` task gradients (the rules of the module docstring).

    Args:
        per_task: `T >= 2` lists of float32 gradients aligned with the
            variables (a gradient of a task not reaching it may be `None`
            or zeros: `reaching` decides).
        reaching: `reaching_of`'s list: per variable, the tasks reaching it.
        weigh: `weigh(gram) -> (weights, new_state)`, the aggregator's call
            (the shell threads its state).
        regularization: `None`, or the regularisation's gradients (`None`
            entries allowed), added after merging.
        share: `None`, or the float32 scalar the gradients carry (the
            micro-batch's share of its window): the Gram is divided by its
            square; the merged gradient keeps it (the aggregators are
            homogeneous).
        replicas: int, the replicas in sync (each returns its share).
        replica_sum: With several replicas, the shell's
            `replica_sum(list) -> list` (one all-reduce).
        rows_gram: The backend's `rows rows^T` (`maths.multitask.gram`).
        state: A stateful aggregator's state before the step (the values
            of its `state_variables`; empty otherwise).
        losses_finite: `None`, or a boolean scalar: whether the losses
            are finite (`next_state`).
        stored: `None`, or the shell's `stored(gradient)`: the values a
            sparse gradient stores, which the finite check reads.

    Returns:
        A `TaskMerge`.

    Example:

    >>> g_a = [ops.convert_to_tensor([-10.0, 0.0]), None]
    >>> g_b = [ops.convert_to_tensor([1.0, -1.0]), ops.convert_to_tensor(1.0)]
    >>> result = merge([g_a, g_b], [(0, 1), (1,)], lambda gram: (ops.ones(2), ()))
    >>> ops.convert_to_numpy(result.gram).tolist()
    [[100.0, -10.0], [-10.0, 2.0]]
    >>> [ops.convert_to_numpy(g).tolist() for g in result.grads]
    [[-9.0, -1.0], 1.0]
    """
    num_tasks = len(per_task)
    check_num_tasks(num_tasks)
    own, groups = maths.split_by_reaching_tasks(reaching)
    if replicas > 1:  # merge the global task gradients (one all-reduce)
        per_task, share = _global(per_task, groups, share, replica_sum)
    gram, stacked = maths.gram(per_task, groups, num_tasks, rows_gram)
    if share is not None:
        gram = gram / ops.square(ops.cast(share, "float32"))
    weights, new_state = weigh(gram)
    weights = ops.cast(weights, "float32")
    shares = weights / replicas if replicas > 1 else weights  # each replica's part
    by_index = maths.merge(per_task, own, groups, stacked, shares)
    grads = [by_index.get(k) for k in range(len(reaching))]
    if regularization is not None:
        grads = [_add(m, r) for m, r in zip(grads, regularization)]
    return TaskMerge(
        grads, gram, weights, next_state(new_state, state, grads, losses_finite, stored)
    )


def _global(per_task, groups, share, replica_sum):
    """The shared task gradients and `share` summed over the replicas."""
    shared = [(t, k) for tasks, ks in groups.items() for k in ks for t in tasks]
    summed = replica_sum([per_task[t][k] for t, k in shared] + [share])
    per_task = [list(row) for row in per_task]
    for (t, k), g in zip(shared, summed):
        per_task[t][k] = g
    return per_task, summed[-1]


def _add(a, b):
    return b if a is None else (a if b is None else a + b)


def keep_state(merged, losses_finite=None):
    """Whether a stateful aggregator's next state is kept: the merged
    gradients (and the losses, where `losses_finite` is given) are finite.

    >>> bool(keep_state([ops.convert_to_tensor([1.0]), None],
    ...                 ops.convert_to_tensor(False)))
    False
    """
    keep = finite.all_finite(merged)
    if losses_finite is not None:
        keep = ops.logical_and(keep, losses_finite)
    return keep


def kept(keep, new_state, old_state):
    """The aggregator's state after the step: `new_state` where `keep`,
    else `old_state` (each in its old dtype)."""
    return [
        ops.where(keep, ops.cast(new, old.dtype), old) for new, old in zip(new_state, old_state)
    ]


def next_state(new_state, state, merged, losses_finite=None, stored=None):
    """A stateful aggregator's state after the step: `new_state` where
    `keep_state(merged, losses_finite)` (a micro-batch the step drops
    leaves `state` unchanged); `()` for a stateless one.

    Args:
        new_state: The aggregator's next state (`weights_and_state`'s).
        state: Its state before the step (aligned with `new_state`).
        merged: The merged gradients (`None` entries allowed).
        losses_finite: `None`, or a boolean scalar (the losses finite).
        stored: `None`, or the shell's `stored(gradient)` (a sparse
            gradient's values).

    Returns:
        A tuple aligned with `state`, each in its dtype.

    Example:

    >>> merged = [ops.convert_to_tensor([float("nan")])]
    >>> (kept_value,) = next_state([ops.ones(2)], [ops.zeros(2)], merged)
    >>> ops.convert_to_numpy(kept_value).tolist()
    [0.0, 0.0]
    """
    if not new_state:
        return ()
    if len(state) != len(new_state):
        raise ValueError(
            "`state` must hold the aggregator's state before the step, one value "
            f"per state variable. Received: {len(state)} value(s) for "
            f"{len(new_state)} state variable(s). Fix: pass the values of "
            "`aggregator.state_variables` as `state`."
        )
    if stored is not None:
        merged = [None if g is None else stored(g) for g in merged]
    return tuple(kept(keep_state(merged, losses_finite), new_state, state))


def task_telemetry(gram):
    """The `TaskTelemetry` of a `[T, T]` Gram matrix (float32).

    >>> t = task_telemetry(ops.convert_to_tensor([[4.0, -2.0], [-2.0, 1.0]]))
    >>> ops.convert_to_numpy(t.norms).tolist(), float(t.conflicts)
    ([2.0, 1.0], 1.0)
    """
    info = gram_telemetry(gram)
    return TaskTelemetry(
        ops.cast(info["norms"], "float32"),
        ops.cast(info["cosine"], "float32"),
        ops.cast(info["num_conflicts"], "float32"),
    )


def task_logs(task_names, telemetry):
    """The task telemetry's log keys and values.

    Args:
        task_names: The `T` task names (the outputs', as in Keras'
            `<output>_loss` metrics).
        telemetry: A `TaskTelemetry` (or its fields as variables).

    Returns:
        `{key: float32 scalar}`: `task_grad_norm/<task>` per task,
        `task_cosine/<a>/<b>` per pair (`a` before `b`),
        `task_conflicts`.

    Example:

    >>> logs = task_logs(["a", "b"], task_telemetry(ops.eye(2)))
    >>> list(logs)
    ['task_grad_norm/a', 'task_grad_norm/b', 'task_cosine/a/b', 'task_conflicts']
    """
    norms, cosine, conflicts = telemetry
    logs = {f"{NORM_PREFIX}{name}": norms[i] for i, name in enumerate(task_names)}
    for i in range(len(task_names)):
        for j in range(i + 1, len(task_names)):
            logs[f"{COSINE_PREFIX}{task_names[i]}/{task_names[j]}"] = cosine[i, j]
    logs[CONFLICTS] = conflicts
    return logs


def logged_task_keys(log_keys, task_logs_of):
    """The task keys a step logs: `task_logs_of()` (a callable returning
    `task_logs`' dict, called only then: nothing read or worked out
    otherwise) while any telemetry key is requested (`log_keys`, a set),
    `{}` otherwise.

    Example:

    >>> logged_task_keys(set(), lambda: 1 / 0)
    {}
    >>> list(logged_task_keys({"updates"}, lambda: task_logs(["a"], task_telemetry(ops.eye(1)))))
    ['task_grad_norm/a', 'task_conflicts']
    """
    return task_logs_of() if log_keys else {}


# ------------------------------------------------------ representation space
def features_gram(dz, factor=None, share=None, replica_sum=None, rows_gram=maths.rows_gram):
    """The Gram matrix of the task gradients with respect to `Z`.

    Args:
        dz: `T` lists (one entry per floating output of the shared layer)
            of each task's gradient with respect to `Z`, in the scaled
            domain.
        factor: `None`, or the float32 scalar that unscales them.
        share: `None`, or the share the gradients carry (as in `merge`):
            the Gram is divided by its square.
        replica_sum: With several replicas, the shell's
            `replica_sum(list) -> list`: the global batch's Gram (the
            replicas' rows of `Z` stacked) is the sum of theirs.
        rows_gram: The backend's `rows rows^T` (`maths.multitask.gram`).

    Returns:
        float32 `[T, T]`, `G[s, t] = <dZ_s, dZ_t>` summed over the batch.

    Example:

    >>> dz = [[ops.convert_to_tensor([[1.0, 2.0]])], [[ops.convert_to_tensor([[0.0, -1.0]])]]]
    >>> ops.convert_to_numpy(features_gram(dz, share=ops.convert_to_tensor(2.0))).tolist()
    [[1.25, -0.5], [-0.5, 0.25]]
    """
    flat = ops.stack(
        [ops.concatenate([ops.reshape(ops.cast(g, "float32"), (-1,)) for g in d_t]) for d_t in dz]
    )
    if factor is not None:
        flat = flat * factor
    gram = rows_gram(flat)
    if replica_sum is not None:
        gram, share = replica_sum([gram, share])
    if share is not None:
        gram = gram / ops.square(ops.cast(share, "float32"))
    return gram


def merge_features(
    dz,
    dz_extra,
    features,
    weigh,
    trunk,
    unscale=None,
    factor=None,
    share=None,
    replica_sum=None,
    rows_gram=maths.rows_gram,
    state=(),
    losses_finite=None,
    stored=None,
):
    """Merges the tasks in representation space: the Gram over `Z`, the
    aggregator's weights, ONE trunk pass with the merged cotangents, the
    aggregator's state kept as in `merge`.

    Args:
        dz: `T` lists of each task's gradient with respect to `Z`, as
            differentiated (the scaled domain).
        dz_extra: The regularisation's `dZ` list (`None` entries allowed).
        features: The `Z` tensors.
        weigh: `weigh(gram) -> (weights, new_state)`, as in `merge`.
        trunk: The shell's trunk pass: `trunk(cotangents)` -> the merged
            float32 gradients of the variables (the trunk's through `Z`,
            plus the plain gradients of the paths that skip `Z`), unscaled.
        unscale: `None`, or a callable mapping a `dZ` list to the float32
            gradients of the unscaled losses (before the Gram).
        factor: `None`, or the float32 scalar that unscales `dZ` (as
            `features_gram`'s).
        share: `None`, or the share the gradients carry (`features_gram`).
        replica_sum: `None`, or the shell's sum over several replicas.
        rows_gram: The backend's `rows rows^T`.
        state, losses_finite, stored: As `merge`'s (`next_state`).

    Returns:
        A `TaskMerge` (`gram`: the true gradients' over `Z`).

    Example:

    >>> dz = [[ops.convert_to_tensor([1.0, 0.0])], [ops.convert_to_tensor([0.0, 2.0])]]
    >>> result = merge_features(dz, [None], dz[0], lambda gram: (ops.ones(2), ()),
    ...                         lambda cotangents: cotangents)
    >>> ops.convert_to_numpy(result.grads[0]).tolist()
    [1.0, 2.0]
    """
    true_dz = dz if unscale is None else [unscale(d) for d in dz]
    gram = features_gram(true_dz, factor, share, replica_sum, rows_gram)
    weights, new_state = weigh(gram)
    weights = ops.cast(weights, "float32")
    grads = trunk(features_cotangents(weights, dz, dz_extra, features))
    return TaskMerge(
        grads, gram, weights, next_state(new_state, state, grads, losses_finite, stored)
    )


def features_cotangents(weights, dz, dz_extra, features):
    """The trunk's cotangents on `Z`: `sum_t w_t dZ_t`, plus the
    regularisation's `dZ` (e.g. an activity regulariser on `Z` itself),
    each in `Z`'s dtype (the scaled domain: float16 keeps its range).

    Args:
        weights: float32 `[T]`, the aggregator's weights.
        dz: `T` lists of `dZ_t` (as `features_gram`'s).
        dz_extra: The regularisation's `dZ` list (`None` entries allowed).
        features: The `Z` tensors (their dtypes).

    Returns:
        A list aligned with `features`.

    Example:

    >>> dz = [[ops.convert_to_tensor([1.0, 2.0])], [ops.convert_to_tensor([0.0, -1.0])]]
    >>> c = features_cotangents(ops.convert_to_tensor([1.0, 2.0]), dz, [None], dz[0])
    >>> ops.convert_to_numpy(c[0]).tolist()
    [1.0, 0.0]
    """
    weights = ops.cast(weights, "float32")
    cotangents = []
    for k, z in enumerate(features):
        c = weights[0] * ops.cast(dz[0][k], "float32")
        for t in range(1, len(dz)):
            c = c + weights[t] * ops.cast(dz[t][k], "float32")
        if dz_extra[k] is not None:
            c = c + ops.cast(dz_extra[k], "float32")
        cotangents.append(ops.cast(c, z.dtype))
    return cotangents
