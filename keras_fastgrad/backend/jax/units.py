"""The JAX step's units on values (`keras.ops`; the optimizer's
`stateless_apply` under `jax.lax.cond`): each returns new values, as a
traced branch on JAX cannot assign. The maths is the TensorFlow units'
own, written once (`keras_fastgrad.maths`: `finite`, `norms`,
`loss_scale`); the counting follows theirs (`keras_fastgrad.step`:
`applying`, `telemetry`, `divergence`)."""

import jax

from keras_fastgrad.backend.jax import agc, noise_scale, telemetry
from keras_fastgrad.maths.loss_scale import next_scale
from keras_fastgrad.step import update as update_rules


def update_scale(slots, ov, finite, counts_growth):
    """`LossScaleOptimizer`'s rule (`maths.loss_scale.next_scale`) on `ov`."""
    if slots.scaler is None:
        return
    i, j = slots.scale
    growth_steps = slots.scaler.dynamic_growth_steps
    ov[i], ov[j] = next_scale(ov[i], ov[j], finite, growth_steps, counts_growth)


def apply_if(slots, tv, ov, grads, do_apply, factor=None):
    """The optimizer's update where `do_apply` (a `lax.cond`: the optimizer
    runs only then), on `grads` times `factor` (multiplied in the update:
    XLA fuses it into the optimizer's, no clipped copy is stored); returns
    the new `(tv, ov)`."""
    new_tv, new_inner = stateless_apply_if(
        slots.inner, tv, [ov[i] for i in slots.inner_ov], grads, do_apply, factor
    )
    return list(new_tv), with_inner(slots, ov, new_inner)


def with_inner(slots, ov, inner):
    """A copy of the optimizer values `ov` with the inner optimizer's
    values `inner` at their positions (`slots.inner_ov`)."""
    ov = list(ov)
    for i, value in zip(slots.inner_ov, inner):
        ov[i] = value
    return ov


def stateless_apply_if(optimizer, tv, ov, grads, do_apply, factor=None):
    """`optimizer.stateless_apply(ov, grads * factor, tv)` where `do_apply`
    (a `lax.cond`; called directly for the Python `True`); `(tv, ov)`
    else. `factor`: float32 scalar, or `None` (1)."""

    def update(t, o, g, f):
        if f is not None:
            g = [x * f for x in g]
        return optimizer.stateless_apply(o, g, t)

    if do_apply is True:
        return update(tv, ov, grads, factor)
    return jax.lax.cond(do_apply, update, lambda t, o, g, f: (t, o), tv, ov, grads, factor)


class Update(update_rules.Masked):
    """The update's primitives on JAX values (`step.update`'s shell): the
    current trainable and optimizer values (`tv`, `ov`) and the step's
    `StepValues` (`new`), replaced as the chain runs (Python traces it in
    order); branches by mask (`step.update.Masked`): the records selected
    by it (`telemetry.record`), the optimizer in a `lax.cond` on it.

    Args:
        model: The `FastGradModel`.
        new: The step's `StepValues`.
        params: `(tv, ov)`.
        apply: `(tv, ov, grads, where, factor) -> (tv, ov)`, the optimizer's
            update where `where` (`apply_if`, `stateless_apply_if`).
        noise: Python bool: the window's big-batch norm is measured here
            (`big_sq`).
        where: Boolean scalar or `True`: where this update's branch runs.
    """

    def __init__(self, model, new, params, apply, noise=False, where=True):
        self.model, self.new, self._apply, self._noise = model, new, apply, noise
        self.tv, self.ov = params
        self.where = self.applied = where
        self.options = model.fastgrad_step_state.options
        self.gated = model.fastgrad_step_state.drops_nonfinite()
        self.log_keys = telemetry.requested(model)
        self.adapted, self.counted, self.measures, self.big_sq = None, {}, {}, None

    def record_noise(self, grads):
        if self._noise:
            self.big_sq = noise_scale.big_squared_norm(self.model, grads)

    def adaptive_clip(self, grads, computed):
        return agc.clip(self.model, self.tv, grads, self.counted)  # (never before the gate)

    def record_gradient(self, grads):
        self.adapted = grads  # measured after the update (`apply`)

    def apply(self, grads, factor):
        before = self.tv
        self.tv, self.ov = self._apply(self.tv, self.ov, grads, self.where, factor)
        self.measures = telemetry.measure(self.model, self.adapted, before, self.tv, self.counted)

    def write(self, change, mask):
        telemetry.record(self.new, change, mask)
