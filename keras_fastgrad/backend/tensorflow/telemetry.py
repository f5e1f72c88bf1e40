"""The step's telemetry on TensorFlow: the counters' and the divergence
streak's changes (`keras_fastgrad.step.telemetry`'s `Change` of each
event) written into their variables inside the branch that decided them,
a count as one `AssignAddVariableOp`
(`step.variables.increment`); the optional keys' values
(`StepTelemetry.measure`) assigned, sparse gradients' rows summed before
the per-layer norms, `update_ratio`'s sums as `AddN`s.
"""

from keras_fastgrad._tf_startup import tf
from keras_fastgrad.backend.tensorflow.gradients import summed_rows
from keras_fastgrad.backend.tensorflow.variables import increment
from keras_fastgrad.step import divergence
from keras_fastgrad.step import telemetry as core


def write(counters, change):
    """Writes `change` (a rule's `Counters`) into `counters` (`Counters` of
    the variables): a count gets one more (or its boolean as 0/1), a latest
    value is assigned; `None` is left alone."""
    for name, variable, value in zip(core.Counters._fields, counters, change, strict=True):
        if value is None:
            continue
        if name in core.COUNTS:
            increment(variable, 1.0 if value is True else tf.cast(value, tf.float32))
        else:
            variable.assign(tf.cast(value, tf.float32))


def record(state, change):
    """Writes a `core.Change` (one event of the step) inside the branch
    that decided it: the counters into `state.telemetry`'s variables
    (`write`), the divergence streak into `state.divergence`'s (a failure
    as one `AssignAddVariableOp`, an applied update's reset as an
    `Assign`)."""
    write(state.telemetry.counters(), change.counters)
    streak = state.divergence.streak
    if change.failed is not False:
        increment(streak, divergence.failure(change.failed))
    if change.applied is not None:  # (`True`: the reset, with no read)
        now = None if change.applied is True else tf.convert_to_tensor(streak.value)
        streak.assign(divergence.streak_after(now, failed=False, applied=change.applied))


class StepTelemetry(core.StepTelemetry):
    """`keras_fastgrad.step.telemetry.StepTelemetry` with the TensorFlow
    step's writes of the measured values (each inside the branch it
    records; the events' changes: `record`)."""

    def record_input_shape(self, first_input):
        """Counts a micro-batch whose first input's shape (its rows or
        element count, read when the step runs) differs from the previous
        one's: under XLA every new shape is a compile."""
        rows = tf.cast(tf.shape(first_input)[0], tf.float32)
        size = tf.cast(tf.size(first_input), tf.float32)
        change = core.input_shape(self.last_input_batch, self.last_input_size, rows, size)
        write(self.counters(), change)

    def record_layer_norms(self, grads):
        """Per-layer norms of the update's gradient (before clipping;
        `core.StepTelemetry.measure`), a sparse gradient's rows summed."""
        if self.layer_norms:
            self._assign(self.measure([None if g is None else summed_rows(g) for g in grads]))

    def snapshot(self, variables):
        """float32 copies of the weights before an update, if needed."""
        if self.update_ratio is None:
            return None
        return [tf.identity(tf.cast(v.value, tf.float32)) for v in variables]

    def record_update_ratio(self, before, variables):
        """`update_ratio` of the update (inside its branch,
        `core.StepTelemetry.measure`), its sums as `AddN`s."""
        if before is not None:
            after = [v.value for v in variables]
            self._assign(self.measure(before=before, after=after, total=tf.add_n))

    def _assign(self, measured):
        variables = dict(self.optional_variables())
        for key, value in measured.items():
            variables[key].assign(value)

    def logs(self, loss_scale, tape_variables, keys=None, noise=None):
        """The log dict (`keras_fastgrad.step.telemetry.logs`), each wanted
        variable read once (one `ReadVariableOp`).

        Args:
            loss_scale: float32 scalar, the current loss scale.
            tape_variables: Python int, the watched variables' number.
            keys: Optional set of keys: only those are read; `None`: every key.
            noise: Optional `NoiseScale` (its `gns_*` keys).
        """
        return core.logs(
            self.counters(),
            loss_scale,
            tape_variables,
            keys,
            self.optional_variables(),
            read=lambda variable: tf.convert_to_tensor(variable.value),
            noise=None if noise is None else noise.state(),
        )
