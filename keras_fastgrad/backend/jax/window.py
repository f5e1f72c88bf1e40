"""The accumulation window on JAX: the rules of
`keras_fastgrad.step.accumulation` run on values of Keras' state tuple
(`accumulation.WindowState` of values, written back into the step's new
values). What is JAX's own: the window's update under one `jax.lax.cond`
where it is applied (its gradient, AGC, clipped, applied when finite), the
emptied window selected by `where`, and the pending window applied on the
model's values at an epoch's end or by `apply_partial_window` (`_flush`,
jitted with the model)."""

import jax
from keras import ops

from keras_fastgrad.backend.jax import batchnorm as jax_batchnorm
from keras_fastgrad.backend.jax import noise_scale as noise
from keras_fastgrad.backend.jax import telemetry as telemetry
from keras_fastgrad.backend.jax import units as units
from keras_fastgrad.backend.jax.state import StepValues
from keras_fastgrad.backend.jax.state import slots as slots_of
from keras_fastgrad.maths.finite import all_finite
from keras_fastgrad.step import accumulation
from keras_fastgrad.step import telemetry as telemetry_rules
from keras_fastgrad.step import update as update_rules


def accumulate_or_apply(model, slots, values, new, micro_batch):
    """Adds `micro_batch` to the window (`accumulation.added`) and applies
    the window where it is complete and holds an included micro-batch
    (`accumulation.applies`), then empties it there (`accumulation.emptied`).

    Args:
        model: The `FastGradModel`.
        slots: The step's `Slots`.
        values: `(tv, ntv, ov)`, the state tuple's incoming values (the
            window's sums are read from `ntv`).
        new: The step's `StepValues` (its `window` replaced by the new
            one; its `window` on entry: the window's values, as `ntv`'s).
        micro_batch: `accumulation.MicroBatch` (`keep` the Python `True`
            when nothing is ever left out).

    Returns:
        `(tv, ov)`.
    """
    tv, ntv, ov = values
    window = accumulation.added(new.window, micro_batch)
    every_kept = micro_batch.keep is True
    steps = model.fastgrad_step_state.accumulator.steps
    complete, do_window = accumulation.closes(window, steps, every_kept)
    tv, ov = window_update(model, slots, (tv, ov), new, window, micro_batch.mean, do_window)
    new.window = accumulation.emptied(window, lambda v: _emptied_where(complete, v))
    return tv, ov


def _emptied_where(complete, value):
    """`value` emptied where `complete`: a float's 0 as a scalar (broadcast
    by `where`, no zeros of its shape), an integer count's in its dtype."""
    if "float" in str(value.dtype):
        return ops.where(complete, 0.0, value)
    return ops.where(complete, ops.zeros_like(value), value)


def window_update(model, slots, params, new, window, mean, do_window):
    """The window's update where `do_window`, in one `lax.cond` (nothing of
    it runs on the other micro-steps): its gradient
    (`accumulation.window_gradient` of the `window`, a `WindowState` of
    values; `mean`: the loss's reduction), then `step.update`'s chain
    (applied when its check holds; always without a gate:
    `skip_nonfinite=False` without loss scaling); after the `cond`, the
    chain's records (in `new`) and the loss scale's growth. `params`:
    `(tv, ov)`. Returns `(tv, ov)`."""
    tv, ov = params
    options = model.fastgrad_step_state.options
    clipping = options.clip_norm is not None
    measures = clipping or "grad_norm" in telemetry.requested(model)
    checked = []  # whether the update has a check (known when traced)

    def update(t, o, s, normaliser):
        apply = lambda t, o, g, where, f: units.stateless_apply_if(slots.inner, t, o, g, where, f)  # noqa: E731
        shell = units.Update(model, new, (t, o), apply, noise=True)
        prepared = update_rules.prepare(shell, accumulation.window_gradient(s, normaliser, mean))
        checked.append(prepared.ok is not None)
        shell.where = True if prepared.ok is None else prepared.ok
        shell.apply(prepared.grads, None)
        norm = prepared.norm if measures else ops.zeros((), "float32")
        was_clipped = prepared.was_clipped if clipping else ops.convert_to_tensor(False)
        ok = ops.convert_to_tensor(shell.where)
        return shell.tv, shell.ov, ok, norm, was_clipped, shell.big_sq, shell.measures

    def pending(t, o, s, normaliser):
        no, zero = ops.convert_to_tensor(False), ops.zeros((), "float32")
        return t, o, no, zero, no, zero, telemetry.unmeasured(model)

    inner_ov = [ov[i] for i in slots.inner_ov]
    tv, inner_ov, update_ok, norm, was_clipped, big_sq, optional = jax.lax.cond(
        do_window, update, pending, tv, inner_ov, window.sums, window.normaliser
    )
    noise.record_window(model, new, big_sq, do_window)
    ov = units.with_inner(slots, ov, inner_ov)
    shell = units.Update(model, new, (tv, ov), None, where=do_window)
    update_rules.recorded(
        shell,
        update_ok if checked[0] else None,
        norm if measures else None,
        was_clipped if clipping else None,
        lambda: all_finite(window.sums),  # (counted at the verdict: not again)
    )
    applied = shell.applied
    telemetry.record_measures(new, optional, do_window, applied)
    if slots.scaler is not None:  # growth counts applied updates
        grown = list(ov)
        units.update_scale(slots, grown, ops.convert_to_tensor(True), counts_growth=True)
        for i in slots.scale:
            ov[i] = ops.where(applied, grown[i], ov[i])
    return list(tv), ov


def apply_partial_window(model):
    """`FastGradModel.apply_partial_window` on JAX: the pending window's
    update on the model's variables (outside `fit`'s loop, where Keras has
    synced them), then the window restarted. Returns the telemetry logs as
    Python floats, of the keys the core names
    (`step.telemetry.partial_window_keys`). Called by
    `models.partial_window` once a window is pending and the model has an
    optimizer (its test and its refusal)."""
    state = model.fastgrad_step_state
    if model.train_function is None:  # loaded, or recompiled
        model._fg_prepare_state()
    keys = telemetry_rules.partial_window_keys(state)
    if state.flush_function is None:
        flush = lambda *values: _flush(model, keys, *values)  # noqa: E731
        state.flush_function = jax.jit(flush) if model.jit_compile else flush
    groups = (model.trainable_variables, model.non_trainable_variables, model.optimizer.variables)
    *values, logs = state.flush_function(*([v.value for v in group] for group in groups))
    for group, new_values in zip(groups, values):
        for variable, value in zip(group, new_values):
            variable.assign(value)
    return {k: float(logs[k]) for k in keys if k in logs}  # (`jit` sorts a dict's keys)


def _flush(model, keys, tv, ntv, ov):
    """The pending window applied, on values (see `apply_partial_window`):
    where it holds samples, then restarted (`accumulation.flushed`); and
    the telemetry `keys` after it."""
    slots = slots_of(model)
    new = StepValues.read(slots, ntv)
    window = new.window
    mean = model.fastgrad_step_state.accumulator.mean_reduction
    params = [(list(tv), list(ov))]

    def apply_where(held):
        params[0] = window_update(model, slots, params[0], new, window, mean, held)

    new.window = accumulation.flushed(window, apply_where, ops.zeros_like)
    tv, ov = params[0]
    logs = telemetry.logs(model, slots, new, ov, len(tv), keys, noise.estimates(model, new))
    ntv = new.write(slots, list(ntv), ntv)
    ntv = jax_batchnorm.apply_window(model, ntv)  # BatchNorm's one step from the window
    return tv, ntv, ov, logs
