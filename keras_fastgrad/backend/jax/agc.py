"""Adaptive gradient clipping (`clip_adaptive`) in the JAX step.

The maths is `keras_fastgrad.maths.adaptive_clipping` (backend-neutral,
the paper's equation unit by unit); this module applies it in the JAX
step as the TensorFlow unit (`keras_fastgrad.step.adaptive_clipping`) does
in the TensorFlow step: after accumulation, unscaling and the division by
the normaliser, before `clip_norm`, on the update's gradient, with the
weights as they are before the update. A non-finite gradient never reaches
the weights, with either `skip_nonfinite` (the unit norms' flag); a unit
norm that overflows float32 drops the update too.
"""

from keras_fastgrad.backend.jax import telemetry as telemetry
from keras_fastgrad.step import adaptive_clipping as rules
from keras_fastgrad.step.telemetry import AGC_CLIPPED_FRACTION


def clip(model, tv, grads, counted):
    """`(grads, ok)`: the gradient clipped by the `clip_adaptive` option, and
    whether the update may be applied (`ok` is `None`: AGC is off).

    Args:
        model: The `FastGradModel`.
        tv: The trainable variables' values before the update (the state
            tuple's, in `model.trainable_variables`' order).
        grads: The update's float32 gradients, in the same order.
        counted: A dict: where `agc_clipped_fraction` is requested, its
            value (the fraction of units clipped) is put there under that
            key.
    """
    options = model.fastgrad_step_state.options
    if options.clip_adaptive is None:
        return grads, None
    out = rules.clip(model, grads, tv, options, telemetry.measured_keys(model))
    if out.clipped_units is not None:
        counted[AGC_CLIPPED_FRACTION] = rules.clipped_fraction(out)
    return out.grads, out.all_finite
