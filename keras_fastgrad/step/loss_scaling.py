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
from keras import ops


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
        return loss if weight is None else loss * ops.cast(weight, loss.dtype)

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

    def current_scale(self):
        """float32 scalar: the loss scale (the fixed factor if set), 1
        without loss scaling."""
        if not self.active:
            return ops.convert_to_tensor(1.0 if self.factor is None else float(self.factor))
        return ops.cast(self.scaler.dynamic_scale, "float32")
