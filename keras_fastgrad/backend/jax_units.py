"""The JAX step's units on values (`keras.ops`; the optimizer's
`stateless_apply` under `jax.lax.cond`): each returns new values, as a
traced branch on JAX cannot assign. The maths and the counting follow the
TensorFlow units (`keras_fastgrad.step`: `finite`, `clipping`,
`loss_scaling`, `applying`, `telemetry`, `divergence`)."""

import jax
import numpy as np
from keras import ops

_TINY = float(np.finfo(np.float32).tiny)


def all_finite(grads):
    """Boolean scalar: every gradient finite everywhere."""
    return ops.all(ops.stack([ops.all(ops.isfinite(g)) for g in grads]))


def global_norm(grads):
    """The gradients' global L2 norm (float32 scalar)."""
    return ops.sqrt(sum(ops.sum(ops.square(g)) for g in grads))


def update_scale(slots, ov, finite, counts_growth):
    """`LossScaleOptimizer`'s rule on `ov` (`loss_scaling.LossScaling`)."""
    if slots.scaler is None:
        return
    i, j = slots.ov["scale"], slots.ov["counter"]
    scale, counter = ov[i], ov[j]
    zero = ops.zeros_like(counter)
    if counts_growth:
        grow = finite & ops.equal(counter, slots.scaler.dynamic_growth_steps - 1)
        ov[i] = ops.where(finite, ops.where(grow, scale * 2.0, scale), scale * 0.5)
        ov[j] = ops.where(finite, ops.where(grow, zero, counter + 1), zero)
    else:
        ov[i] = ops.where(finite, scale, scale * 0.5)
        ov[j] = ops.where(finite, counter, zero)


def clip(model, grads, gated):
    """`(grads, norm, was_clipped, ok)`: clipped to `clip_norm`; `ok`:
    the norm is finite and its clip factor a normal float (else a `gated`
    update is dropped, `clipping.fits_clip`; an ungated one gets a NaN
    factor, as Keras' clipping); `norm`/`was_clipped` `None` without."""
    if model.clip_norm is None:
        return grads, None, None, None
    norm = global_norm(grads)
    was_clipped = norm > model.clip_norm
    factor = ops.where(was_clipped, model.clip_norm / ops.maximum(norm, _TINY), 1.0)
    fits = norm <= model.clip_norm / _TINY  # False for a NaN norm
    ok = ops.isfinite(norm) & fits
    if not gated:
        factor, ok = ops.where(fits, factor, float("nan")), None
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
