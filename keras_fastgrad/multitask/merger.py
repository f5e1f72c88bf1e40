"""Multi-task gradient merging inside the train step.

A model compiled with one loss per output is a multi-task model: each
compiled output loss, times its loss weight, is one task. Summing the task
gradients (what `keras.Model` does) lets one task's gradient cancel
another's. With `FastGradModel(..., multitask=...)` the step instead

1. computes the `T` task gradients from one persistent tape (`T` backward
   passes; measured faster than `tape.jacobian` on CPU, see
   `benchmarks/bench_multitask.py`) and unscales each (loss scaling),
2. splits the variables at trace time: *shared* ones are reached by two or
   more tasks (their task gradient is not `None`), a task's *own* (head)
   variables by that task only,
3. forms the `T x T` Gram matrix `G = J J^T` of the task gradients over the
   shared variables, per variable, without building the flat vector,
4. asks the aggregator (`keras_fastgrad.aggregators`) for task weights `w`
   and merges the shared gradient as `sum_t w_t g_t`; an own variable gets
   its task's plain gradient,
5. adds the gradient of the regularisation losses (`model.losses`, not a
   task) to the merged one.

The rest of the chain (finite check, accumulation, clipping, apply) sees one
ordinary gradient list. Telemetry comes from `G` for free: per-task gradient
norms, pairwise cosine similarities and the number of conflicting pairs,
over the shared variables, logged as `task_grad_norm/<task>`,
`task_cosine/<task_a>/<task_b>` and `task_conflicts` (`<task>` is the
output's name, as in Keras' `<output>_loss` metrics).

Example:

>>> inputs = keras.Input((4,))
>>> trunk = keras.layers.Dense(8, activation="tanh")(inputs)
>>> outputs = {"digit": keras.layers.Dense(3)(trunk),
...            "parity": keras.layers.Dense(1)(trunk)}
>>> model = keras_fastgrad.FastGradModel(inputs, outputs, multitask="pcgrad",
...                                      telemetry=True)
>>> model.compile(
...     optimizer="sgd",
...     loss={"digit": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
...           "parity": keras.losses.BinaryCrossentropy(from_logits=True)},
...     loss_weights={"digit": 1.0, "parity": 0.5})
>>> x = np.random.default_rng(0).normal(size=(16, 4)).astype("float32")
>>> y = {"digit": np.arange(16) % 3, "parity": (np.arange(16) % 2)[:, None]}
>>> history = model.fit(x, y, batch_size=8, epochs=1, verbose=0)
>>> sorted(k for k in history.history if k.startswith("task_"))
['task_conflicts', 'task_cosine/digit/parity', 'task_grad_norm/digit', 'task_grad_norm/parity']

References:
    Yu et al., "Gradient Surgery for Multi-Task Learning", NeurIPS 2020,
    https://arxiv.org/abs/2001.06782
"""

from keras_fastgrad import aggregators
from keras_fastgrad._tf_startup import tf
from keras_fastgrad.multitask import feature_space
from keras_fastgrad.step import finite
from keras_fastgrad.step.gradients import to_float32_list
from keras_fastgrad.step.replicas import num_replicas, replica_sum
from keras_fastgrad.step.telemetry import CONFLICTS, COSINE_PREFIX, NORM_PREFIX
from keras_fastgrad.step.variables import global_variable


# ------------------------------------------------------------------ merge
class TaskMerger:
    """Merges per-task gradients from one persistent tape with an aggregator.

    Args:
        aggregator: A `keras_fastgrad.aggregators.Aggregator` (or a name).

    The telemetry of the latest call lives in float32 variables, created on
    the first call for the task names it gets (they are measurements: not
    saved with the model; `logs` reads them).

    Example:

    >>> shared = keras.Variable([2.0, 1.0])
    >>> head = keras.Variable(1.0)
    >>> merger = TaskMerger("pcgrad")
    >>> with tf.GradientTape(persistent=True) as tape:
    ...     loss_a = tf.reduce_sum(shared * [-10.0, 0.0])  # g_a = (-10, 0)
    ...     loss_b = tf.reduce_sum(shared * [1.0, -1.0]) * head  # g_b = (1, -1)
    >>> grads, info = merger(tape, [loss_a, loss_b], None, [shared, head],
    ...                      task_names=["a", "b"])
    >>> grads[0].numpy().round(4).tolist()  # PCGrad: 1.1 g_a + 6 g_b
    [-5.0, -6.0]
    >>> float(grads[1])  # task b's own (head) variable: its plain gradient
    1.0
    >>> logs = merger.logs()
    >>> float(logs["task_grad_norm/a"]), int(logs["task_conflicts"])
    (10.0, 1)
    """

    def __init__(self, aggregator):
        self.aggregator = aggregators.get(aggregator)
        self.task_names = None
        self._norms = self._cosine = self._conflicts = None

    def build(self, task_names):
        """Creates the telemetry variables for these task names."""
        task_names = list(task_names)
        if self.task_names == task_names:
            return
        num_tasks = len(task_names)
        with tf.init_scope():  # may be called while tracing the step
            self._norms = global_variable(tf.zeros([num_tasks]), "task_grad_norms")
            self._cosine = global_variable(tf.zeros([num_tasks] * 2), "task_cosine")
            self._conflicts = global_variable(tf.zeros([]), "task_conflicts")
            # A stateful aggregator's state (saved with the model: it is
            # the model's `multitask` attribute).
            self.aggregator.build(num_tasks)
        self.task_names = task_names

    def capture(self, model, tape):
        """The context the step's forward pass runs in, recording the
        shared representation `Z` in features space
        (`model.multitask_space`; a no-op in parameter space). Its
        `merge(tape, task_losses, ...)` is `__call__` in the space chosen.
        """
        return feature_space.capture(model, tape, self)

    def __call__(
        self,
        tape,
        task_losses,
        regularization,
        variables,
        unscale=None,
        share=None,
        task_names=None,
    ):
        """Merged float32 gradients for `variables` and the Gram telemetry.

        Args:
            tape: A persistent `tf.GradientTape` that recorded the losses.
            task_losses: List of `T >= 2` scalar losses as differentiated
                (already multiplied by the loss scale / sample count).
            regularization: Scalar loss (scaled the same way) or `None`.
            variables: The Keras variables to differentiate.
            unscale: Callable mapping a gradient list to the gradients of
                the unscaled losses (identity if `None`); applied to every
                task gradient before merging.
            share: Optional float32 scalar, the micro-batch's share of its
                window (`weighting.Share.actual`: its loss's normaliser,
                where micro-batches are combined) by which the gradients
                exceed those of its mean loss. The Gram matrix is divided
                by its square before the aggregator and the telemetry see
                it; the merged gradient keeps the factor (the aggregators
                are homogeneous).
            task_names: Names for the log keys (`task_<i>` if `None`).

        Returns:
            `(grads, info)`: a list aligned with `variables` (float32,
            `None` where no loss reaches a variable) and a dict with
            `"gram"`, `"weights"`, `"norms"`, `"cosine"`, `"num_conflicts"`.

        Under a `tf.distribute` strategy with several replicas the shared
        task gradients are summed over the replicas before merging (one
        all-reduce), so every replica merges the global task gradients; the
        merged part is returned divided by the number of replicas, as the
        rest of the step sums the replicas' gradients again at the update.
        """
        num_tasks = len(task_losses)
        if num_tasks < 2:
            raise ValueError(f"`task_losses` must hold at least two losses. Received: {num_tasks}.")
        self.build(task_names or [f"task_{i}" for i in range(num_tasks)])
        sources = [v.value for v in variables]
        unscale = unscale or (lambda grads: grads)
        per_task = [to_float32_list(unscale(tape.gradient(loss, sources))) for loss in task_losses]
        reg_grads = None
        if regularization is not None:
            reg_grads = to_float32_list(unscale(tape.gradient(regularization, sources)))
        losses_finite = None
        if self.aggregator.state_variables:
            losses = task_losses + [r for r in [regularization] if r is not None]
            losses_finite = finite.all_finite(losses)
        return self.merge(per_task, reg_grads, share, losses_finite)

    def merge(self, per_task, reg_grads=None, share=None, losses_finite=None):
        """Merges `T` gradient lists (`None` = not reached), see `__call__`.

        A stateful aggregator's new state is assigned only when the merged
        gradients (and `losses_finite`, if given) are finite: a micro-batch
        the step drops as non-finite leaves it unchanged.
        """
        num_tasks = len(per_task)
        self.build(self.task_names or [f"task_{i}" for i in range(num_tasks)])
        merged, groups = _split_by_reaching_tasks(per_task)
        replicas = num_replicas()
        if replicas > 1:  # merge the global task gradients (one all-reduce)
            per_task, share = _global_task_gradients(per_task, groups, share)
        gram, stacked = _gram(per_task, groups, num_tasks)
        if share is not None:
            gram = gram / tf.square(tf.cast(share, tf.float32))
        weights, info, new_state = self.weigh(gram)
        # Each replica's share of the global merged gradient (see __call__).
        shares = weights / replicas if replicas > 1 else weights
        for reaching, indices in groups.items():
            w = tf.gather(shares, reaching)
            for k in indices:
                flat = tf.linalg.matvec(stacked[k], w, transpose_a=True)
                merged[k] = tf.reshape(flat, tf.shape(per_task[reaching[0]][k]))
        if reg_grads is not None:
            merged = [
                r if m is None else (m if r is None else m + r) for m, r in zip(merged, reg_grads)
            ]
        self.commit_state(new_state, merged, losses_finite)
        return merged, {"gram": gram, "weights": weights, **info}

    def weigh(self, gram):
        """The aggregator's float32 task weights for `gram` (`[T, T]`, of
        the true gradients); records the telemetry. Returns `(weights,
        info, new_state)`: `info` as `aggregators.gram_telemetry`,
        `new_state` a stateful aggregator's next state (for `commit_state`;
        empty otherwise). Also used by the features-space merge
        (`keras_fastgrad.multitask.feature_space`)."""
        weights, new_state = self.aggregator.weights_and_state(gram)
        weights = tf.cast(weights, tf.float32)
        info = aggregators.gram_telemetry(gram)
        self._norms.assign(info["norms"])
        self._cosine.assign(info["cosine"])
        self._conflicts.assign(tf.cast(info["num_conflicts"], tf.float32))
        return weights, info, new_state

    def commit_state(self, new_state, merged, losses_finite=None):
        """Assigns a stateful aggregator's `new_state`, only when the
        merged gradients (and `losses_finite`, if given) are finite: a
        micro-batch the step drops leaves the state unchanged."""
        if not new_state:
            return
        keep = finite.all_finite(merged)
        if losses_finite is not None:
            keep = keep & losses_finite
        for variable, value in zip(self.aggregator.state_variables, new_state):
            variable.assign(tf.where(keep, value, variable.value))

    def logs(self):
        """The latest telemetry as float32 scalars under fixed log keys."""
        if self.task_names is None:
            return {}
        names = self.task_names
        logs = {f"{NORM_PREFIX}{name}": self._norms[i] for i, name in enumerate(names)}
        for i in range(len(names)):
            for j in range(i + 1, len(names)):
                logs[f"{COSINE_PREFIX}{names[i]}/{names[j]}"] = self._cosine[i, j]
        logs[CONFLICTS] = tf.identity(self._conflicts.value)
        return logs


def _split_by_reaching_tasks(per_task):
    """Trace-time split of the variables by the tasks that reach them:
    `(merged, groups)`, `merged[k]` the gradient of a variable one task
    reaches (else `None`), `groups` `{tuple of tasks: [variable indices]}`
    for the variables several tasks reach (the shared ones)."""
    num_tasks, num_vars = len(per_task), len(per_task[0])
    merged, groups = [None] * num_vars, {}
    for k in range(num_vars):
        reaching = tuple(t for t in range(num_tasks) if per_task[t][k] is not None)
        if len(reaching) == 1:
            merged[k] = per_task[reaching[0]][k]
        elif len(reaching) > 1:
            groups.setdefault(reaching, []).append(k)
    return merged, groups


def _global_task_gradients(per_task, groups, share):
    """The shared task gradients and `share` summed over the replicas (one
    all-reduce). Returns `(per_task, share)`."""
    shared = [(t, k) for r, ks in groups.items() for k in ks for t in r]
    summed = replica_sum([per_task[t][k] for t, k in shared] + [share])
    per_task = [list(row) for row in per_task]
    for (t, k), g in zip(shared, summed):
        per_task[t][k] = g
    return per_task, summed[-1]


def _gram(per_task, groups, num_tasks):
    """The Gram matrix over the shared variables, one variable at a time:
    the `[S, P_k]` stack of each is kept for the merge (no flat vector).
    Returns `(gram, stacked)`."""
    stacked = {}
    gram = tf.zeros([num_tasks, num_tasks], tf.float32)
    for reaching, indices in groups.items():
        partial = 0.0
        for k in indices:
            rows = tf.stack([per_task[t][k] for t in reaching])
            stacked[k] = tf.reshape(rows, [len(reaching), -1])
            partial += tf.matmul(stacked[k], stacked[k], transpose_b=True)
        select = tf.one_hot(reaching, num_tasks, dtype=tf.float32)  # [S, T]
        gram += tf.matmul(select, tf.matmul(partial, select), transpose_a=True)
    return gram, stacked
