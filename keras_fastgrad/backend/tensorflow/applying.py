"""Conditional optimizer update that is legal under `tf.distribute`.

An optimizer call inside `tf.cond` in replica context fails under
MirroredStrategy (`merge_call` inside `cond`, keras-team/keras#20582), and
under MultiWorkerMirroredStrategy a collective inside the `cond` of a
`merge_call` fails too. So the step does every collective before, in
replica context, and the update happens in cross-replica context: leave
replica context with `merge_call` (as `LossScaleOptimizer._tf_apply` does),
decide there, and inside the `cond` apply the optimizer once to gradients
that are already global. The optimizer then skips its own all-reduce (it
only runs in replica context), so gradients are summed exactly once.
Without a strategy this is a plain `tf.cond`.
"""

import numpy as np

from keras_fastgrad._compat import direct_merge_calls
from keras_fastgrad._tf_startup import tf
from keras_fastgrad.backend.tensorflow.replicas import first_replica


def apply_if(should_apply, update_fn, args=(), otherwise=None, otherwise_args=()):
    """Runs `update_fn(*args)` once, in cross-replica context, if
    `should_apply`.

    Args:
        should_apply: Boolean scalar (tensor or Python bool), identical on
            every replica; the Python `True` applies without a `cond`.
        update_fn: Callable that applies the optimizer and updates state;
            returns nothing. It must not run collectives (read sync-on-read
            variables instead, which reduce when read there).
        args: Tuple of tensors or lists of tensors (or `None`) whose values
            are identical on every replica; `update_fn` gets replica 0's.
        otherwise: Optional callable run instead (same context) when
            `should_apply` is false, with `otherwise_args` (passed like
            `args`): bookkeeping that only the other branch needs, at the
            cost of no extra `cond`.
        otherwise_args: Tuple, as `args`, for `otherwise`.

    Example:

    >>> v = tf.Variable(1.0)
    >>> apply_if(tf.constant(False), lambda: v.assign(5.0))
    >>> float(v.numpy())
    1.0
    """

    num_args = len(args)
    always = should_apply is True  # known when traced: no `cond`
    if isinstance(should_apply, (bool, np.bool_)):  # `tf.cond` wants a tensor
        should_apply = tf.constant(bool(should_apply))

    def decide_and_apply(distribution, should_apply, *all_args):
        local = [first_replica(distribution, a) for a in all_args]
        local_args, other_args = local[:num_args], local[num_args:]

        def apply():
            # Keras' optimizer routes its updates through `maybe_merge_call`,
            # which asks for a `merge_call` unless the strategy needs none;
            # from cross-replica context the right call is the function
            # itself: say so while the update is traced.
            with direct_merge_calls(distribution):
                update_fn(*local_args)

        def skip():
            if otherwise is not None:
                otherwise(*other_args)

        if always:
            apply()
        else:
            tf.cond(first_replica(distribution, should_apply), apply, skip)

    replica_context = tf.distribute.get_replica_context()
    if replica_context is None:  # already in cross-replica context
        decide_and_apply(tf.distribute.get_strategy(), should_apply, *args, *otherwise_args)
    else:
        replica_context.merge_call(decide_and_apply, args=(should_apply, *args, *otherwise_args))
