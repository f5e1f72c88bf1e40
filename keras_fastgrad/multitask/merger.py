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
ordinary gradient list. The rules are written once for both backends
(`keras_fastgrad.step.multitask`); `TaskMerger` holds the aggregator and
the order of a merge, imports neither backend and calls its shell's
primitives (`MULTITASK`, see `TaskMerger`): on TensorFlow the tape's task
passes and the telemetry in variables
(`keras_fastgrad.backend.tensorflow.multitask`); the JAX step
(`keras_fastgrad.backend.jax.multitask`) merges with `jax.vjp`, not a tape,
and uses only the merger's aggregator. Telemetry comes from `G` for free:
per-task gradient norms, pairwise cosine similarities and the number of
conflicting pairs, over the shared variables, logged as `task_grad_norm/<task>`,
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

from keras_fastgrad import aggregators, backend
from keras_fastgrad.step import multitask as core


def _shell():
    """The backend's `TaskMerger` primitives: its shell's `MULTITASK`.

    Raises:
        NotImplementedError: the shell has none (JAX's: its step merges
            the tasks without a tape).
    """
    shell = backend.shell()
    if shell.MULTITASK is None:
        raise NotImplementedError(
            "`TaskMerger` takes its task gradients from a TensorFlow tape; the "
            f"{shell.NAME!r} backend's step merges the tasks itself: train a "
            "`FastGradModel(..., multitask=...)`."
        )
    return shell.MULTITASK


class TaskMerger:
    """Merges per-task gradients from one persistent tape with an aggregator.

    Args:
        aggregator: A `keras_fastgrad.aggregators.Aggregator` (or a name).

    The telemetry of the latest call lives in float32 variables, created on
    the first call for the task names it gets (they are measurements: not
    saved with the model; `logs` reads them).

    What is backend-specific comes from the shell Keras' backend picks
    (`keras_fastgrad.backend.shell().MULTITASK`), looked up on each call,
    an object with:

    - `task_gradients(tape, task_losses, regularization, variables,
      unscale)`: `(per_task, reg_grads)`, float32 lists aligned with
      `variables` (`None` where a loss does not reach);
    - `losses_finite(task_losses, regularization)`: boolean scalar;
    - `merge_tape_gradients(per_task, reg_grads, share, weigh, state,
      losses_finite)` and `merge_in_z(capture, tape, names, task_losses,
      regularization, variables, unscale, weigh, share, state,
      losses_finite)`: a `step.multitask.TaskMerge` (`core.merge`,
      `core.merge_features` on the backend's primitives; `weigh(gram)` is
      the aggregator's call, the telemetry recorded);
    - `capture(model, tape, merger)`: the context of the forward pass
      (see `capture`);
    - `build(aggregator, num_tasks)`: the aggregator built and a
      `step.multitask.TaskTelemetry` of variables, made outside any trace;
      `record(telemetry_variables, telemetry)`, `read(telemetry_variables)`;
    - `state_of(aggregator)`: its state's values; `assign(state_variables,
      state)`.

    TensorFlow's is `keras_fastgrad.backend.tensorflow.multitask`; JAX's
    is `None` (its step merges without a tape, reading only `aggregator`):
    there each of the above raises `NotImplementedError`.

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
        self._telemetry = None

    def build(self, task_names):
        """Creates the telemetry variables for these task names."""
        task_names = list(task_names)
        if self.task_names == task_names:
            return
        self._telemetry = _shell().build(self.aggregator, len(task_names))
        self.task_names = task_names

    def capture(self, model, tape):
        """The context the step's forward pass runs in, recording the
        shared representation `Z` in features space
        (`model.multitask_space`; a no-op in parameter space). Its
        `merge(tape, task_losses, ...)` is `__call__` in the space chosen.
        """
        return _shell().capture(model, tape, self)

    def __call__(
        self,
        tape,
        task_losses,
        regularization,
        variables,
        unscale=None,
        share=None,
        task_names=None,
        capture=None,
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
                window (`weighting.Share.actual`) by which the gradients
                exceed those of its mean loss. The Gram matrix is divided
                by its square before the aggregator and the telemetry see
                it; the merged gradient keeps the factor.
            task_names: Names for the log keys (`task_<i>` if `None`).
            capture: `None` (parameter space), or the capture of `Z`
                (`capture`'s, in features space) the forward pass ran in:
                the tasks are merged in `Z` space.

        Returns:
            `(grads, info)`: a list aligned with `variables` (float32,
            `None` where no loss reaches a variable) and a dict with
            `"gram"`, `"weights"`, `"norms"`, `"cosine"`, `"num_conflicts"`.

        Raises:
            ValueError: fewer than two task losses.
            NotImplementedError: on Keras' JAX backend (no tape; its step
                merges the tasks itself).

        Under a `tf.distribute` strategy with several replicas the shared
        task gradients are summed over the replicas before merging (one
        all-reduce), so every replica merges the global task gradients; the
        merged part is returned divided by the number of replicas, as the
        rest of the step sums the replicas' gradients again at the update.
        """
        core.check_num_tasks(len(task_losses))
        names = core.names_or_default(task_names, len(task_losses))
        self.build(names)
        shell = _shell()
        finite_losses = None
        if self.aggregator.state_variables:
            finite_losses = shell.losses_finite(task_losses, regularization)
        if capture is None:
            per_task, reg_grads = shell.task_gradients(
                tape, task_losses, regularization, variables, unscale
            )
            return self.merge(per_task, reg_grads, share, finite_losses)
        return self._merged(
            shell.merge_in_z,
            *(capture, tape, names, task_losses, regularization, variables, unscale),
            share=share,
            losses_finite=finite_losses,
        )

    def merge(self, per_task, reg_grads=None, share=None, losses_finite=None):
        """Merges `T` gradient lists (`None` = not reached), see `__call__`.

        A stateful aggregator's new state is assigned only when the merged
        gradients (and `losses_finite`, if given) are finite: a micro-batch
        the step drops leaves it unchanged.
        """
        self.build(self.task_names or core.names_or_default(None, len(per_task)))
        return self._merged(
            _shell().merge_tape_gradients, per_task, reg_grads, share, losses_finite=losses_finite
        )

    def _merged(self, merge, *args, **kwargs):
        """`merge(*args, weigh=, state=, **kwargs)` (a `core.TaskMerge`)
        with the aggregator's call (the telemetry recorded) and state; the
        state after the step assigned. Returns `(grads, info)` (see
        `__call__`)."""
        shell, telemetry = _shell(), []

        def weigh(gram):
            telemetry.append(core.task_telemetry(gram))
            shell.record(self._telemetry, telemetry[0])
            return self.aggregator.weights_and_state(gram)

        result = merge(*args, weigh=weigh, state=shell.state_of(self.aggregator), **kwargs)
        shell.assign(self.aggregator.state_variables, result.new_state)
        norms, cosine, conflicts = telemetry[0]
        info = {"norms": norms, "cosine": cosine, "num_conflicts": conflicts}
        return result.grads, {"gram": result.gram, "weights": result.weights, **info}

    def logs(self):
        """The latest telemetry as float32 scalars under fixed log keys."""
        if self.task_names is None:
            return {}
        return core.task_logs(self.task_names, _shell().read(self._telemetry))
