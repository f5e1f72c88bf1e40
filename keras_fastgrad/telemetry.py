"""Gradient telemetry measured inside the compiled step.

Values live in variables so that nothing between two callback calls is lost
when Keras runs several steps per call (`steps_per_execution > 1` returns
only the last step's outputs): counts accumulate, the latest update's norm
and the latest non-finite location are kept until replaced.

Log keys (fixed, all float scalars):

- `grad_norm`: global L2 norm, before clipping, of the gradient of the most
  recent optimizer update.
- `clipped_updates`: number of updates whose gradient was clipped.
- `updates`: number of optimizer updates the model made.
- `nonfinite_count`: micro-batches dropped because their loss or gradient
  held NaN/Inf (cumulative over the model's life; saved with the model).
- `nonfinite_first_index`: index into `model.trainable_variables` (as
  watched by the tape) of the first non-finite gradient of the most recent
  dropped micro-batch, -1 if none or if only the loss was non-finite.
- `nonfinite_num_variables`: how many gradients were non-finite in it.
- `loss_scale`: the current loss scale (1 without loss scaling).
- `tape_variables`: how many variables the tape watched (a trace-time
  constant).
"""

import keras
import tensorflow as tf

LOG_KEYS = (
    "grad_norm",
    "clipped_updates",
    "updates",
    "nonfinite_count",
    "nonfinite_first_index",
    "nonfinite_num_variables",
    "loss_scale",
    "tape_variables",
)


def _scalar(name, value):
    return keras.Variable(
        value, dtype="float32", trainable=False, autocast=False, name=name
    )


class StepTelemetry:
    """The step's measurements, kept in float32 scalar variables.

    Example:

    >>> t = StepTelemetry()
    >>> t.build()
    >>> t.record_micro_batch(tf.constant(False), tf.constant(3), tf.constant(1))
    >>> float(t.nonfinite_count.numpy()), float(t.nonfinite_first_index.numpy())
    (1.0, 3.0)
    """

    def build(self):
        self.grad_norm = _scalar("grad_norm", 0.0)
        self.clipped_updates = _scalar("clipped_updates", 0.0)
        self.updates = _scalar("updates", 0.0)
        self.nonfinite_count = _scalar("nonfinite_count", 0.0)
        self.nonfinite_first_index = _scalar("nonfinite_first_index", -1.0)
        self.nonfinite_num_variables = _scalar("nonfinite_num_variables", 0.0)

    @property
    def variables(self):
        return [
            self.grad_norm,
            self.clipped_updates,
            self.updates,
            self.nonfinite_count,
            self.nonfinite_first_index,
            self.nonfinite_num_variables,
        ]

    def record_micro_batch(self, finite, first_bad, num_bad):
        """Counts a dropped micro-batch and remembers where it went bad."""
        bad = tf.logical_not(finite)
        self.nonfinite_count.assign_add(tf.where(bad, 1.0, 0.0))
        self.nonfinite_first_index.assign(
            tf.where(bad, tf.cast(first_bad, tf.float32), self.nonfinite_first_index)
        )
        self.nonfinite_num_variables.assign(
            tf.where(bad, tf.cast(num_bad, tf.float32), self.nonfinite_num_variables)
        )

    def record_update(self, norm, was_clipped):
        """Records one optimizer update (inside the update branch)."""
        self.updates.assign_add(1.0)
        if norm is not None:
            self.grad_norm.assign(norm)
        if was_clipped is not None:
            self.clipped_updates.assign_add(tf.cast(was_clipped, tf.float32))

    def logs(self, loss_scale, tape_variables):
        """The log dict returned by the step."""
        values = {v.name: tf.identity(v.value) for v in self.variables}
        values["loss_scale"] = loss_scale
        values["tape_variables"] = tf.constant(float(tape_variables))
        return {key: values[key] for key in LOG_KEYS}
