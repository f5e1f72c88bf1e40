"""The units of `FastGradModel.train_step`, in the order the step runs them.

    gradients -> finite_check -> pool_batchnorm_moments -> update_loss_scale
              -> update_or_drop                              (one `cond`)
              or accumulate_or_apply -> update
    then metrics and telemetry logs

Each takes the step's `StepState` explicitly (the options too, as
`state.options`), the model only where it reads what the model alone has
(its variables, its compiled metrics), and does one thing. The first units live in their
own modules and are re-exported here, so that the chain reads in one place:
`backward` (`gradients`: a `Batch`), `verdict` (`finite_check`: a
`Verdict`, and what follows it outside the update's `cond`); the update's
units are below. The maths is in the modules they call (`weighting`,
`loss_scaling`, `finite`, `accumulation`, `adaptive_clipping`, `clipping`,
`applying`, `batchnorm`, `noise_scale`, `multitask`, `slicing`).
"""

import functools

import keras

from keras_fastgrad import _compat as compat
from keras_fastgrad._tf_startup import tf
from keras_fastgrad.backend.tensorflow import accumulation as tf_window
from keras_fastgrad.backend.tensorflow import batchnorm as tf_batchnorm
from keras_fastgrad.backend.tensorflow import clipping as tf_clipping
from keras_fastgrad.backend.tensorflow import finite
from keras_fastgrad.backend.tensorflow import noise_scale as tf_noise_scale
from keras_fastgrad.backend.tensorflow import telemetry as tf_telemetry
from keras_fastgrad.backend.tensorflow.adaptive_clipping import adaptive_clip, before_gate
from keras_fastgrad.backend.tensorflow.applying import apply_if
from keras_fastgrad.backend.tensorflow.backward import gradients
from keras_fastgrad.backend.tensorflow.compile_loss import keep_output_loss_metrics
from keras_fastgrad.backend.tensorflow.gradients import scale
from keras_fastgrad.backend.tensorflow.replicas import (
    distributed,
    for_keras_reduction,
    global_metric_results,
    num_replicas,
    replica_sum,
)
from keras_fastgrad.backend.tensorflow.verdict import (
    finite_check,
    pool_batchnorm_moments,
    record_drop,
    record_small_batches,
    single_cond,
    update_loss_scale,
)
from keras_fastgrad.step import micro_batch
from keras_fastgrad.step import multitask as multitask_rules
from keras_fastgrad.step import telemetry as telemetry_rules
from keras_fastgrad.step import update as update_rules
from keras_fastgrad.step.accumulation import MicroBatch
from keras_fastgrad.step.metrics import tracked_weight

__all__ = [  # the chain, in order (`trainer.train_step`, `trainer.apply_partial_window`)
    "gradients",
    "finite_check",
    "pool_batchnorm_moments",
    "record_small_batches",
    "update_loss_scale",
    "single_cond",
    "update_or_drop",
    "accumulate_or_apply",
    "metrics_logs",
    "with_telemetry",
    "apply_partial_window",
]


# ------------------------------------------------- update (or accumulate)
def update_or_drop(model, state, batch, verdict):
    """One replica, no accumulation: the update and the metric updates,
    or the drop's bookkeeping, in a single `cond` (every `cond` costs a
    few ops per step, which shows on short steps); the metrics' results
    are read once, after it. Returns the metrics' logs."""

    divisor = _divisor(batch, verdict)
    agc = before_gate(model, state, batch.grads, divisor)  # None: in `update`

    def apply():
        update(model, state, batch.grads, divisor, norm=verdict.norm, agc=agc)
        _update_metric_states(model, batch)

    def drop():
        marks = verdict.marks
        if marks is None:  # the check was the norm: where, only if asked
            marks = functools.partial(finite.marks, batch.grads, batch.loss)
        record_drop(state, marks, verdict.counts_towards_streak)
        keep_output_loss_metrics(batch.output_metrics_before, False)

    tf.cond(verdict.keep, apply, drop)
    return model.get_metrics_result()


def accumulate_or_apply(model, state, batch, verdict):
    """Without accumulation: apply the (replica-summed) gradient, or record
    the drop. With it: add to the window, and apply the window once
    complete (every micro-batch kept, no strategy, dense gradients: both
    in one `cond`, as Keras' accumulation does,
    `WindowAccumulator.add_or_apply`). Where the drop is recorded is the
    core's (`micro_batch.drop_place`): in the other branch of a `cond` the
    step has anyway where it can, else at its own (`_Drops`)."""
    acc = state.accumulator
    drops = _Drops(state, verdict)
    place = micro_batch.before_update(drops, verdict.all_finite, acc is not None, not distributed())
    if acc is None:  # (ungated: non-finite gradients applied, as keras.Model does)
        update_args = (replica_sum(batch.grads), _divisor(batch, verdict))
        drop = (drops.drop, drops.args) if place == micro_batch.UPDATE else (None, ())
        apply_if(verdict.keep, functools.partial(update, model, state), update_args, *drop)
        return
    otherwise = None
    if place == micro_batch.WINDOW:  # (state written in the window's `cond`)
        otherwise = functools.partial(drops.drop, *drops.args)
    if verdict.keep is True and not distributed() and not _any_sparse(batch.grads):
        # Never left out (no gate): Keras' form, the update in the `cond`.
        tf_window.add_or_apply(
            acc,
            MicroBatch(batch.grads, verdict.global_normaliser, True, batch.mean_reduction),
            functools.partial(update, model, state),
        )
        return
    ready = tf_window.add(  # the window complete, holding an included micro-batch
        acc,
        MicroBatch(batch.grads, verdict.global_normaliser, verdict.keep, batch.mean_reduction),
        otherwise=otherwise,
    )
    apply_if(ready, functools.partial(apply_window, model, state))


class _Drops:
    """`micro_batch.before_update`'s shell: the micro-batch's drop
    (`record_drop`) written by `apply_if`, its marks and streak flag
    passed as arguments (global values, replica 0's read in cross-replica
    context)."""

    def __init__(self, state, verdict):
        self.gated, self.log_keys = verdict.drops_nonfinite, state.log_keys
        self.drop = functools.partial(record_drop, state)
        self.args = (verdict.marks, verdict.counts_towards_streak)

    def record_drop(self, where):
        apply_if(where, self.drop, args=self.args)


def _any_sparse(grads):
    """Whether a gradient is a `tf.IndexedSlices` (an `Embedding`'s)."""
    return any(isinstance(g, tf.IndexedSlices) for g in grads)


def _divisor(batch, verdict):
    """What the update divides the combined gradients by (`None`: they
    are the batch's gradient already)."""
    return verdict.global_normaliser if batch.mean_reduction else None


def apply_window(model, state):
    """Applies the accumulated window's gradient and empties it."""
    acc = state.accumulator
    update(model, state, tf_window.window_gradient(acc, state.no_gradient_template()))
    tf_window.reset(acc)


def flush(model, state):
    """Applies a partial window, if it holds samples, and restarts it."""
    tf_window.flush(state.accumulator, functools.partial(apply_window, model, state))


def apply_partial_window(model):
    """`FastGradModel.apply_partial_window` on TensorFlow: one traced flush
    of the window (`flush`: applied if it holds samples, then
    restarted) under the model's strategy. Returns the telemetry logs as
    Python floats, of the keys the core names
    (`step.telemetry.partial_window_keys`). Called by
    `models.partial_window` once a window is pending."""
    state = model.fastgrad_step_state
    if state.flush_function is None:
        # A `partial`, not a lambda: TF keys its retracing warning on a
        # function's code, shared by every model's lambda.
        state.flush_function = tf.function(
            functools.partial(model.distribute_strategy.run, flush, args=(model, state)),
            jit_compile=bool(model.jit_compile),
        )
    state.flush_function()
    keys = telemetry_rules.partial_window_keys(state)
    scale = state.scaling.current_scale()  # (and the partial window's noise scale)
    logs = state.telemetry.logs(scale, state.tape_variables or 0, keys, noise=state.noise_scale)
    return {k: float(v) for k, v in logs.items()}


def update(model, state, grads, normaliser=None, norm=None, agc=None):
    """[BatchNorm statistics] -> the update's chain (`step.update`: divide
    -> noise record -> adaptive clip -> clip -> check -> apply or drop ->
    records), on TensorFlow's primitives (`Update`).

    Runs in the update branch, in cross-replica context, on the global
    gradient (weighted sums divided by `normaliser` when it is given; by
    `divide_no_nan`, as Keras reduces a loss: a normaliser of 0, every
    sample weight 0 or every position masked, gives a zero gradient).
    `norm`: the gradient's norm as `(unit, root)` when the finite check
    was made on it (`Verdict.norm`): nothing left to check. `agc`: AGC
    computed before the update's `cond` (`adaptive_clipping.before_gate`).
    """
    if state.batchnorm is not None:  # the window's one step of the statistics
        tf_batchnorm.apply(state.batchnorm)
    shell = Update(model, state)
    own = state.accumulator is None and num_replicas() == 1
    prepared = update_rules.prepare(shell, grads, normaliser, norm, agc, own)
    update_rules.apply_or_drop(shell, prepared, lambda: finite.all_finite(prepared.grads))


class Update:
    """The update's primitives on TensorFlow (`step.update`'s shell): ops
    on (possibly sparse) gradients, `tf.cond`, writes into variables."""

    def __init__(self, model, state):
        self.model, self.state = model, state
        self.options, self.log_keys = state.options, state.log_keys
        # Without the gate (`skip_nonfinite=False`, no loss scaling) a
        # non-finite update is applied, as keras.Model does.
        self.gated = state.drops_nonfinite()

    scaled_norm = staticmethod(tf_clipping.scaled_norm)
    global_norm = staticmethod(tf_clipping.global_norm)
    scaled_by = staticmethod(tf_clipping.scaled_by)
    all_finite = staticmethod(finite.all_finite)

    def divided(self, grads, normaliser):
        return [scale(g, tf.math.divide_no_nan(1.0, normaliser)) for g in grads]

    def record_noise(self, grads):
        if self.state.noise_scale is not None:
            tf_noise_scale.record_window(self.state.noise_scale, grads)

    def adaptive_clip(self, grads, computed):
        return adaptive_clip(self.model, self.state, grads, computed)

    def record_gradient(self, grads):
        self.state.telemetry.record_layer_norms(grads)

    def branch(self, pred, applied, dropped):
        if pred is None:
            applied()
        else:
            tf.cond(pred, applied, dropped)

    def apply(self, grads, factor):
        state, variables = self.state, self.model.trainable_variables
        before = state.telemetry.snapshot(variables)
        state.scaling.apply(grads, variables)
        if state.accumulator is not None:  # growth counts updates
            state.scaling.record_update()
        state.telemetry.record_update_ratio(before, variables)

    def record(self, change, where=None):
        if where is None:
            tf_telemetry.record(self.state, change)
        else:
            apply_if(where, lambda: tf_telemetry.record(self.state, change))


# ------------------------------------------------------ metrics and logs
def metrics_logs(model, keep, batch):
    """Keras' `loss` tracker and metrics, left unchanged by a dropped
    micro-batch (its NaN would make them NaN for the rest of the epoch),
    as global results: one `cond`, in replica context."""
    keep_output_loss_metrics(batch.output_metrics_before, keep)
    if type(model).compute_metrics is not keras.Model.compute_metrics:
        # A user override may return other keys: call it as Keras does.
        _track_loss(model, batch, keep)  # (a dropped micro-batch adds nothing)
        logs = model.compute_metrics(
            batch.x, batch.y, batch.y_pred, sample_weight=batch.sample_weight
        )
    else:
        if keep is True:  # nothing is ever dropped: no `cond`
            _update_metric_states(model, batch)
        else:
            tf.cond(keep, lambda: _update_metric_states(model, batch), lambda: None)
        logs = model.get_metrics_result()
    return global_metric_results(model.metrics, logs)


def _update_metric_states(model, batch):
    """Keras' `loss` tracker and compiled metrics of a kept micro-batch,
    without reading the results (read once, after the `cond`)."""
    _track_loss(model, batch)
    compat.update_compiled_metrics(model, batch.y, batch.y_pred, batch.sample_weight)


def _track_loss(model, batch, keep=True):
    """Keras' `loss` tracker: the micro-batch's loss, weighted by its rows
    as Keras' `train_step` weights it (`step.metrics.tracked_weight`: one
    `maximum`, an op on every step); loss and weight 0 where `keep` is
    false (a tensor)."""
    loss = compat.unscale_loss_for_distribution(batch.loss)
    weight = tracked_weight(batch.num_samples, tf.maximum)
    if keep is not True:
        loss, weight = tf.where(keep, loss, 0.0), tf.where(keep, weight, 0.0)
    compat.loss_tracker(model).update_state(loss, sample_weight=weight)


def with_telemetry(state, logs):
    """The step's logs plus the requested telemetry keys and a multi-task
    model's task keys (`step.multitask.logged_task_keys`); their names
    recorded in `state.telemetry_names` (the train function carries them
    packed, `keras_fastgrad.step.log_packing`)."""
    measured = {}
    if state.log_keys:
        measured = state.telemetry.logs(
            state.scaling.current_scale(), state.tape_variables, state.log_keys, state.noise_scale
        )
    if state.merger is not None:  # task keys, from the Gram matrix
        measured.update(multitask_rules.logged_task_keys(state.log_keys, state.merger.logs))
    state.telemetry_names = tuple(measured)
    logs.update(measured)
    return for_keras_reduction(logs)
