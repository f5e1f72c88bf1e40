"""`RetraceWatch`: notices when `fit` traces the train step again, and says
why it probably did."""

import warnings
import weakref

from keras_fastgrad import _compat as compat
from keras_fastgrad import backend
from keras_fastgrad.callbacks import _base

TRAIN_TRACES = "train_traces"


class RetraceWatch(_base.FastGradCallback):
    """Warns when `fit` traces the train step more often than expected.

    Every trace rebuilds the step's graph (and, under `jit_compile=True`,
    compiles it again with XLA): seconds to minutes lost. The callback reads
    `model.train_step_trace_count` (a Python counter the step bumps at trace
    time, so it costs nothing per step) and logs `train_traces`, the number
    of traces since this `fit` began (0 when `fit` reuses a step traced by
    an earlier `fit`, and under `run_eagerly=True`, where nothing is
    traced). When the count exceeds `max_traces` it warns, once per `fit`,
    with the likely cause and fix, told apart by when the trace happened:

    - the train function was replaced during `fit` (a callback called
      `model.make_train_function(force=True)`, e.g. after changing
      `trainable`): change such settings between `fit` calls;
    - with the last batch of an epoch: a short last batch (the number of
      samples is not a multiple of the batch size). Fix:
      `dataset.batch(batch_size, drop_remainder=True)`, or a batch size
      that divides the number of samples;
    - mid-epoch: input shapes that change between batches. Fix: fixed
      shapes (constant batch size, padding or bucketing to fixed lengths,
      `keras.Input` without `None` dimensions besides the batch).

    On Keras 3 with TensorFlow, `fit` feeds the step from a `tf.data`
    iterator whose batch dimension is already dynamic, so a short last batch
    does not retrace the step; under `jit_compile=True` it makes XLA compile
    the step again for the new shape. The step counts input-shape changes
    (`input_shape_changes`), and under `jit_compile=True` the watch warns,
    once per `fit`, when the input shape changed (same fixes).

    On Keras' JAX backend the count is that of the jitted step's traces:
    `jax.jit` traces (and compiles) the step again for every new input
    shape, a short last batch included, so the trace count warns for it
    directly (with `jit_compile=False` nothing is traced: 0).

    Args:
        max_traces: Integer >= 1, defaults to `1`. Traces of the train step
            allowed per `fit` before warning.

    Raises:
        TypeError, ValueError: for an invalid `max_traces`; at `fit`,
            `ValueError` when the model is not a `FastGradModel`.

    Example:

    >>> import keras, numpy as np, keras_fastgrad
    >>> inputs = keras.Input((2,))
    >>> model = keras_fastgrad.FastGradModel(inputs, keras.layers.Dense(1)(inputs))
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> watch = keras_fastgrad.callbacks.RetraceWatch(max_traces=1)
    >>> x, y = np.ones((8, 2)), np.ones((8, 1))
    >>> model.fit(x, y, epochs=2, verbose=0, callbacks=[watch]).history["train_traces"]
    [1.0, 1.0]
    >>> model.fit(x, y, verbose=0, callbacks=[watch]).history["train_traces"]
    [0.0]
    """

    telemetry_keys = ("input_shape_changes",)

    def __init__(self, max_traces=1):
        super().__init__()
        self.max_traces = _base.check_int(
            "max_traces",
            max_traces,
            1,
            " (traces of the train step allowed per `fit`)",
        )

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self._start = self.model.train_step_trace_count
        self._function = _reference(self.model.train_function)
        self._traces = 0
        self._warned = False
        self._pending = None  # (epoch, batch, cause) of a trace over the limit
        self._epoch = 0
        self._shape_changes = None
        self._xla_warned = False

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        batch = compat.last_batch(self.model, batch)
        if self._pending is not None:  # a batch followed: not the last one
            self._warn(last_batch=False)
        model = self.model
        if not model.run_eagerly:  # eager steps run train_step each call
            traces = model.train_step_trace_count - self._start
            replaced = model.train_function is not self._function()
            self._function = _reference(model.train_function)
            if traces > self._traces and traces > self.max_traces:
                if not self._warned:
                    cause = "replaced" if replaced else "shapes"
                    self._pending = (self._epoch, batch, cause)
            self._traces = traces
        self._watch_xla_recompiles(batch, logs)
        if logs is not None:
            logs[TRAIN_TRACES] = float(self._traces)

    def _watch_xla_recompiles(self, batch, logs):
        changes = (logs or {}).get("input_shape_changes")
        if changes is None or self.model.jit_compile is not True:
            return
        if not backend.shell().RECOMPILES_UNTRACED:
            return  # (JAX: jit traces again for a new shape, counted above)
        if self._shape_changes is None:
            self._shape_changes = changes
        if changes > self._shape_changes and not self._xla_warned:
            self._xla_warned = True
            warnings.warn(
                "RetraceWatch: the input shape changed at batch "
                f"{batch} of epoch {self._epoch} (0-based) under "
                "`jit_compile=True`: XLA compiles the step again for every "
                "new shape (the trace count does not show it). Likely a "
                "short last batch. Fix: `dataset.batch(batch_size, "
                "drop_remainder=True)` or a batch size that divides the "
                "number of samples; for varying lengths, pad or bucket to "
                "a few fixed shapes.",
                UserWarning,
                stacklevel=3,
            )

    def on_epoch_end(self, epoch, logs=None):
        if self._pending is not None:
            self._warn(last_batch=True)
        if logs is not None:
            logs[TRAIN_TRACES] = float(self._traces)

    def on_train_end(self, logs=None):
        if self._pending is not None:  # stopped inside an epoch
            self._warn(last_batch=False)
        super().on_train_end(logs)

    def _warn(self, last_batch):
        epoch, batch, cause = self._pending
        self._pending, self._warned = None, True
        message = (
            f"RetraceWatch: `fit` traced the train step {self._traces} times "
            f"(max_traces={self.max_traces}); each trace rebuilds and, under "
            "`jit_compile=True`, recompiles the step. "
        )
        if cause == "replaced":
            message += (
                f"At epoch {epoch}, batch {batch} (0-based) the model's train "
                "function had been replaced during `fit` (e.g. a callback "
                "called `model.make_train_function(force=True)` after "
                "changing `trainable`). Fix: change such settings between "
                "`fit` calls, or raise `max_traces` if this is intended."
            )
        elif last_batch:
            message += (
                f"The extra trace came with the last batch of epoch {epoch} "
                "(0-based): likely a short last batch (the number of samples "
                "is not a multiple of the batch size). Fix: batch with "
                "`dataset.batch(batch_size, drop_remainder=True)`, or choose "
                "a batch size that divides the number of samples."
            )
        else:
            message += (
                f"The extra trace came at batch {batch} of epoch {epoch} "
                "(0-based), mid-epoch: likely input shapes that change "
                "between batches (varying batch sizes or sequence lengths). "
                "Fix: feed fixed shapes (constant batch size, pad or bucket "
                "to a few fixed lengths), or give `keras.Input` fixed "
                "dimensions."
            )
        warnings.warn(message, UserWarning, stacklevel=3)


def _reference(function):
    """A weak reference to the train function where it takes one: holding
    it would keep JAX's trace of it alive, and a rebuilt `jax.jit` of the
    same step would then reuse that trace (no retrace while watched, and
    a stale step after a change the rebuild was for)."""
    try:
        return weakref.ref(function)
    except TypeError:  # (`None`, or an object without weak references)
        return lambda: function
