"""Loss scaling on TensorFlow: `keras_fastgrad.step.loss_scaling.LossScaling`
with the unscaling of sparse gradients (`tf.IndexedSlices`) and the scale's
update written into the optimizer's variables in cross-replica context (the
rule: `keras_fastgrad.maths.loss_scale.next_scale`)."""

from keras_fastgrad._tf_startup import tf
from keras_fastgrad.backend.tensorflow.gradients import scale
from keras_fastgrad.backend.tensorflow.replicas import in_cross_replica_context
from keras_fastgrad.maths.loss_scale import next_scale
from keras_fastgrad.step import loss_scaling as core


class LossScaling(core.LossScaling):
    """`keras_fastgrad.step.loss_scaling.LossScaling` with the TensorFlow
    step's unscaling and scale updates."""

    def unscale(self, grads, weight=None):
        """Float32 gradients of the unscaled loss, times `weight` if given."""
        if not self._scales:
            return grads
        inverse = 1.0 / (self.scaler.dynamic_scale if self.active else self.factor)
        if weight is not None:
            inverse = inverse * weight
        return [scale(g, inverse) for g in grads]

    def update(self, finite, counts_growth=True):
        """Halves the scale after a non-finite micro-batch, grows it after
        `dynamic_growth_steps` finite ones (Keras' rule).

        Args:
            finite: Boolean scalar, the same on every replica.
            counts_growth: Python bool. `False` under accumulation: a finite
                micro-batch is not an update, and growth is counted per
                applied update instead (`record_update`), as Keras'
                `LossScaleOptimizer` counts its steps on the big batch (and
                PyTorch's `GradScaler.update` once per optimizer step). An
                overflow still halves the scale and restarts the count.
        """
        if self.active:
            # The optimizer's scale variables are not per-replica state.
            in_cross_replica_context(self._update, finite, counts_growth)

    def record_update(self):
        """An applied update of an accumulated window (in the update branch,
        cross-replica context): one finite step towards growth."""
        if self.active:
            self._update(tf.constant(True), True)

    def _update(self, finite, counts_growth):
        # The rule on values (`maths.loss_scale`, shared with the JAX step).
        counter = self.scaler.step_counter
        scale = self.scaler.dynamic_scale
        new_scale, new_counter = next_scale(
            scale.value,
            counter.value,
            finite,
            self.scaler.dynamic_growth_steps,
            counts_growth,
        )
        scale.assign(new_scale)
        counter.assign(new_counter)
