"""The JAX step's units on values (`keras.ops`; the optimizer's
`stateless_apply` under `jax.lax.cond`): each returns new values, as a
traced branch on JAX cannot assign. The maths is the TensorFlow units'
own, written once (`keras_fastgrad.maths`: `finite`, `norms`,
`loss_scale`); the counting follows theirs (`keras_fastgrad.step`:
`applying`, `telemetry`, `divergence`)."""

import jax
from keras import ops

from keras_fastgrad.maths import norms
from keras_fastgrad.maths.finite import all_finite  # noqa: F401  (the step's)
from keras_fastgrad.maths.loss_scale import next_scale
from keras_fastgrad.maths.norms import global_norm  # noqa: F401  (the step's)


def update_scale(slots, ov, finite, counts_growth):
    """`LossScaleOptimizer`'s rule (`maths.loss_scale.next_scale`) on `ov`."""
    if slots.scaler is None:
        return
    i, j = slots.ov["scale"], slots.ov["counter"]
    growth_steps = slots.scaler.dynamic_growth_steps
    ov[i], ov[j] = next_scale(ov[i], ov[j], finite, growth_steps, counts_growth)


def clip(clip_norm, grads, gated):
    """`(grads, norm, was_clipped, ok)`: clipped to `clip_norm`, the norm
    measured without overflow (`maths.norms`); `ok`: the norm is finite and
    its clip factor a normal float (else a `gated` update is dropped,
    `norms.fits_clip`; an ungated one gets a NaN factor, as Keras'
    clipping); `norm`/`was_clipped` `None` without."""
    if clip_norm is None:
        return grads, None, None, None
    unit, root = norms.scaled_norm(grads)
    factor, was_clipped = norms.clip_factor(clip_norm, unit, root, checked=gated)
    norm = unit * root
    ok = ops.isfinite(norm) & norms.fits_clip(clip_norm, unit, root) if gated else None
    return [g * factor for g in grads], norm, was_clipped, ok


def apply_if(slots, tv, ov, grads, do_apply):
    """The optimizer's update where `do_apply` (a `lax.cond`: the optimizer
    runs only then); returns the new `(tv, ov)`."""
    new_tv, new_inner = stateless_apply_if(
        slots.inner, tv, [ov[i] for i in slots.inner_ov], grads, do_apply
    )
    ov = list(ov)
    for i, value in zip(slots.inner_ov, new_inner):
        ov[i] = value
    return list(new_tv), ov


def stateless_apply_if(optimizer, tv, ov, grads, do_apply):
    """`optimizer.stateless_apply(ov, grads, tv)` where `do_apply` (a
    `lax.cond`; called directly for the Python `True`); `(tv, ov)` else."""

    def update(t, o, g):
        return optimizer.stateless_apply(o, g, t)

    if do_apply is True:
        return update(tv, ov, grads)
    return jax.lax.cond(do_apply, update, lambda t, o, g: (t, o), tv, ov, grads)


def record_update(new, applied, norm, was_clipped):
    """The counters of an applied update (`applied`: boolean scalar)."""
    new["updates"] += ops.cast(applied, "float32")
    if norm is not None:  # with `clip_norm`, or the `grad_norm` key
        new["grad_norm"] = ops.where(applied, norm, new["grad_norm"])
    if was_clipped is not None:
        new["clipped_updates"] += ops.cast(applied & was_clipped, "float32")
    new["streak"] = ops.where(applied, 0.0, new["streak"])


def record_dropped_update(new, dropped):
    """A finite micro-batch (or window) whose update overflowed: counted."""
    new["nonfinite_count"] += ops.cast(dropped, "float32")
    new["streak"] += ops.cast(dropped, "float32")
    new["first_index"] = ops.where(dropped, -1.0, new["first_index"])
