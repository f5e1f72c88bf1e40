"""Conditional optimizer update that is legal under `tf.distribute`.

An optimizer call inside `tf.cond` in replica context fails under
MirroredStrategy (`merge_call` inside `cond`, keras-team/keras#20582). The
pattern that works is the one of `LossScaleOptimizer._tf_apply`: leave
replica context with `merge_call` and decide in cross-replica context.
The update then runs once, in cross-replica context, on values that are the
same on every replica (all-reduced before, or read from sync-on-read
accumulators, which all-reduce when read there): the optimizer's own
all-reduce, which only runs in replica context, is skipped, so gradients
are summed exactly once. Without a strategy this is a plain `tf.cond`.
"""

import tensorflow as tf


def _first_replica(distribution, value):
    if value is None:
        return None
    return distribution.experimental_local_results(value)[0]


def apply_if(should_apply, update_fn, args=()):
    """Runs `update_fn(*args)` once, in cross-replica context, if
    `should_apply`.

    Args:
        should_apply: Boolean scalar, identical on every replica.
        update_fn: Callable that applies the optimizer and updates state;
            returns nothing. It receives replica 0's copy of `args`.
        args: Tuple of tensors or lists of tensors (or `None`) whose values
            are identical on every replica.

    Example:

    >>> v = tf.Variable(1.0)
    >>> apply_if(tf.constant(False), lambda: v.assign(5.0))
    >>> float(v.numpy())
    1.0
    """

    def decide_and_apply(distribution, should_apply, *args):
        first = lambda value: _first_replica(distribution, value)  # noqa: E731
        decision = first(should_apply)
        local_args = [
            [first(v) for v in a] if isinstance(a, (list, tuple)) else first(a)
            for a in args
        ]

        def apply():
            update_fn(*local_args)
            return tf.constant(True)

        tf.cond(decision, apply, lambda: tf.constant(False))

    replica_context = tf.distribute.get_replica_context()
    if replica_context is None:  # already in cross-replica context
        decide_and_apply(tf.distribute.get_strategy(), should_apply, *args)
    else:
        replica_context.merge_call(decide_and_apply, args=(should_apply, *args))
