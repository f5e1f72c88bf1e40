"""TensorFlow's private API (and Keras' TensorFlow backend's), behind
small named functions: `tf.distribute` strategy internals, the XLA
context, the `tf.data` spec of Keras' epoch iterator, and the
`synchronization` of a variable on Keras < 3.10.

TensorFlow is named through `keras_fastgrad._tf_startup.tf`. The package
`keras_fastgrad._compat` imports this module on Keras' TensorFlow backend
only; on JAX, only where one of its names is asked for.
"""

import contextlib

import keras

from keras_fastgrad._tf_startup import tf


def is_default_strategy(strategy):
    """Whether `strategy` is TensorFlow's default (no) strategy, the one
    `tf.distribute.get_strategy()` returns outside every scope."""
    from tensorflow.python.distribute import distribute_lib

    return strategy is distribute_lib._get_default_strategy()


def batch_spec(iterator):
    """The structure, shapes and dtypes of the batches of the
    `TFEpochIterator` that `fit` passes to `_maybe_symbolic_build`, read
    without iterating (no batch consumed, no shuffle or epoch hook run): the
    `element_spec` of its dataset. `None` where it has no `tf.data.Dataset`
    (a distributed one, under a strategy)."""
    dataset = getattr(iterator, "_distributed_dataset", None)
    if isinstance(dataset, tf.data.Dataset):
        return dataset.element_spec
    return None


class SynchronizedVariable(keras.Variable):
    """A Keras variable whose `tf.Variable` gets a `synchronization` (Keras
    < 3.10 has no such argument): made by `keras._compat.variable`."""

    def __init__(self, *args, synchronization="auto", **kwargs):
        self._fg_synchronization = synchronization
        super().__init__(*args, **kwargs)

    def _initialize(self, value):
        self._value = tf.Variable(
            value,
            dtype=self._dtype,
            trainable=self.trainable,
            name=self.name,
            aggregation=self._map_aggregation(self.aggregation),
            synchronization=getattr(tf.VariableSynchronization, self._fg_synchronization.upper()),
        )


def in_xla_context():
    """Whether the graph being traced will be compiled by XLA (a
    `tf.function(jit_compile=True)`, the step of a model compiled with
    `jit_compile=True`, a TPU replica), so that an op without an XLA
    kernel must not be used. `True` when TF's private check is gone: the
    XLA-safe ops are always correct."""
    try:
        from tensorflow.python.framework import ops
        from tensorflow.python.ops import control_flow_util

        return bool(control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph()))
    except (ImportError, AttributeError):  # pragma: no cover (newer TF)
        return True


def in_multi_worker_mode(strategy):
    """Whether `strategy` runs collectives across several workers."""
    return strategy.extended._in_multi_worker_mode()


@contextlib.contextmanager
def direct_merge_calls(distribution):
    """Within the block, `distribution` reports that it needs no
    `merge_call`, so Keras' optimizer (`maybe_merge_call`) calls its update
    function directly: right from cross-replica context."""
    extended = distribution.extended
    shadowed = "_use_merge_call" in vars(extended)
    previous = vars(extended).get("_use_merge_call")
    extended._use_merge_call = lambda: False
    try:
        yield
    finally:
        if shadowed:
            extended._use_merge_call = previous
        else:
            del extended._use_merge_call


# The private names above, as (owner, attribute): checked by
# `tests/test_compat.py` (with `keras.KERAS_PRIVATE_NAMES`).
TENSORFLOW_PRIVATE_NAMES = (
    ("tensorflow.python.distribute.distribute_lib", "_get_default_strategy"),
    ("keras.Variable", "_initialize"),
    ("keras.Variable", "_map_aggregation"),
    ("tf.distribute.StrategyExtended", "_in_multi_worker_mode"),
    ("tf.distribute.StrategyExtended", "_use_merge_call"),
)
