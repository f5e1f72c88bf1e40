"""Conditional optimizer update that is legal under `tf.distribute`.

An optimizer call inside `tf.cond` in replica context fails under
MirroredStrategy (`merge_call` inside `cond`, keras-team/keras#20582). The
pattern that works is the one of `LossScaleOptimizer._tf_apply`: leave
replica context with `merge_call`, decide in cross-replica context, and run
the update for each replica inside the `cond`. Without a strategy this is a
plain `tf.cond`.
"""

import tensorflow as tf


def _first_replica(distribution, value):
    if value is None:
        return None
    return distribution.experimental_local_results(value)[0]


def apply_if(should_apply, update_fn, args=()):
    """Runs `update_fn(*args)` on every replica if `should_apply`.

    Args:
        should_apply: Boolean scalar, identical on every replica.
        update_fn: Callable that applies the optimizer and updates state;
            returns nothing. Runs in replica context.
        args: Tuple of (per-replica) tensors or lists of tensors passed to
            `update_fn`.

    Example:

    >>> v = tf.Variable(1.0)
    >>> apply_if(tf.constant(False), lambda: v.assign(5.0))
    >>> float(v.numpy())
    1.0
    """

    def decide_and_apply(distribution, should_apply, *args):
        decision = _first_replica(distribution, should_apply)

        def apply():
            distribution.extended.call_for_each_replica(update_fn, args=args)
            return tf.constant(True)

        tf.cond(decision, apply, lambda: tf.constant(False))

    replica_context = tf.distribute.get_replica_context()
    if replica_context is None:  # already in cross-replica context
        decide_and_apply(tf.distribute.get_strategy(), should_apply, *args)
    else:
        replica_context.merge_call(decide_and_apply, args=(should_apply, *args))
