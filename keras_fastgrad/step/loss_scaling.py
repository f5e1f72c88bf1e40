"""Dynamic loss scaling that cooperates with accumulation.

Keras' `LossScaleOptimizer` unscales, checks and applies in one call. The
step needs those apart: gradients are unscaled before they are accumulated,
measured or clipped, and an overflowing micro-batch is dropped while the
others of its window still count. This unit drives the optimizer's own
`dynamic_scale` and `step_counter` variables with the same rule as Keras
(halve on a non-finite micro-batch, double after `dynamic_growth_steps`
finite updates), so the scale is saved and restored with the optimizer.
Growth counts updates, not micro-batches: under accumulation a window's
applied update is one step, as Keras' `LossScaleOptimizer` on the big batch
and PyTorch's `GradScaler` with accumulation count it.

An ordinary optimizer may carry a fixed `loss_scale_factor`: Keras' own
step multiplies the loss by it (`optimizer.scale_loss`) and the optimizer's
`apply` divides the gradients by it. Here the loss is scaled the same way,
but the gradients are unscaled right away (accumulation, clipping and
`grad_norm` see the true gradient), so `apply` must not divide again.
"""

import keras

from keras_fastgrad._tf_startup import tf
from keras_fastgrad.maths.loss_scale import next_scale
from keras_fastgrad.step.gradients import scale
from keras_fastgrad.step.replicas import in_cross_replica_context


class LossScaling:
    """Scale, unscale and update the loss scale of a `LossScaleOptimizer`,
    or scale and unscale by an optimizer's fixed `loss_scale_factor`.

    `active` (dynamic scaling: drops, halving, growth) only for a
    `LossScaleOptimizer`; a fixed factor only scales and unscales. Identity
    without either, e.g. in float32 or under `mixed_bfloat16`.

    Args:
        optimizer: The model's compiled optimizer.

    Example:

    >>> scaling = LossScaling(keras.optimizers.SGD())
    >>> scaling.active
    False
    """

    def __init__(self, optimizer):
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            self.scaler = optimizer
            self.update_optimizer = optimizer.inner_optimizer
        else:
            self.scaler = None
            self.update_optimizer = optimizer
        # `LossScaleOptimizer` clears its inner optimizer's factor, so a
        # fixed factor and dynamic scaling never meet.
        self.factor = getattr(self.update_optimizer, "loss_scale_factor", None)

    @property
    def active(self):
        """Whether the scale is dynamic (a `LossScaleOptimizer`)."""
        return self.scaler is not None

    @property
    def _scales(self):
        return self.active or self.factor is not None

    def scale(self, loss, weight=None):
        """The loss to differentiate.

        Args:
            loss: Scalar loss.
            weight: Optional float32 scalar. After `unscale(grads, weight)`
                the gradients equal `weight * dloss/dw`. Folded in where it
                costs no extra pass over the gradients: into the loss
                without loss scaling, into the unscaling multiply with it
                (so float16 gradients do not grow by `weight`).
        """
        if self.active:
            return self.scaler.scale_loss(loss)
        if self.factor is not None:  # Keras' own scaling, as in its step
            return self.update_optimizer.scale_loss(loss)
        return loss if weight is None else loss * tf.cast(weight, loss.dtype)

    def unscale(self, grads, weight=None):
        """Float32 gradients of the unscaled loss, times `weight` if given."""
        if not self._scales:
            return grads
        if self.active:
            inverse = 1.0 / self.scaler.dynamic_scale
        else:
            inverse = 1.0 / self.factor
        if weight is not None:
            inverse = inverse * weight
        return [scale(g, inverse) for g in grads]

    def apply(self, grads, variables):
        """Applies unscaled `grads` with the update optimizer.

        With a fixed `loss_scale_factor` the optimizer's `apply` would divide
        the already unscaled gradients again: the factor is cleared while
        the update is traced (it is read in Python, at trace time) and put
        back after, so the optimizer's config and `scale_loss` keep it.
        """
        optimizer = self.update_optimizer
        if self.factor is None:
            optimizer.apply(grads, variables)
            return
        optimizer.loss_scale_factor = None
        try:
            optimizer.apply(grads, variables)
        finally:
            optimizer.loss_scale_factor = self.factor

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

    def current_scale(self):
        """float32 scalar: the loss scale (the fixed factor if set), 1
        without loss scaling."""
        if not self.active:
            return tf.constant(1.0 if self.factor is None else float(self.factor))
        return tf.cast(self.scaler.dynamic_scale, tf.float32)
