"""The few cross-replica operations the step needs, as no-ops on one device.

The step keeps every decision global (the same on every replica) by summing
small vectors across replicas; gradients are summed only at an update.
"""

import tensorflow as tf


def num_replicas():
    """Number of replicas in sync of the current strategy (1 without one)."""
    return tf.distribute.get_strategy().num_replicas_in_sync


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


def in_cross_replica_context(fn, *args):
    """Runs `fn(*args)` once in cross-replica context (for assigning state
    that is not mirrored per replica, like the loss scale). `args` must be
    identical on every replica; `fn` sees replica 0's copy."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return fn(*args)

    def merged(distribution, *args):
        local = [distribution.experimental_local_results(a)[0] for a in args]
        return fn(*local)

    return context.merge_call(merged, args=args)
