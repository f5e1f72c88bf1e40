"""The finite check of one micro-batch on TensorFlow: a `Verdict` (keep or drop).

The rules are the core's (`keras_fastgrad.step.verdict`); this shell says
how on TensorFlow: global over replicas (one small all-reduce); folded into the gradient's
norm where the update needs that norm anyway (`clip_norm` on one replica
without accumulation). Also the bookkeeping that follows
the verdict outside the update's `cond`: the loss-scale update, BatchNorm
moments and noise-scale measures of a kept micro-batch, and (in the drop
branch) `record_drop`.
"""

from keras_fastgrad._tf_startup import tf
from keras_fastgrad.backend.tensorflow import batchnorm as tf_batchnorm
from keras_fastgrad.backend.tensorflow import finite
from keras_fastgrad.backend.tensorflow import noise_scale as tf_noise_scale
from keras_fastgrad.backend.tensorflow import telemetry as tf_telemetry
from keras_fastgrad.backend.tensorflow.clipping import scaled_norm
from keras_fastgrad.backend.tensorflow.replicas import (
    distributed,
    num_replicas,
    replica_sum,
)
from keras_fastgrad.maths.norms import fitted
from keras_fastgrad.step import micro_batch
from keras_fastgrad.step import verdict as rules
from keras_fastgrad.step.divergence import counts_as_failure
from keras_fastgrad.step.verdict import Verdict


def finite_check(state, batch):
    """Is the micro-batch finite (on every replica: one small all-reduce,
    so every replica decides alike)? Returns a `Verdict`.

    The check is the gradient's norm where the update computes it anyway
    (`verdict.checks_norm`: the update is the micro-batch's own gradient
    as it is, `single_cond`, not divided by a normaliser): one `L2Loss`
    per gradient instead of one `Sum`, and no second check in the update.
    Else each gradient's element sum (`finite.marks`), or nothing at all
    where nothing is dropped and no key reads the count."""
    drops, total = state.drops_nonfinite(), batch.normaliser
    marks = norm = fits = None
    own = not batch.mean_reduction and single_cond(state)
    if rules.checks_norm(state.options.clip_norm, state.options.clip_adaptive, own):
        scaled = scaled_norm(batch.grads)
        all_finite = rules.norm_finite(scaled, tf.math.is_finite(batch.loss))
        # A refused clip factor (`fits_clip`) drops the update, and counts; the
        # update clips by the norm this check computed (`maths.norms.fitted`).
        fits, norm = fitted(state.options.clip_norm, *scaled)
    elif not rules.checks(drops, state.log_keys):
        # Nothing is dropped and no key reads the count (`nonfinite_*`: as
        # `keras.Model`, no check at all, `keep` the Python `True`;
        # `telemetry=True` or NonFiniteGuard switch the count on).
        all_finite, (total,) = True, replica_sum([total])
    else:
        marks = finite.marks(batch.grads, batch.loss)
        if num_replicas() > 1:
            flags, total = replica_sum([finite.to_flags(marks), total])
            marks = finite.from_flags(flags)
        all_finite = finite.is_finite(marks)
    # The streak counts at the scale the micro-batch was checked at.
    keep, counts = rules.keep(all_finite, fits, _failed(all_finite, state.scaling))
    return Verdict(marks, all_finite, micro_batch.kept(keep, drops), drops, counts, total, norm)


def _failed(all_finite, scaling):
    """`divergence.counts_as_failure` at the scale the micro-batch was
    checked at (before the update); `None` without loss scaling (every drop
    counts; nothing unchecked is ever under it)."""
    if not scaling.active:
        return None
    return counts_as_failure(all_finite, scaling.current_scale())


def record_small_batches(state, batch, verdict):
    """The noise scale's small batches (a no-op unless it is measured):
    added to the window unless the micro-batch is not finite."""
    if state.noise_scale is not None:
        tf_noise_scale.record_small(state.noise_scale, batch.small_batches, verdict.all_finite)


def pool_batchnorm_moments(state, verdict):
    """The micro-batch's BatchNorm moments (pooled over replicas) into
    the window, unless it is dropped (a no-op unless they are pooled)."""
    if state.batchnorm is not None:
        tf_batchnorm.end_micro_batch(state.batchnorm, verdict.keep)


def update_loss_scale(state, verdict):
    """Loss scaling's own rule: halve after a non-finite micro-batch,
    double after `dynamic_growth_steps` finite updates (a no-op without).
    Under accumulation a micro-batch is not an update: growth is counted
    when the window is applied (`micro_batch.grows_per_micro_batch`,
    `LossScaling.record_update`)."""
    growth = micro_batch.grows_per_micro_batch(state.accumulator is not None)
    state.scaling.update(verdict.all_finite, counts_growth=growth)


def record_drop(state, marks, counts=None):
    """`micro_batch.dropped`'s change of a non-finite micro-batch, written
    in the branch that runs only then (the count, where it went bad while
    asked, the divergence streak).

    Args:
        marks: The micro-batch's (global) `finite.marks` vector, or a
            callable that computes it (only called when its keys are
            requested).
        counts: Boolean scalar, whether the drop counts towards the streak
            (`divergence.counts_as_failure`, under loss scaling); `None`: it does.
    """
    change = micro_batch.dropped(state.log_keys, marks, counts, state.drops_nonfinite())
    tf_telemetry.record(state, change)


def single_cond(state):
    """No strategy, no accumulation, default metrics: the update and the
    metrics share one `cond` (`update_or_drop`). Under a strategy, one
    replica too, the optimizer cannot update inside a `cond` in replica
    context (`applying.apply_if`)."""
    return (
        state.accumulator is None
        and state.drops_nonfinite()
        and not distributed()
        and state.options.keras_metrics
    )
