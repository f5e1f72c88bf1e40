"""The units of `FastGradModel.train_step`, in the order the step runs them.

    gradients -> finite_check -> pool_batchnorm_moments -> update_loss_scale
              -> update_or_drop                              (one `cond`)
              or accumulate_or_apply -> update
    then metrics and telemetry logs

Each takes the model (its options, its call and compiled loss) and its
`StepState` explicitly and does one thing; the maths is in the modules they
call (`weighting`, `loss_scaling`, `finite`, `accumulation`, `clipping`,
`applying`, `multitask`, `slicing`).
"""

import collections
import contextlib
import functools
import warnings

import keras
import tensorflow as tf

from keras_fastgrad import _compat as compat
from keras_fastgrad.multitask import feature_space
from keras_fastgrad.multitask.merger import regularization_loss, task_losses, task_names
from keras_fastgrad.step import finite, noise_scale
from keras_fastgrad.step.adaptive_clipping import adaptive_clip, both_finite
from keras_fastgrad.step.applying import apply_if
from keras_fastgrad.step.clipping import clip_by_global_norm, fits_clip, scaled_norm
from keras_fastgrad.step.divergence import failed
from keras_fastgrad.step.forward import call_for_training, watching
from keras_fastgrad.step.gradients import scale
from keras_fastgrad.step.replicas import (
    for_keras_reduction,
    global_metric_results,
    num_replicas,
    replica_sum,
)
from keras_fastgrad.step.slicing import first_input, sliced_gradients
from keras_fastgrad.step.weighting import LossShares


class Batch(
    collections.namedtuple(
        "Batch",
        [
            "loss",
            "y_pred",
            "grads",
            "x",
            "y",
            "sample_weight",
            "num_samples",
            "normaliser",
            "mean_reduction",
            "small_batches",
        ],
        defaults=(None,),
    )
):
    """What the forward and backward pass of one micro-batch produced.

    Fields:
        loss, y_pred: The loss (as Keras computes it) and the predictions.
        grads: The gradients, unscaled; where micro-batches are combined
            (accumulation, replicas, slices) multiplied by the micro-batch's
            normaliser `D_j` (`weighting`), so that they add up.
        x, y, sample_weight: The micro-batch (the metrics read them).
        num_samples: float32, its rows (the `loss` tracker's weight).
        normaliser: float32 `D_j` on this replica (1 when not combined).
        mean_reduction: Python bool, whether the combined gradients are
            divided by the summed normalisers (`False`: `reduction="sum"`,
            or nothing combined).
        small_batches: The `noise_scale.small_batch` measures of this
            replica's micro-batch (or of its slices, summed); `None` unless
            the noise scale is measured."""


class Verdict(
    collections.namedtuple(
        "Verdict",
        [
            "marks",
            "all_finite",
            "keep",
            "drops_nonfinite",
            "counts_towards_streak",
            "global_normaliser",
            "norm",
        ],
    )
):
    """The finite check of one micro-batch, global over replicas.

    Fields:
        marks: The `finite.marks` vector (where the check failed), or
            `None` when the check was the gradient's norm (`norm`).
        all_finite: Boolean scalar: loss and gradients finite everywhere.
        keep: Boolean scalar: the gradient goes on (`all_finite`, or always
            when non-finite gradients are applied, as `keras.Model` does).
        drops_nonfinite: Python bool: a non-finite micro-batch is dropped
            (`skip_nonfinite`, or loss scaling).
        counts_towards_streak: Boolean scalar, whether a drop counts towards
            the divergence streak (loss scaling: only at the lowest scale);
            `None`: every drop counts.
        global_normaliser: float32, the normaliser summed over replicas.
        norm: `None`, or the gradient's global norm as `(unit, root)`
            (`clipping.scaled_norm`) when the check was made on it: one
            replica, no accumulation, and the update needs the norm anyway
            (`clip_norm`, or `grad_norm` logged). The norm is finite
            exactly when every gradient is (its squares never overflow), so
            it replaces the per-gradient sums; `keep` then also requires
            a clip factor that is a normal float (`clipping.fits_clip`)."""


# ------------------------------------------------------------ gradients
def gradients(model, state, x, y, sample_weight):
    """Forward and backward (whole batch, or `micro_batches` slices); the
    gradients unscaled and, where micro-batches are combined (accumulation,
    replicas, slices), weighted by the micro-batch's share of the window
    (`weighting`: folded into the loss). Returns a `Batch`."""
    with _recording_batchnorm(state):
        return _gradients(model, state, x, y, sample_weight)


def _gradients(model, state, x, y, sample_weight):
    variables = model.trainable_variables
    if not variables:
        warnings.warn("The model does not have any trainable weights.")
    first = _first_input(model, x)
    if "input_shape_changes" in state.log_keys:  # only when read
        state.telemetry.record_input_shape(first)
    num_rows = tf.shape(first)[0]
    weighted = state.accumulator is not None or num_replicas() > 1 or model.micro_batches > 1
    measure = state.noise_scale is not None
    if model.micro_batches > 1:
        _check_slices(model, x)
        loss, y_pred, grads, share, *small = sliced_gradients(
            model,
            x,
            y,
            sample_weight,
            variables,
            state.scaling,
            model.micro_batches,
            merger=state.merger,
            measure=noise_scale.slice_measure() if measure else None,
        )
    else:
        loss, y_pred, grads, share = _batch_gradients(
            model, state, x, y, sample_weight, variables, num_rows if weighted else None
        )
        small = [_small_batch(grads, num_rows, share)] if measure else []
    if measure:
        noise_scale.check_batch(sample_weight, share.mean)
    state.record_trace_facts(variables, grads)
    return Batch(
        loss=loss,
        y_pred=y_pred,
        grads=grads,
        x=x,
        y=y,
        sample_weight=sample_weight,
        num_samples=tf.cast(num_rows, tf.float32),
        normaliser=share.real if weighted else tf.constant(1.0),
        mean_reduction=weighted and share.mean,
        small_batches=small[0] if small else None,
    )


def _small_batch(grads, num_rows, share):
    """The noise scale's measures of the micro-batch (one small batch)."""
    return noise_scale.small_batch(grads, tf.cast(num_rows, tf.float32), share.actual)


def _recording_batchnorm(state):
    """While the forward pass is traced: BatchNorm moments recorded, the
    moving statistics held (`batchnorm.WindowMoments`), when pooled."""
    if state.batchnorm is None:
        return contextlib.nullcontext()
    return state.batchnorm.recording()


def _batch_gradients(model, state, x, y, sample_weight, variables, num_rows):
    """Forward and backward on the whole batch (one tape); with
    `multitask`, the task gradients merged. Returns `(loss, y_pred, grads,
    share)`: the gradients unscaled and, when `num_rows` is given
    (micro-batches are combined), multiplied by the micro-batch's share
    (`weighting.LossShares`; `share` is `None` otherwise)."""
    shares = None if num_rows is None else LossShares(model, num_rows)
    backward = _loss_gradients if state.merger is None else _merged_task_gradients
    return backward(model, state, x, y, sample_weight, variables, shares)


def _loss_gradients(model, state, x, y, sample_weight, variables, shares):
    """The model's loss and its gradient (see `_batch_gradients`)."""
    scaling = state.scaling
    with watching(variables) as tape:
        y_pred = call_for_training(model, x)
        with shares or contextlib.nullcontext():
            loss = compat.compute_loss(model, x, y, y_pred, sample_weight)
        share = None if shares is None else shares.share()
        weight = None if share is None else share.loss_weight(num_replicas())
        scaled_loss = scaling.scale(loss, weight)
    grads = tape.gradient(scaled_loss, [v.value for v in variables])
    return loss, y_pred, scaling.unscale(grads, weight), share


def _merged_task_gradients(model, state, x, y, sample_weight, variables, shares):
    """One loss per task (regularisation is not a task), each task's
    gradient unscaled once, then merged (see `_batch_gradients`)."""
    scaling, merger = state.scaling, state.merger
    with watching(variables, persistent=True) as tape:
        features = feature_space.capture(model, tape)  # no-op unless "features"
        with features:
            y_pred = call_for_training(model, x)
        with shares or contextlib.nullcontext():
            tasks = task_losses(model, y, y_pred, sample_weight)
            regularization = regularization_loss(model)
            loss = tf.add_n(tasks + [r for r in [regularization] if r is not None])
        share = None if shares is None else shares.share()
        weight = None if share is None else share.loss_weight(num_replicas())
        scaled_tasks = [scaling.scale(t, weight) for t in tasks]
        if regularization is not None:
            regularization = scaling.scale(regularization, weight)
    merge = features.merger(merger) if features.active else merger
    grads, _ = merge(
        tape,
        scaled_tasks,
        regularization,
        variables,
        unscale=lambda g: scaling.unscale(g, weight),
        share=None if share is None else share.actual,
        task_names=task_names(model),
    )
    return loss, y_pred, grads, share


def _first_input(model, x):
    """The batch's first input tensor (its rows are the batch size)."""
    try:
        return first_input(x)  # a `ValueError` when `x` holds no tensor
    except ValueError:
        # Keras' own error first where it has one (a required input is
        # `None`: "not optional"), as `keras.Model` raises it.
        call_for_training(model, x)
        raise


def _check_slices(model, x):
    batch = first_input(x).shape[0]
    if batch is not None and batch < model.micro_batches:
        raise ValueError(
            "`micro_batches` must not exceed the batch size (each slice "
            f"needs a sample). Received: micro_batches={model.micro_batches} "
            f"for a batch of {batch}. Fix: a larger `batch_size` or fewer "
            "`micro_batches`."
        )


# --------------------------------------------------------- finite check
def finite_check(model, state, batch):
    """Is the micro-batch finite (on every replica: one small all-reduce,
    so every replica decides alike)? Returns a `Verdict`."""
    if _checks_norm(model, state, batch):
        return _norm_check(model, state, batch)
    scaling = state.scaling
    marks = finite.marks(batch.grads, batch.loss)
    total = batch.normaliser
    if num_replicas() > 1:
        flags, total = replica_sum([finite.to_flags(marks), total])
        marks = finite.from_flags(flags)
    all_finite = finite.is_finite(marks)
    drops = model.skip_nonfinite or scaling.active  # keep == finite
    return Verdict(
        marks=marks,
        all_finite=all_finite,
        keep=all_finite if drops else tf.constant(True),
        drops_nonfinite=drops,
        # At the scale the micro-batch was checked at (before the update).
        counts_towards_streak=failed(all_finite, scaling) if scaling.active else None,
        global_normaliser=total,
        norm=None,
    )


def _checks_norm(model, state, batch):
    """Whether the check is the norm the update computes anyway: the
    update is the micro-batch's own gradient as it is (`single_cond`, not
    divided by a normaliser: no `micro_batches`), and clipping or the
    `grad_norm` key needs its norm."""
    wanted = model.clip_norm is not None or "grad_norm" in state.log_keys
    # With `clip_adaptive` the update's norm is the adaptively clipped one.
    wanted = wanted and model.clip_adaptive is None
    return wanted and not batch.mean_reduction and single_cond(model, state)


def _norm_check(model, state, batch):
    """The finite check folded into the gradient's norm: one `L2Loss` per
    gradient instead of one `Sum`, and no second check in the update."""
    scaling = state.scaling
    norm = scaled_norm(batch.grads)
    all_finite = tf.math.is_finite(norm[1]) & tf.math.is_finite(batch.loss)
    keep = all_finite
    counts = failed(all_finite, scaling) if scaling.active else None
    if model.clip_norm is not None:
        keep = all_finite & fits_clip(model.clip_norm, *norm)
        if counts is not None:  # a refused clip factor always counts
            counts = counts | (all_finite & tf.logical_not(keep))
    return Verdict(
        marks=None,
        all_finite=all_finite,
        keep=keep,
        drops_nonfinite=True,
        counts_towards_streak=counts,
        global_normaliser=batch.normaliser,
        norm=norm,
    )


def record_small_batches(state, batch, verdict):
    """The noise scale's small batches (a no-op unless it is measured):
    added to the window unless the micro-batch is not finite."""
    if state.noise_scale is not None:
        state.noise_scale.record_small(batch.small_batches, verdict.all_finite)


def pool_batchnorm_moments(state, verdict):
    """The micro-batch's BatchNorm moments (pooled over replicas) into
    the window, unless it is dropped (a no-op unless they are pooled)."""
    if state.batchnorm is not None:
        state.batchnorm.end_micro_batch(verdict.keep)


def update_loss_scale(state, verdict):
    """Loss scaling's own rule: halve after a non-finite micro-batch,
    double after `dynamic_growth_steps` finite ones (a no-op without)."""
    state.scaling.update(verdict.all_finite)


# The telemetry keys that say where a dropped micro-batch went bad.
_WHERE_KEYS = frozenset({"nonfinite_first_index", "nonfinite_num_variables"})


def record_drop(model, state, marks, counts=None):
    """Bookkeeping of a non-finite micro-batch (in the branch that runs
    only then): the count, where it went bad (when requested), and the
    divergence streak.

    Args:
        marks: The micro-batch's (global) `finite.marks` vector, or a
            callable that computes it (only called when its keys are
            requested).
        counts: Boolean scalar, whether the drop counts towards the streak
            (`divergence.failed`, under loss scaling); `None`: it does.
    """
    if state.log_keys & _WHERE_KEYS:  # only read then (see `telemetry`)
        state.telemetry.record_drop(*finite.summarize(marks() if callable(marks) else marks))
    else:
        state.telemetry.record_drop()
    if model.skip_nonfinite or state.scaling.active:
        state.divergence.record_drop(counts)


# ------------------------------------------------- update (or accumulate)
def single_cond(model, state):
    """One replica, no accumulation, default metrics: the update and the
    metrics share one `cond` (`update_or_drop`)."""
    return (
        state.accumulator is None
        and (model.skip_nonfinite or state.scaling.active)
        and num_replicas() == 1
        and type(model).compute_metrics is keras.Model.compute_metrics
    )


def update_or_drop(model, state, batch, verdict):
    """One replica, no accumulation: the update and the metric updates,
    or the drop's bookkeeping, in a single `cond` (every `cond` costs a
    few ops per step, which shows on short steps); the metrics' results
    are read once, after it. Returns the metrics' logs."""

    def apply():
        update(model, state, batch.grads, _divisor(batch, verdict), norm=verdict.norm)
        _update_metric_states(model, batch)

    def drop():
        marks = verdict.marks
        if marks is None:  # the check was the norm: where, only if asked
            marks = functools.partial(finite.marks, batch.grads, batch.loss)
        record_drop(model, state, marks, verdict.counts_towards_streak)

    tf.cond(verdict.keep, apply, drop)
    return model.get_metrics_result()


def accumulate_or_apply(model, state, batch, verdict):
    """Without accumulation: apply the (replica-summed) gradient, or record
    the drop. With it: add to the window, and apply the window once
    complete. Drop bookkeeping rides in the other branch of a `cond` the
    step has anyway, where it can."""
    acc = state.accumulator
    drop = functools.partial(record_drop, model, state)
    drop_args = (verdict.marks, verdict.counts_towards_streak)
    not_finite = tf.logical_not(verdict.all_finite)
    if acc is None:
        apply = functools.partial(update, model, state)
        update_args = (replica_sum(batch.grads), _divisor(batch, verdict))
        if verdict.drops_nonfinite:
            apply_if(
                verdict.keep, apply, args=update_args, otherwise=drop, otherwise_args=drop_args
            )
        else:  # non-finite gradients are applied, as keras.Model does
            apply_if(not_finite, drop, args=drop_args)
            apply_if(verdict.keep, apply, args=update_args)
        return
    otherwise = None
    if verdict.drops_nonfinite and num_replicas() == 1:
        otherwise = functools.partial(drop, *drop_args)
    else:
        apply_if(not_finite, drop, args=drop_args)
    window_complete = acc.add(
        batch.grads,
        verdict.global_normaliser,
        verdict.keep,
        mean_reduction=batch.mean_reduction,
        otherwise=otherwise,
    )
    apply_if(
        tf.logical_and(window_complete, acc.has_samples()),
        functools.partial(apply_window, model, state),
    )


def _divisor(batch, verdict):
    """What the update divides the combined gradients by (`None`: they
    are the batch's gradient already)."""
    return verdict.global_normaliser if batch.mean_reduction else None


def apply_window(model, state):
    """Applies the accumulated window's gradient and empties it."""
    acc = state.accumulator
    update(model, state, acc.window_gradient(state.no_gradient_template()))
    acc.reset()


def flush(model, state):
    """Applies a partial window, if it holds samples, and restarts it."""
    apply_if(state.accumulator.has_samples(), functools.partial(apply_window, model, state))
    state.accumulator.restart()


def update(model, state, grads, normaliser=None, norm=None):
    """[BatchNorm statistics] -> normalise -> adaptive clip -> clip -> check
    -> apply -> record.

    Runs in the update branch, in cross-replica context, on the global
    gradient (weighted sums divided by `normaliser` when it is given; by
    `divide_no_nan`, as Keras reduces a loss: a normaliser of 0, every
    sample weight 0 or every position masked, gives a zero gradient).
    `norm`: the gradient's norm as `(unit, root)` when the finite check
    was made on it (`Verdict.norm`): nothing left to check.
    """
    if state.batchnorm is not None:  # the window's one step of the statistics
        state.batchnorm.apply()
    checked = norm is not None or (
        normaliser is None and model.clip_norm is None and _checked_as_is(model, state)
    )
    if normaliser is not None:
        grads = [scale(g, tf.math.divide_no_nan(1.0, normaliser)) for g in grads]
    if state.noise_scale is not None:  # the big batch: unscaled, unclipped
        state.noise_scale.record_window(grads)
    grads, agc_finite = adaptive_clip(model, state, grads)  # (grads, None) when off
    grads, norm, was_clipped = _clipped(model, state, grads, norm)
    checked = checked or (agc_finite is not None and model.clip_norm is None)
    finite_update = None if checked else _finite_update(model, state, grads, norm)
    finite_update = both_finite(finite_update, agc_finite)
    _apply_if_finite(model, state, grads, finite_update, norm, was_clipped)


def _checked_as_is(model, state):
    """Whether the update's gradient is the micro-batch's own, already
    checked and dropped when not finite (one replica, no accumulation, the
    gradient not divided). Clipping keeps a finite gradient finite (the
    factor is computed without overflow, `clipping.clip_factor`), so the
    update then needs no check of its own: no `cond` but the step's one."""
    return (
        state.accumulator is None
        and num_replicas() == 1
        and (model.skip_nonfinite or state.scaling.active)
    )


def _clipped(model, state, grads, scaled=None):
    """The gradient clipped to `clip_norm` (if set) and its norm before
    (`None` when neither clipping nor `grad_norm` needs it); `scaled`: the
    norm as `(unit, root)`, when already computed."""
    norm = was_clipped = None
    if "grad_norm" in state.log_keys or model.clip_norm is not None:
        unit, root = scaled or scaled_norm(grads)
        norm = unit * root
    state.telemetry.record_layer_norms(grads)
    if model.clip_norm is not None:
        grads, was_clipped = clip_by_global_norm(grads, model.clip_norm, (unit, root))
    return grads, norm, was_clipped


def _finite_update(model, state, grads, norm):
    """Whether the update is finite (`None`: known to be). Each micro-batch
    was finite, but a window's or the replicas' sum of finite gradients can
    overflow: checked right before the update (free with clipping: the norm
    is finite iff they all are)."""
    if model.clip_norm is not None:
        # Finite, and the clip factor `clip_norm / norm` a normal float: a
        # norm beyond `clip_norm / tiny` (~1e38) would make it flush to 0
        # on CPU, a silently zero update; such an update is dropped, counted.
        return tf.math.is_finite(norm) & fits_clip(model.clip_norm, 1.0, norm)
    if state.accumulator is not None or num_replicas() > 1:
        return finite.all_finite(grads)
    return None  # the micro-batch check covered these


def _apply_if_finite(model, state, grads, finite_update, norm, was_clipped):
    """The optimizer step and its records, or the drop's."""
    telemetry, variables = state.telemetry, model.trainable_variables

    def apply():
        before = telemetry.snapshot(variables)
        state.scaling.apply(grads, variables)
        telemetry.record_update_ratio(before, variables)
        telemetry.record_update(norm, was_clipped)
        state.divergence.record_update()

    def drop():
        telemetry.record_dropped_update()
        state.divergence.record_drop()

    if finite_update is None:
        apply()
    else:
        tf.cond(finite_update, apply, drop)


# ------------------------------------------------------ metrics and logs
def metrics_logs(model, keep, batch):
    """Keras' `loss` tracker and metrics, left unchanged by a dropped
    micro-batch (its NaN would make them NaN for the rest of the epoch),
    as global results: one `cond`, in replica context."""
    loss = compat.unscale_loss_for_distribution(batch.loss)
    if type(model).compute_metrics is not keras.Model.compute_metrics:
        # A user override may return other keys: call it as Keras does.
        logs = _update_metrics(
            model, batch, tf.where(keep, loss, 0.0), tf.where(keep, batch.num_samples, 0.0)
        )
    else:
        tf.cond(keep, lambda: _update_metric_states(model, batch), lambda: None)
        logs = model.get_metrics_result()
    return global_metric_results(model.metrics, logs)


def _update_metric_states(model, batch):
    """What `_update_metrics` does for Keras' own `compute_metrics`,
    without reading the results (read once, after the `cond`)."""
    compat.loss_tracker(model).update_state(
        compat.unscale_loss_for_distribution(batch.loss), sample_weight=batch.num_samples
    )
    compat.update_compiled_metrics(model, batch.y, batch.y_pred, batch.sample_weight)


def _update_metrics(model, batch, loss, num_samples=None):
    """Keras' `loss` tracker (weighted by the batch size, as Keras'
    `train_step` does) and compiled metrics; returns the logs."""
    compat.loss_tracker(model).update_state(
        loss, sample_weight=batch.num_samples if num_samples is None else num_samples
    )
    return model.compute_metrics(batch.x, batch.y, batch.y_pred, sample_weight=batch.sample_weight)


def with_telemetry(state, logs):
    """The step's logs plus the requested telemetry keys."""
    if state.log_keys:
        measured = state.telemetry.logs(
            state.scaling.current_scale(), state.tape_variables, keys=state.log_keys
        )
        logs.update(measured)
        if state.merger is not None:  # task keys, from the Gram matrix
            logs.update(state.merger.logs())
        if state.noise_scale is not None:
            logs.update({k: v for k, v in state.noise_scale.logs().items() if k in state.log_keys})
    return for_keras_reduction(logs)
