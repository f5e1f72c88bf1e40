"""The accumulation window on TensorFlow: how the rules of
`keras_fastgrad.step.accumulation` are run on its variables.

What is TensorFlow's own: the window's sums written in a `tf.cond` on
whether the micro-batch is kept (not a multiplication by 0, NaN * 0 being
NaN, nor a `where`, an extra pass over every gradient); Keras' form of
accumulation when nothing is ever left out (one `cond` on whether the
micro-batch is the window's last: `add_or_apply`); sums added as a read, an
`AddV2` and an `Assign` (`variables.add_into`), emptied with
`variables.run_time_zeros`; sparse gradients (`tf.IndexedSlices`) added to
their rows only (without a strategy; under one the per-replica sums
support no `scatter_add`: added densely); the micro-step counted once the
micro-batch exists (`_count`).

Under a `tf.distribute` strategy each replica adds its own share to
sync-on-read sums: micro-steps do not all-reduce gradients; the update sums
the window once (`replica_sum`), and a checkpoint reads the total.
"""

from keras_fastgrad._tf_startup import tf
from keras_fastgrad.backend.tensorflow.applying import apply_if
from keras_fastgrad.backend.tensorflow.gradients import to_float32
from keras_fastgrad.backend.tensorflow.variables import add_into, increment, run_time_zeros
from keras_fastgrad.step import accumulation as rules


def add(acc, micro_batch, otherwise=None):
    """Adds one micro-batch to `acc`'s window; returns whether the window
    is now to be applied (`rules.closes`).

    Args:
        acc: The `WindowAccumulator` (built).
        micro_batch: `rules.MicroBatch`: its gradients already multiplied
            by this replica's `D_j` (dense or `tf.IndexedSlices`; `None`
            where a variable has none), its `D_j` summed over all
            replicas, `keep` the same on every replica (the Python `True`:
            added without a `cond`).
        otherwise: Optional callable run (no arguments) in the `cond`
            branch of a left-out micro-batch: bookkeeping for free. Without
            a strategy only: under one (one replica too), state written
            there would need a `merge_call` inside the `cond`.

    Returns:
        Boolean scalar.

    Example:

    >>> acc = rules.WindowAccumulator(steps=2)
    >>> acc.build([keras.Variable([0.0, 0.0])])
    >>> _ = add(acc, rules.MicroBatch([tf.constant([4.0, 4.0])], 4.0, tf.constant(True)))
    >>> done = add(acc, rules.MicroBatch([tf.constant([8.0, 8.0])], 2.0, tf.constant(True)))
    >>> total = window_gradient(acc)[0]  # (4*1 + 2*4) / 6
    >>> bool(done), total.numpy().tolist()
    (True, [2.0, 2.0])
    """
    weighted_grads, normaliser, include, acc.mean_reduction = micro_batch
    sparse_ok = not tf.distribute.has_strategy()  # sums are plain variables

    def add_sums():
        _add_to_sums(acc, weighted_grads, sparse_ok)

    # Mirrored state is written outside the `cond`: under a strategy that
    # write is a `merge_call`.
    def leave_out():
        if otherwise is not None:
            otherwise()

    if include is True:
        _add_included(acc, weighted_grads, normaliser, sparse_ok)
    else:
        tf.cond(include, add_sums, leave_out)
        increment(acc.normaliser, rules.kept(include, normaliser, tf.where))
        increment(acc.included, rules.counted(include, _as_count))
    _count(acc, weighted_grads, normaliser, include)
    # (every micro-batch kept: its last one is in the window, no read)
    return rules.closes(acc.state(), acc.steps, every_kept=include is True)[1]


def add_or_apply(acc, micro_batch, apply):
    """Adds one micro-batch that is never left out, in the form of Keras'
    `gradient_accumulation_steps`: one `cond` on whether it is the window's
    last (`rules.is_last`). If it is, `apply(window_gradient)` runs with
    this micro-batch added to the sums as they are read (the sums are not
    written with it) and the window empties; if not, it is added to the
    sums. The sums are then written only once the whole gradient exists
    (the `cond`'s inputs), not beside the backward pass, and the update
    writes none.

    Without a strategy, and dense gradients only (`add` otherwise: under a
    strategy the update leaves replica context before its `cond`,
    `applying.apply_if`; sparse sums are added to their rows).

    Args:
        acc: The `WindowAccumulator` (built).
        micro_batch: As for `add` (dense gradients or `None`; its `keep`
            not read: `True`).
        apply: Callable taking the window's gradient (a list, `None` where
            a variable has no gradient): the update.

    Example:

    >>> acc = rules.WindowAccumulator(steps=2)
    >>> acc.build([keras.Variable([0.0])])
    >>> applied = []
    >>> add_or_apply(acc, rules.MicroBatch([tf.constant([4.0])], 4.0), applied.append)
    >>> add_or_apply(acc, rules.MicroBatch([tf.constant([8.0])], 2.0), applied.append)
    >>> applied[0][0].numpy().tolist(), float(acc.normaliser.numpy())  # (4 + 8) / 6
    ([2.0], 0.0)
    """
    weighted_grads, normaliser, _, mean_reduction = micro_batch
    acc.mean_reduction = mean_reduction
    last = rules.is_last(acc.micro_step, acc.steps)

    def apply_window():
        apply(window_gradient(acc, weighted_grads, micro_batch))
        reset(acc)

    def add_sums():
        _add_included(acc, weighted_grads, normaliser, sparse_ok=False)

    tf.cond(last, apply_window, add_sums)
    _count(acc, weighted_grads, normaliser, True)


def window_gradient(acc, grads_template=None, adding=None):
    """The window's gradient (`rules.window_gradient` of its sums).

    Args:
        acc: The `WindowAccumulator`.
        grads_template: As for `window_sums`.
        adding: Optional `rules.MicroBatch` (dense gradients) added to the
            sums and the normaliser as they are read, not written into
            them (`add_or_apply`).
    """
    sums = window_sums(acc, grads_template)
    normaliser = tf.convert_to_tensor(acc.normaliser) if acc.mean_reduction else None
    if adding is not None:
        sums = [s if g is None else s + to_float32(g) for s, g in zip(sums, adding.grads)]
        normaliser = None if normaliser is None else normaliser + adding.normaliser
    return rules.window_gradient(sums, normaliser, acc.mean_reduction, tf.math.divide_no_nan)


def window_sums(acc, grads_template=None):
    """`sum_j D_j g_j` over the window: in cross-replica context the
    sync-on-read sums are reduced over the replicas when read.

    Args:
        acc: The `WindowAccumulator`.
        grads_template: Optional list; where its entry is `None` the result
            is `None` too (variables that never get a gradient).
    """
    template = grads_template or acc.sums
    return [
        None if t is None else tf.convert_to_tensor(total.value)
        for total, t in zip(acc.sums, template)
    ]


def reset(acc):
    """Empties the window (`rules.emptied`: the micro-step count runs on)."""
    _assign(acc, rules.emptied(acc.state(), _zeros))


def flush(acc, apply_window):
    """Applies a partial window where it holds samples (`apply_window`, no
    arguments, in a `cond`), then restarts it (`rules.flushed`)."""
    _assign(acc, rules.flushed(acc.state(), lambda held: apply_if(held, apply_window), _zeros))


def _zeros(variable):
    """A variable's emptied value: a gradient-sized sum's made when the
    step runs (not a constant the graph would hold between steps)."""
    return run_time_zeros(variable.shape) if len(variable.shape) else 0


def _assign(acc, window):
    """Writes `window`'s values into `acc`'s variables (those it changed)."""
    for variable, value in zip(acc.variables, [*window.sums, *window[1:]]):
        if value is not None and value is not variable:
            variable.assign(value)


def _as_count(include):
    return tf.cast(include, tf.int64)


def _add_included(acc, weighted_grads, normaliser, sparse_ok):
    """Adds an included micro-batch: its sums, normaliser and count."""
    _add_to_sums(acc, weighted_grads, sparse_ok)
    increment(acc.normaliser, normaliser)
    increment(acc.included, tf.constant(rules.counted(True, _as_count), tf.int64))


def _add_to_sums(acc, weighted_grads, sparse_ok):
    """Adds the gradients to the sums (`sparse_ok`: an `IndexedSlices` to
    its rows only)."""
    for total, g in zip(acc.sums, weighted_grads):
        if g is None:
            continue
        if isinstance(g, tf.IndexedSlices) and sparse_ok:
            total.value.scatter_add(to_float32(g))  # touched rows only
        else:  # sync-on-read (replica) sums have no `scatter_add`
            add_into(total, tf.cast(tf.convert_to_tensor(g), tf.float32))


def _count(acc, weighted_grads, normaliser, include):
    """Counts the micro-step, once the micro-batch exists. On data of
    unknown size Keras' train function asks the iterator for one batch more
    than it has (`get_next` fails with `OutOfRange`, which ends the epoch);
    TensorFlow inlines the step into that function, and an increment that
    reads nothing of the batch would still run there: the window would
    count a micro-batch that never came."""
    with tf.control_dependencies(_of_the_batch(weighted_grads, normaliser, include)):
        increment(acc.micro_step, tf.constant(1, tf.int64))


def _of_the_batch(weighted_grads, normaliser, include):
    """Tensors computed from the micro-batch (its gradients, normaliser and
    verdict): what the window's count waits for."""
    tensors = [normaliser, include]
    for g in weighted_grads:
        if isinstance(g, tf.IndexedSlices):
            tensors.append(g.values)
        elif g is not None:
            tensors.append(g)
    return [t for t in tensors if isinstance(t, tf.Tensor)]
