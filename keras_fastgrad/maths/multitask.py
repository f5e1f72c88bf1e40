"""The multi-task merge's maths, in `keras.ops` (backend-neutral).

`T` task gradients, each a list over the model's variables; variable `k` is
reached by the tasks `reaching[k]` (a trace-time fact). A variable one task
reaches keeps that task's plain gradient; the variables several tasks reach
(the *shared* ones) are grouped by their reaching tasks, and

- `gram`: the `T x T` Gram matrix `G = J J^T` of the task gradients over the
  shared variables, summed one variable at a time (no flat vector: each
  variable's `[S, P_k]` stack of its `S` reaching tasks' rows is kept for
  the merge);
- `merge`: a shared variable's merged gradient `sum_t w_t g_t` over its
  reaching tasks, for the aggregator's weights `w`.

The merge's rules, on these equations, are `keras_fastgrad.step.multitask`
(both backends' steps).
"""

from keras import ops


def split_by_reaching_tasks(reaching):
    """The variables by the tasks that reach them.

    Args:
        reaching: List over the variables of the tuple of task indices
            that reach each (increasing; `()` for none).

    Returns:
        `(own, groups)`: `own` `{variable index: task}` for the variables
        one task reaches, `groups` `{tuple of tasks: [variable indices]}`
        for those two or more reach (the shared ones).

    Example:

    >>> split_by_reaching_tasks([(0, 1), (0,), (), (0, 1), (1,)])
    ({1: 0, 4: 1}, {(0, 1): [0, 3]})
    """
    own, groups = {}, {}
    for k, tasks in enumerate(reaching):
        if len(tasks) == 1:
            own[k] = tasks[0]
        elif len(tasks) > 1:
            groups.setdefault(tuple(tasks), []).append(k)
    return own, groups


def rows_gram(rows):
    """`rows rows^T` of an `[S, P]` stack (the default `gram` takes)."""
    return ops.matmul(rows, ops.transpose(rows))


def gram(per_task, groups, num_tasks, rows_gram=rows_gram):
    """The Gram matrix of the task gradients over the shared variables.

    Args:
        per_task: `T` lists of float32 gradients (aligned with the
            variables).
        groups: `split_by_reaching_tasks`' groups.
        num_tasks: int, `T`.
        rows_gram: `rows_gram(rows) -> rows rows^T` for an `[S, P]`
            stack; a backend may pass its own (TensorFlow: one `MatMul`
            reading the stack twice, no transposed copy).

    Returns:
        `(gram, stacked)`: the float32 `[T, T]` Gram matrix and
        `{variable index: [S, P_k] stack}` of the shared variables (for
        `merge`).

    Example:

    >>> g_a = [ops.convert_to_tensor([3.0, 0.0]), ops.convert_to_tensor([1.0])]
    >>> g_b = [ops.convert_to_tensor([1.0, -1.0]), ops.convert_to_tensor([0.0])]
    >>> g, _ = gram([g_a, g_b], {(0, 1): [0]}, 2)  # variable 1: task a's own
    >>> ops.convert_to_numpy(g).tolist()
    [[9.0, 3.0], [3.0, 2.0]]
    """
    stacked, total = {}, None
    for reaching, indices in groups.items():
        partial = None
        for k in indices:
            rows = ops.stack([per_task[t][k] for t in reaching])
            stacked[k] = ops.reshape(rows, (len(reaching), -1))
            block = rows_gram(stacked[k])
            partial = block if partial is None else partial + block
        if reaching != tuple(range(num_tasks)):  # the [S, S] block placed in [T, T]
            select = ops.one_hot(ops.convert_to_tensor(reaching, "int32"), num_tasks)  # [S, T]
            partial = ops.matmul(ops.transpose(select), ops.matmul(partial, select))
        total = partial if total is None else total + partial
    if total is None:  # no shared variable
        total = ops.zeros((num_tasks, num_tasks), "float32")
    return total, stacked


def merge(per_task, own, groups, stacked, weights):
    """The merged gradient of every variable a task reaches.

    Args:
        per_task: `T` lists of float32 gradients.
        own: `split_by_reaching_tasks`' `own`.
        groups: Its `groups`.
        stacked: `gram`'s stacks.
        weights: float32 `[T]` task weights.

    Returns:
        `{variable index: gradient}`: a shared variable's
        `sum_t w_t g_t` over its reaching tasks, an own variable's task
        gradient (a variable no task reaches is absent).

    Example:

    >>> g_a = [ops.convert_to_tensor([3.0, 0.0]), ops.convert_to_tensor([1.0])]
    >>> g_b = [ops.convert_to_tensor([1.0, -1.0]), ops.convert_to_tensor([0.0])]
    >>> own, groups = {1: 0}, {(0, 1): [0]}
    >>> _, stacked = gram([g_a, g_b], groups, 2)
    >>> merged = merge([g_a, g_b], own, groups, stacked, ops.convert_to_tensor([1.0, 2.0]))
    >>> ops.convert_to_numpy(merged[0]).tolist(), ops.convert_to_numpy(merged[1]).tolist()
    ([5.0, -2.0], [1.0])
    """
    merged = {k: per_task[t][k] for k, t in own.items()}
    for reaching, indices in groups.items():
        w = weights
        if reaching != tuple(range(len(per_task))):
            w = ops.take(weights, ops.convert_to_tensor(reaching, "int32"))
        w = ops.reshape(w, (1, -1))
        for k in indices:
            row = ops.matmul(w, stacked[k])  # [1, P_k]
            merged[k] = ops.reshape(row, ops.shape(per_task[reaching[0]][k]))
    return merged
