"""BatchNorm window statistics in the TensorFlow step: how the step keeps
and writes `WindowMoments`' variables (the rules, the pooling and the
moving statistics' step: `keras_fastgrad.step.batchnorm`).

TensorFlow's part: the moments a forward pass records live in its trace
(per thread: a `MirroredStrategy` traces each replica in a thread of its
own), or, inside the slices' `tf.while_loop` (`micro_batches`), in
per-replica variables (`WindowMoments.scratch`); the micro-batch's
moments are pooled over the replicas with the strategy's all-reduce, and
the variables are assigned.
"""

import threading
import weakref

from keras_fastgrad._tf_startup import tf
from keras_fastgrad.backend.tensorflow.replicas import num_replicas, replica_sum
from keras_fastgrad.maths.batchnorm import combined
from keras_fastgrad.step import batchnorm as core

# Each unit's `core.Recorder` of the trace in progress, per thread.
_traces = weakref.WeakKeyDictionary()


def _trace(unit):
    local = _traces.get(unit)
    return _traces.setdefault(unit, threading.local()) if local is None else local


def _read(variable):
    return tf.convert_to_tensor(variable.value)  # (one read)


def recording(unit):
    """A context for the step's forward pass (`core.Recorder.recording`):
    the moments of `unit` (a `core.WindowMoments`) recorded, its layers'
    moving statistics held. With slices, each slice's moments are added
    to the micro-batch's variables (`scratch`)."""
    store = None
    if unit.sliced:

        def store(layer, moments):
            scratch = unit.scratch[id(layer)]
            scratch.assign(combined(_read(scratch), moments))

    recorder = core.Recorder(unit.layers, store)
    _trace(unit).recorder = recorder
    return recorder.recording()


def end_micro_batch(unit, keep):
    """Adds the micro-batch's moments, pooled over the replicas (two
    small all-reduces with several), to the window if `keep`
    (`core.kept`). Runs in replica context, on every replica."""
    if unit.sliced:
        local = tf.concat([_take(unit.scratch[id(layer)]) for layer in unit.layers], 1)
    else:
        recorder = getattr(_trace(unit), "recorder", None)
        recorder = recorder or core.Recorder(unit.layers)
        local = recorder.stacked(unit.sizes)
    if num_replicas() > 1:
        local = core.pooled_over_replicas(local, replica_sum)
    current = _read(unit.window)
    unit.window.assign(core.kept(keep, combined(current, local), current))


def _take(scratch):
    """The slices' moments of this micro-batch, the sum emptied for the
    next one."""
    moments = _read(scratch)
    with tf.control_dependencies([moments]):
        scratch.assign(tf.zeros(scratch.shape))
    return moments


def apply(unit):
    """One momentum step of each layer's moving statistics from the
    window's pooled moments, then an empty window (`core.moved`). Runs
    with the optimizer update."""
    moving = [(layer.moving_mean, layer.moving_variance) for layer in unit.layers]
    values = [tuple(_read(v) for v in pair) for pair in moving]
    window = _read(unit.window)
    new, empty = core.moved(window, unit.layers, unit.sizes, values, split=tf.split)
    for variables, new_values in zip(moving, new):
        for variable, value in zip(variables, new_values):
            variable.assign(value)
    unit.window.assign(empty)
