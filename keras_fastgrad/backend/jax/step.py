"""`FastGradModel`'s step on Keras' JAX backend (`train_step(state, data)`).

The same chain and contract as the TensorFlow step
(`keras_fastgrad.backend.tensorflow.train_step`), for the options the JAX backend supports
(`keras_fastgrad.backend`):

    gradient (`jax.value_and_grad` of Keras' stateless forward and loss,
      `jax_micro_batches.gradient`, the micro-batch's loss times its
      share `D_j` when accumulating)
      -> unscale -> finite check -> loss-scale rule -> [accumulate]
      -> [window complete] divide by the window's normaliser -> clip
      -> gated update: `jax.lax.cond` over the optimizer's `stateless_apply`
    then the loss tracker and metrics (left as they were by a dropped
    micro-batch) and the step's counters.

Keras' JAX step is stateless: values come in through the state tuple and go
out in it, and a traced branch cannot assign. So the step works on values:
each unit returns new values, which are selected (`where`) or branched
(`lax.cond`) and written back into the tuple (`jax_state.Slots`,
`jax_state.StepValues`). The
maths follows the TensorFlow units; the counting of dropped micro-batches
and updates (`nonfinite_count`, `updates`, `clipped_updates`, the divergence
streak) is theirs, variable for variable.
"""

import contextlib

import jax
import keras
from keras import ops

from keras_fastgrad import _compat as compat
from keras_fastgrad.backend.jax import batchnorm as jax_batchnorm
from keras_fastgrad.backend.jax import forward as jax_forward
from keras_fastgrad.backend.jax import micro_batches as jax_micro_batches
from keras_fastgrad.backend.jax import multitask as jax_multitask
from keras_fastgrad.backend.jax import noise_scale as noise
from keras_fastgrad.backend.jax import reaching
from keras_fastgrad.backend.jax import telemetry as telemetry
from keras_fastgrad.backend.jax import units as units
from keras_fastgrad.backend.jax import window as jax_window
from keras_fastgrad.backend.jax.state import StepValues
from keras_fastgrad.backend.jax.state import slots as slots_of
from keras_fastgrad.maths.finite import all_finite
from keras_fastgrad.maths.norms import scaled_norm
from keras_fastgrad.step import divergence, micro_batch, verdict
from keras_fastgrad.step import update as update_rules
from keras_fastgrad.step.accumulation import MicroBatch
from keras_fastgrad.step.compile_loss import check_present_terms
from keras_fastgrad.step.metrics import tracked_weight
from keras_fastgrad.step.splitting import first_input
from keras_fastgrad.step.trainer import check_trainable_unchanged


def train_step(model, state, data):
    """One micro-batch (see the module docstring); Keras' JAX signature.

    Args:
        model: The `FastGradModel`.
        state: `(trainable, non_trainable, optimizer, metrics)` values.
        data: The batch, as Keras' JAX trainer passes it.

    Returns:
        `(logs, state)`, as Keras' `JAXTrainer.train_step`.
    """
    tv, ntv, ov, mv = (list(s) for s in state)
    traced = any(isinstance(v, jax.core.Tracer) for v in tv[:1])  # (jit)
    if traced:  # counted, as on TF
        model.fastgrad_step_state.trace_count += 1
    slots = slots_of(model)
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    accumulating = model.fastgrad_step_state.accumulator is not None
    with _variables_made_in_the_step_refused(model):
        reaching.record_trace_facts(model, state, (x, y, sample_weight), traced)
        grads, d, mean, aux = _gradients(model, slots, state, x, y, sample_weight, accumulating)
    unscaled_loss, y_pred, new_ntv, new_mv, *task_logs = aux  # (multitask: its telemetry)
    if accumulating:  # a trace-time fact of the loss (the flush reads it)
        model.fastgrad_step_state.record_mean_reduction(mean, len(tv))
    new = StepValues.read(slots, ntv)
    drops = model.fastgrad_step_state.drops_nonfinite()
    sliced = model.fastgrad_step_state.options.micro_batches > 1  # (divided: as on TF)
    own_gradient = drops and not accumulating and not sliced
    finite, scaled = _finite_check(model, grads, unscaled_loss, own_gradient)
    failed = divergence.counts_as_failure(finite, slots.loss_scale(ov))
    telemetry.record_input_shape(model, new, x)
    micro_batch.before_update(telemetry.Drops(model, new, grads, failed), finite, accumulating)
    growth = micro_batch.grows_per_micro_batch(accumulating)
    if accumulating:
        keep = micro_batch.kept(finite, drops)
        units.update_scale(slots, ov, finite, counts_growth=growth)
        noise.record_small(model, new, grads, x, d, finite, (sample_weight, mean))
        tv, ov = jax_window.accumulate_or_apply(
            model, slots, (tv, ntv, ov), new, MicroBatch(grads, d, keep, mean)
        )
    else:
        units.update_scale(slots, ov, finite, counts_growth=growth)
        keep, tv, ov = _update_or_drop(
            model, slots, tv, ov, new, grads, (finite, failed, scaled), drops
        )
    mv, logs = _metrics(
        model, mv, new_mv, unscaled_loss, new.streak, keep, (x, y, y_pred, sample_weight)
    )
    # the layers' updates (BatchNorm, seeds): as Keras' forward; then the step's
    out_ntv = new.write(slots, list(new_ntv), ntv)
    micro_step = new.window.micro_step if accumulating else None
    out_ntv = jax_batchnorm.end_micro_batch(model, out_ntv, ntv, keep, micro_step)
    logs.update(telemetry.logs(model, slots, new, ov, len(tv), noise=noise.estimates(model, new)))
    logs.update(task_logs[0] if task_logs else {})
    return logs, (tv, out_ntv, ov, mv)


@contextlib.contextmanager
def _variables_made_in_the_step_refused(model):
    """A layer that makes its variables in the traced forward pass (one used
    only with `training=True`, built lazily) fails inside Keras' stateless
    call (a shape mismatch of the state's values): refused by name instead,
    wherever the variables' count did change
    (`step.trainer.check_trainable_unchanged`, which `slots` ran before the
    forward pass, when it still matched)."""
    try:
        yield
    except Exception as error:
        try:
            check_trainable_unchanged(model)
        except ValueError as refusal:
            raise refusal from error
        raise


def _gradients(model, slots, state, x, y, sample_weight, accumulating):
    """`(grads, D, mean, aux)`: the unscaled gradient (times the share `D`
    when accumulating), the share, whether the window divides by its sum,
    and Keras' `aux` (`unscaled_loss, y_pred, non_trainable, metrics`)."""
    options = model.fastgrad_step_state.options
    if model.fastgrad_step_state.merger is not None:  # the task gradients, merged
        merged = jax_multitask.gradients
        if options.micro_batches > 1:  # summed over the slices, merged once
            merged = jax_micro_batches.sliced_task_gradients
        elif options.multitask_space == "features":
            from keras_fastgrad.backend.jax import features as jax_features

            merged = jax_features.gradients
        return merged(model, slots, state, x, y, sample_weight, accumulating, check_present_terms)
    if options.micro_batches > 1:
        return jax_micro_batches.sliced_gradients(
            model, slots, state, x, y, sample_weight, accumulating
        )
    return jax_micro_batches.gradient(model, slots, state, (x, y, sample_weight), accumulating)


def _finite_check(model, grads, loss, own_gradient):
    """`(finite, scaled)`: whether the loss and the gradients are finite,
    and the gradient's norm as `(unit, root)` where that norm was the check
    (`verdict.checks_norm`; `None` otherwise: one element sum each)."""
    options = model.fastgrad_step_state.options
    loss_finite = ops.all(ops.isfinite(loss))
    if verdict.checks_norm(options.clip_norm, options.clip_adaptive, own_gradient):
        scaled = scaled_norm(grads)
        return verdict.norm_finite(scaled, loss_finite), scaled
    return all_finite(grads) & loss_finite, None


def _update_or_drop(model, slots, tv, ov, new, grads, checked, drops):
    """No accumulation: the micro-batch's update, or its drop
    (`step.update`'s chain, its check joined to the verdict: one gate).
    `checked`: the verdict's `(finite, failed, scaled)` (`_finite_check`)."""
    finite, failed, scaled = checked
    apply = lambda t, o, g, where, f: units.apply_if(slots, t, o, g, where, f)  # noqa: E731
    shell = units.Update(model, new, (tv, ov), apply)
    prepared = update_rules.prepare(shell, grads, scaled=scaled, own=True, fold=True)
    if drops:
        # (without loss scaling every drop counts: `None`, as on TF)
        keep, counts = verdict.keep(finite, prepared.ok, None if slots.scaler is None else failed)

        def dropped():  # the micro-batch's drop, where it went bad
            where = shell.where
            telemetry.record_drop(
                model, new, grads, where, where if counts is None else where & counts
            )

        update_rules.apply_or_drop(shell, prepared._replace(ok=keep), dropped=dropped)
    else:  # ungated: applied as keras.Model does (AGC never applies a non-finite update)
        keep = True
        update_rules.apply_or_drop(shell, prepared, finite=lambda: finite)
    telemetry.record_measures(new, shell.measures, finite if drops else True, shell.applied)
    return keep, shell.tv, shell.ov


def _metrics(model, mv, new_mv, unscaled_loss, streak, keep, batch):
    """Keras' loss tracker and compiled metrics (`new_mv`: as the loss
    computation left them), left as they were (`mv`) by a dropped
    micro-batch; the logs read with the step's new streak (the `loss`
    tracker logs NaN while micro-batches are being dropped). Returns
    `(metrics_variables, logs)`."""
    x, y, y_pred, sample_weight = batch
    metrics = model.metrics_variables
    with_streak = [(model.fastgrad_step_state.divergence.streak, streak)]
    rows = tracked_weight(float(first_input(x).shape[0]))  # (static under `jit`)
    with keras.StatelessScope(state_mapping=[*zip(metrics, new_mv), *with_streak]) as scope:
        compat.loss_tracker(model).update_state(unscaled_loss, sample_weight=rows)
        logs = model.compute_metrics(x, y, y_pred, sample_weight)
    updated = [jax_forward.current(scope, v) for v in metrics]
    if keep is True:
        return updated, logs
    selected = [ops.where(keep, u, old) for u, old in zip(updated, mv)]
    if type(model).compute_metrics is keras.Model.compute_metrics:
        with keras.StatelessScope(state_mapping=[*zip(metrics, selected), *with_streak]):
            logs = model.get_metrics_result()
    return selected, logs
