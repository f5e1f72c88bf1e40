"""The comparators of the target table (issue 28): `keras.Model` doing the
same work as `FastGradModel`'s step, so a ratio measures the library, not
a difference in what the two steps promise.

- ungated: `keras.Model` itself, with the optimizer's own options
  (`gradient_accumulation_steps`, `global_clipnorm`, ...): `keras_model`.
- gated: `GatedModel`, Keras' own `train_step` (read from
  keras/src/backend/tensorflow/trainer.py, Keras 3.15) line for line, whose
  `optimizer.apply_gradients` runs only when every gradient is finite, the
  promise `FastGradModel`'s default (`skip_nonfinite=True`) keeps. The
  predicate is the library's own work (one sum per gradient, `is_finite`
  on their stack: keras_fastgrad/backend/tensorflow/finite.py): sparse gradients
  (`tf.IndexedSlices`) are summed over their rows, `None` gradients are
  left out. With `gradient_accumulation_steps=N` on the optimizer, a
  non-finite micro-batch is dropped before it reaches the accumulators,
  as `FastGradModel(accumulation_steps=N)` drops it.

Such a gate costs `keras.Model` itself the overlap of its update with the
backward pass (`bench_gate.py`): the gated anchor is the one a safe step
is measured against.

- with log keys: `GatedModel(extra_logs=K)` returns K more scalar log keys,
  each read from a float32 variable it assigns in the step, as the
  telemetry keys are (`FastGradModel` with callbacks attached). Keras'
  TensorFlow train function hands its outputs back through a
  `tf.experimental.Optional` unpacked on the host at every call
  (`keras/src/backend/tensorflow/trainer.py`, `function`:
  `opt_outputs.get_value()`), a cost per output that any log key pays,
  on `keras.Model` too: this anchor pays it for as many keys.
"""

import functools

import keras
import tensorflow as tf
from keras.src.losses.loss import unscale_loss_for_distribution


def all_finite(grads):
    """Boolean scalar: every gradient (`IndexedSlices`: its rows) holds
    only finite values; `None` gradients are left out."""
    sums = [
        tf.reduce_sum(g.values if isinstance(g, tf.IndexedSlices) else g)
        for g in grads
        if g is not None
    ]
    if not sums:
        return tf.constant(True)
    return tf.reduce_all(tf.math.is_finite(tf.stack(sums)))


def apply_if_finite(optimizer, grads, variables):
    """`optimizer.apply_gradients`, only when every gradient is finite."""

    def apply():
        optimizer.apply_gradients(zip(grads, variables))
        return tf.constant(True)

    return tf.cond(all_finite(grads), apply, lambda: tf.constant(False))


class GatedModel(keras.Model):
    """`keras.Model` with Keras' own `train_step`, its update applied only
    when every gradient is finite (`gate=False`: exactly Keras' step, for
    checking that this copy of it is faithful)."""

    def __init__(self, *args, gate=True, extra_logs=0, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = gate
        self.extra_logs = [
            tf.Variable(0.0, trainable=False, name=f"log_{i}") for i in range(extra_logs)
        ]

    def make_train_function(self, force=False):
        # The optimizer's variables must exist before its `apply` is traced
        # inside a `tf.cond` branch.
        if self.optimizer is not None and not self.optimizer.built:
            self.optimizer.build(self.trainable_variables)
        return super().make_train_function(force=force)

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            if self._call_has_training_arg:
                y_pred = self(x, training=True)
            else:
                y_pred = self(x)
            loss = self._compute_loss(
                x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
            )
            batch = tf.shape(next(i for i in tf.nest.flatten(x) if i is not None))[0]
            self._loss_tracker.update_state(
                unscale_loss_for_distribution(loss), sample_weight=batch
            )
            if self.optimizer is not None:
                loss = self.optimizer.scale_loss(loss)
        variables = self.trainable_weights
        grads = tape.gradient(loss, variables)
        if self.gate:
            apply_if_finite(self.optimizer, grads, variables)
        else:
            self.optimizer.apply_gradients(zip(grads, variables))
        logs = self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        for i, variable in enumerate(self.extra_logs):  # assigned, then read
            variable.assign(tf.cast(loss, tf.float32))
            logs[f"log_{i}"] = tf.convert_to_tensor(variable.value())
        return logs


def keras_model(build, gated, optimizer, loss, jit_compile=False, mixed=False, extra_logs=0):
    """A compiled anchor: `build(cls)` returns the uncompiled model of
    class `cls` (`GatedModel` when `gated`, else `keras.Model`; with
    `extra_logs`, `GatedModel(gate=gated, extra_logs=extra_logs)`);
    `optimizer` is a new optimizer (its own accumulation or clipping set).
    `mixed`: wrapped in `keras.optimizers.LossScaleOptimizer` (which gates
    its update on the gradients itself: under `mixed_float16` the ungated
    anchor is gated too)."""
    if extra_logs:
        model = build(functools.partial(GatedModel, gate=gated, extra_logs=extra_logs))
    else:
        model = build(GatedModel if gated else keras.Model)
    if mixed:
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    model.compile(optimizer=optimizer, loss=loss, jit_compile=jit_compile)
    return model
