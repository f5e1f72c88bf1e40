"""The few cross-replica operations the step needs, as no-ops without a
strategy.

The step keeps every decision global (the same on every replica) by summing
small vectors across replicas; gradients are summed only at an update.

Two questions, kept apart. Control flow asks `distributed()`: under any
strategy but the default one, one replica included (`MirroredStrategy()`
on one GPU or a CPU-only machine), an optimizer update or a write of
mirrored state inside a `cond` in replica context is a `merge_call`, which
TensorFlow refuses there. The arithmetic (dividing by the replicas, summing
over them) asks `num_replicas()`: a sum over one replica is the value
itself.
"""

from keras_fastgrad._compat import in_multi_worker_mode
from keras_fastgrad._tf_startup import tf


def num_replicas():
    """Number of replicas in sync of the current strategy (1 without one).

    For arithmetic only; whether the step may update inside a `cond` in
    replica context is `distributed()`, also true with one replica.
    """
    return tf.distribute.get_strategy().num_replicas_in_sync


def distributed():
    """Whether a strategy other than the default one is active, with any
    number of replicas: then updates and writes of mirrored state leave
    replica context through a `merge_call` before any `cond`."""
    return tf.distribute.has_strategy()


def replica_sum(values):
    """Sums a list of tensors (`None` entries kept) over the replicas.

    Identity on one replica; in replica context of a strategy with several
    replicas, one `all_reduce(SUM)` for the whole list.
    """
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return list(values)
    present = [v for v in values if v is not None]
    reduced = iter(context.all_reduce(tf.distribute.ReduceOp.SUM, present))
    return [None if v is None else next(reduced) for v in values]


def first_replica(distribution, value):
    """Replica 0's copy of `value` (a tensor, `None`, or a list/tuple of
    them), in cross-replica context: the values a `merge_call` passes on
    are per-replica."""
    if isinstance(value, (list, tuple)):
        return [first_replica(distribution, v) for v in value]
    if value is None:
        return None
    return distribution.experimental_local_results(value)[0]


def in_cross_replica_context(fn, *args):
    """Runs `fn(*args)` once in cross-replica context (for assigning state
    that is not mirrored per replica, like the loss scale). `args` must be
    identical on every replica; `fn` sees replica 0's copy."""
    context = tf.distribute.get_replica_context()
    if context is None or not distributed():
        return fn(*args)

    def merged(distribution, *args):
        return fn(*(first_replica(distribution, a) for a in args))

    return context.merge_call(merged, args=args)


def global_metric_results(metrics, local_results):
    """The metrics' results over all replicas, from replica context.

    In replica context a metric reads this replica's (sync-on-read) state,
    and Keras then averages the replicas' results: a mean of local means,
    wrong when replicas hold different numbers of samples. Summing the
    metric variables over replicas (one all-reduce) and computing each
    result from the sums gives the global value on every replica.

    Args:
        metrics: `model.metrics`.
        local_results: What `compute_metrics` returned (kept on one replica).
    """
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return local_results
    variables = [v for m in metrics for v in m.variables]
    # `tf.identity` reads the local value (a conversion of a sync-on-read
    # variable is not a local read under MultiWorkerMirroredStrategy).
    summed = iter(replica_sum([tf.identity(v.value) for v in variables]))
    results = {}
    for metric in metrics:
        values = []
        for v in metric.variables:
            total = next(summed)
            if v.aggregation == "mean":
                total = total / context.num_replicas_in_sync
            elif v.aggregation != "sum":
                total = v.value  # mirrored state: the same everywhere
            values.append(total)
        result = metric.stateless_result(values)
        if isinstance(result, dict):
            results.update(result)
        else:
            results[metric.name] = result
    return {**local_results, **results}


def for_keras_reduction(logs):
    """Shapes the step's (global, scalar) logs for Keras' reduction.

    Under multi-worker collectives Keras reduces every output with
    `strategy.reduce("MEAN", v, axis=0)`, which fails on scalars (plain
    `keras.Model.fit` fails there too). A `[1]` vector reduces to the same
    scalar; elsewhere the logs pass unchanged.
    """
    strategy = tf.distribute.get_strategy()
    multi_worker = isinstance(
        strategy, tf.distribute.MultiWorkerMirroredStrategy
    ) and in_multi_worker_mode(strategy)
    if not multi_worker:
        return logs
    return {k: tf.reshape(v, [1]) for k, v in logs.items()}
