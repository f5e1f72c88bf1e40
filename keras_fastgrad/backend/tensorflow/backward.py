"""One micro-batch's forward and backward pass: a `Batch`.

The first unit of the step (`train_step`): the forward pass (whole batch,
or `micro_batches` slices: `slicing`), the loss (weighted by the
micro-batch's share of the window where micro-batches are combined:
`weighting`), the gradients of exactly the trainable variables
(`forward.watching`), unscaled (`loss_scaling`), with `multitask` the task
gradients merged (the task losses: `task_losses`; the merge: `state.merger`,
an object the step is handed, `keras_fastgrad.multitask.TaskMerger`: the
step never imports `multitask`); BatchNorm moments recorded (`batchnorm`)
and the noise scale's small-batch measures taken (`noise_scale`) when on.
"""

import collections
import contextlib
import warnings

from keras_fastgrad._tf_startup import tf
from keras_fastgrad.backend.tensorflow import batchnorm as tf_batchnorm
from keras_fastgrad.backend.tensorflow import noise_scale as tf_noise_scale
from keras_fastgrad.backend.tensorflow.compile_loss import output_loss_metrics
from keras_fastgrad.backend.tensorflow.forward import call_for_training, watching
from keras_fastgrad.backend.tensorflow.replicas import (
    num_replicas,
)
from keras_fastgrad.backend.tensorflow.slicing import sliced_gradients
from keras_fastgrad.step import noise_scale
from keras_fastgrad.step.compile_loss import check_extra_terms, loss_terms, present_terms
from keras_fastgrad.step.splitting import first_input
from keras_fastgrad.step.task_losses import regularization_loss, task_losses, task_names
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
            "output_metrics_before",
        ],
        defaults=(None, ()),
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
            the noise scale is measured.
        output_metrics_before: `compile_loss.output_loss_metrics`' pairs
            (Keras' per-output loss metrics before this micro-batch), for
            `keep_output_loss_metrics` when it is dropped."""


def gradients(model, state, x, y, sample_weight):
    """Forward and backward (whole batch, or `micro_batches` slices); the
    gradients unscaled and, where micro-batches are combined (accumulation,
    replicas, slices), weighted by the micro-batch's share of the window
    (`weighting`: folded into the loss). Returns a `Batch`."""
    with _recording_batchnorm(state), output_loss_metrics(model) as before:
        batch = _gradients(model, state, x, y, sample_weight)
    return batch._replace(output_metrics_before=tuple(before))


def _gradients(model, state, x, y, sample_weight):
    variables = model.trainable_variables
    if not variables:
        warnings.warn("The model does not have any trainable weights.")
    first = _first_input(model, x)
    if "input_shape_changes" in state.log_keys:  # only when read
        state.telemetry.record_input_shape(first)
    num_rows = tf.shape(first)[0]
    slices = state.options.micro_batches
    weighted = state.accumulator is not None or num_replicas() > 1 or slices > 1
    measure = state.noise_scale is not None
    if slices > 1:
        loss, y_pred, grads, share, *small = sliced_gradients(
            model,
            x,
            y,
            sample_weight,
            variables,
            state.scaling,
            slices,
            merger=state.merger,
            measure=tf_noise_scale.slice_measure() if measure else None,
            options=state.options.combining(),
        )
    else:
        loss, y_pred, grads, share = _batch_gradients(
            model, state, x, y, sample_weight, variables, num_rows if weighted else None
        )
        small = [_small_batch(grads, num_rows, share)] if measure else []
    if measure:
        noise_scale.check_batch(sample_weight, share.mean)
    state.record_trace_facts(variables, grads, traced=not tf.executing_eagerly())
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
    return tf_noise_scale.small_batch(grads, tf.cast(num_rows, tf.float32), share.actual)


def _recording_batchnorm(state):
    """While the forward pass is traced: BatchNorm moments recorded, the
    moving statistics held (`batchnorm.WindowMoments`), when pooled."""
    if state.batchnorm is None:
        return contextlib.nullcontext()
    return tf_batchnorm.recording(state.batchnorm)


def _batch_gradients(model, state, x, y, sample_weight, variables, num_rows):
    """Forward and backward on the whole batch (one tape; with `multitask`
    a persistent one, one loss per task, regularisation not a task, each
    task's gradient unscaled once, then merged). Returns `(loss, y_pred,
    grads, share)`: the gradients unscaled and, when `num_rows` is given
    (micro-batches are combined), multiplied by the micro-batch's share
    (`weighting.LossShares`; `share` is `None` otherwise)."""
    shares = None if num_rows is None else LossShares(model, num_rows)
    scaling, merger, merged = state.scaling, state.merger, state.merger is not None
    with watching(variables, persistent=merged) as tape:
        # (in features space the merger captures `Z`; a no-op otherwise)
        features = contextlib.nullcontext() if merger is None else merger.capture(model, tape)
        with features:
            y_pred = call_for_training(model, x)
        with shares or contextlib.nullcontext():
            loss, losses, terms = _losses(model, x, y, y_pred, sample_weight, merged)
        share = None if shares is None else shares.share()
        if share is not None and state.accumulator is not None:
            check_extra_terms(model, share, state.options.combining(), terms, merged=merged)
        weight = None if share is None else share.loss_weight(num_replicas())
        scaled = [None if l is None else scaling.scale(l, weight) for l in losses]
    if not merged:
        grads = scaling.unscale(tape.gradient(scaled[0], [v.value for v in variables]), weight)
    else:
        grads, _ = features.merge(
            tape,
            scaled[:-1],
            scaled[-1],
            variables,
            unscale=lambda g: scaling.unscale(g, weight),
            share=None if share is None else share.actual,
            task_names=task_names(model),
        )
    return loss, y_pred, grads, share


def _losses(model, x, y, y_pred, sample_weight, merged):
    """`(loss, losses, terms)`: the batch's loss as Keras computes it, the
    losses the gradient is taken of (the loss; merged, each task's and the
    regularisation's, `None` without one) and the loss's
    `compile_loss.LossTerms` (merged: `present_terms`)."""
    if not merged:
        terms = loss_terms(model, x, y, y_pred, sample_weight)
        return terms.total, [terms.total], terms
    tasks = task_losses(model, y, y_pred, sample_weight)
    regularization = regularization_loss(model)
    loss = tf.add_n(tasks + [r for r in [regularization] if r is not None])
    return loss, tasks + [regularization], present_terms(model)


def _first_input(model, x):
    """The batch's first input tensor (its rows are the batch size)."""
    try:
        return first_input(x)  # a `ValueError` when `x` holds no tensor
    except ValueError:
        # Keras' own error first where it has one (a required input is
        # `None`: "not optional"), as `keras.Model` raises it.
        call_for_training(model, x)
        raise
