"""The divergence streak on TensorFlow: `keras_fastgrad.step.divergence`'s
rule written into the streak's variable inside the branch that decided it
(a failure as one `AssignAddVariableOp`)."""

from keras_fastgrad.backend.tensorflow.variables import increment
from keras_fastgrad.step import divergence as core


class DivergenceWatch(core.DivergenceWatch):
    """`keras_fastgrad.step.divergence.DivergenceWatch` with the TensorFlow
    step's writes (checked in `tests/step/test_telemetry_rules.py`)."""

    def record_drop(self, failed=None):
        """A drop, counted when `failed` (boolean scalar, the same on every
        replica; `None`: the drop is a failure)."""
        increment(self.streak, core.failure(failed))

    def record_update(self):
        """An update was applied (inside the update branch)."""
        self.streak.assign(core.streak_after(None, failed=False, applied=True))
